"""What the runtime reports about a program it is given to run: the profile report when
asked for (docs/semantics.md S-85, ``autoReport.all``) and a program that does not fit on its IPUs
(a warning, as Poplar's IPU Model; the error in strict mode, as hardware).

The compiler only estimates (its ``estimate`` pass writes nothing and raises nothing):
whoever loads the executable calls :func:`report` once, before running it (PopTorch's
compile step: ``poptorch._executor.compile.compile_program``, also offline).
"""
from __future__ import annotations

import os

from popart_compiler.cost import cost_model
from popart_compiler.cost.profile_report import write_report
from popart_compiler.stages import Executable

__all__ = ["report"]


def report(exe: Executable) -> None:
    """Write the profile report of ``exe`` when its options ask for one
    (``SessionOptions.profile_dir``: ``<autoReport.directory>/training`` or
    ``/inference``; ``profile.json``, ``profile.pop``, ``profile.html``), then report a
    program that does not fit. Nothing happens for an executable without an estimate.

    Raises:
        Error: out of memory on an IPU in strict mode (``type ==
            "poplar_out_of_memory"``, ``SessionOptions.strict_memory`` without the
            engine option ``debug.allowOutOfMemory``; otherwise a warning). The
            profile report is written first, as Poplar writes it for a program that
            does not fit.
    """
    o, result = exe.options, exe.estimate
    if result is None:
        return
    directory = o.profile_dir(exe.training)
    if directory is not None:
        write_report(directory, result, os.path.basename(directory), exe.training)
    allow = o.engine_options.get("debug.allowOutOfMemory", "false").lower()
    cost_model.check(result, strict=o.strict_memory, allow_out_of_memory=allow == "true")
