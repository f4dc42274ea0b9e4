"""The IPU Model's estimate of a compiled program: memory per IPU and cycles
(:mod:`popart_compiler.cost`), the profile report when asked for (docs/semantics.md S-85) and the
report of a program that does not fit (a warning, as Poplar's IPU Model; the error in strict
mode)."""
from __future__ import annotations

import dataclasses
import os

from popart_compiler.cost import cost_model
from popart_compiler.cost.ipu_model import target_for
from popart_compiler.cost.profile_report import write_report
from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation, PassResult, unchanged

__all__ = ["estimate"]


def estimate(graph: Graph, c: Compilation) -> PassResult:
    """``c.estimate``: memory and cycles of the placed program; writes the profile
    report when ``autoReport.all`` is set.

    Raises:
        Error: out of memory on an IPU in strict mode (``type ==
            "poplar_out_of_memory"``, ``SessionOptions.strict_memory`` without the engine
            option ``debug.allowOutOfMemory``; otherwise a warning).
    """
    o = c.options
    target = target_for(o.ipu_model_version, o.small_ipu_model)
    result = cost_model.estimate(graph, o, c.training, target, c.optimizer)
    # the options carry PopTorch's implicit defaults already (``session_defaults``)
    result = dataclasses.replace(result, defaults=tuple(c.defaults) + result.defaults)
    directory = o.profile_dir(c.training)
    if directory is not None:
        write_report(directory, result, os.path.basename(directory), c.training)
    allow = o.engine_options.get("debug.allowOutOfMemory", "false").lower()
    cost_model.check(result, strict=o.strict_memory, allow_out_of_memory=allow == "true")
    c.estimate = result
    return unchanged(graph)
