"""``Options.Backend``: where and how the IPU Model runs a compiled program.

Not a PopTorch option group (PopTorch targets real IPUs); our simulator's extension,
documented in ``docs/backends.md``. Environment variables
let unchanged PopTorch scripts switch backend:

* ``POPTORCH_EXECUTION_DEVICE``: ``cpu`` (default) or ``cuda``.
* ``POPTORCH_COMPILER``: ``auto`` (default), ``eager`` or ``inductor``.
* ``POPTORCH_AUTO_BACKEND``: ``eager`` / ``inductor`` pin what ``auto`` runs;
  ``redecide`` decides again; unset: ``auto`` reuses the choice recorded for the program
  on this machine (:mod:`popart_compiler.backends.decisions`).

The values travel through ``Options.toDict()`` under the keys ``execution_device`` and
``compiler_backend`` into ``popart_compiler``'s ``SessionOptions.device`` /
``SessionOptions.backend``, and are part of the executable-cache key
(``SessionOptions.backend_key``).
"""
from __future__ import annotations


import torch
from poptorch._options import environment as config

from poptorch._options.dict import OptionsDict

__all__ = ["EXECUTION_DEVICES", "COMPILERS"]

#: Accepted execution devices.
EXECUTION_DEVICES = ("cpu", "cuda")
#: Accepted compilers: ``eager`` runs the captured ATen graph with eager kernels;
#: ``inductor`` compiles it with TorchInductor; ``auto`` starts eager and keeps
#: whichever of the two runs the program faster (:mod:`popart_compiler.backends.auto`).
COMPILERS = ("eager", "inductor", "auto")


def _check(kind: str, value, allowed, env: str) -> str:
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ValueError(f"Invalid {kind} {value!r} (from Options.Backend or {env}): "
                         f"pick one of {', '.join(allowed)}.")
    return value.lower()


class _BackendOptions(OptionsDict):
    """``Options.Backend``: values ``execution_device: str = "cpu"``,
    ``compiler_backend: str = "auto"``; the constructor reads
    ``POPTORCH_EXECUTION_DEVICE`` and ``POPTORCH_COMPILER``.

    Raises:
        ValueError: an unknown device or compiler (from a setter or the environment).
    """

    def __init__(self):
        super().__init__(execution_device="cpu", compiler_backend="auto")
        device = config.execution_device()
        compiler = config.compiler()
        self.executionDevice(device)
        self.compiler(compiler)

    def executionDevice(self, device: str):
        """Run the IPU Model's kernels on ``"cpu"`` (default) or ``"cuda"`` (the
        current CUDA device). Returns self.

        Raises:
            ValueError: an unknown device, or ``"cuda"`` without a CUDA device.
        """
        device = _check("execution device", device, EXECUTION_DEVICES,
                        "POPTORCH_EXECUTION_DEVICE")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("Execution device 'cuda' was requested but PyTorch sees no "
                             "CUDA device: use 'cpu' or run on a machine with a GPU.")
        return self.set(execution_device=device)

    def compiler(self, compiler: str):
        """Compile the captured graphs with ``"auto"`` (the default: runs eager at
        once; once the program's calls took 20 times the expected compilation time,
        TorchInductor compiles it in a low-priority thread, both are timed on the
        real calls and the faster is kept, and recorded for this program on this
        machine: later runs start on the recorded backend; see ``docs/backends.md``),
        ``"eager"`` (PyTorch eager kernels, no compilation) or ``"inductor"``
        (TorchInductor: each program compiles while the model compiles, or at its
        first run; later runs with the same input shapes reuse it). Returns self.

        Raises:
            ValueError: an unknown compiler.
        """
        return self.set(compiler_backend=_check("compiler", compiler, COMPILERS,
                                                "POPTORCH_COMPILER"))

    @property
    def device(self) -> str:
        """The execution device."""
        return self._values["execution_device"]

    @property
    def compilerName(self) -> str:
        """The compiler."""
        return self._values["compiler_backend"]
