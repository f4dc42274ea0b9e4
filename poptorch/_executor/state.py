"""The state of a :class:`poptorch.PoplarExecutor`, in one place.

The executor's public methods (``executor.py``) are thin: they take the executor's
lock and hand this state to the module that does the work (``compile.py``,
``call_io.py``, ``host_sync.py``, ``inspection.py``, ``optimizer_binding.py``).
Nothing outside the executor package reads it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

import torch

from popart_compiler.errors import py_error
from popart_compiler.runtime.device import IpuModel
from popart_compiler.stages import Executable
from poptorch import enums
from poptorch._capture.args import ArgsParser, Spec
from poptorch._capture.capture import Captured
from poptorch._executor.instrument import HostWeights
from poptorch._executor.optimizer_binding import OptimizerBinding
from poptorch._executor.progress import ProgressBar
from poptorch._files.program import Program
from poptorch.options import Options

__all__ = ["Compiled", "ExecutorState", "NO_EXECUTABLE", "executor_options"]

#: The message of every method that needs a compiled executable.
NO_EXECUTABLE = "Model has not been compiled or has been destroyed."


@dataclasses.dataclass
class Compiled:
    """What one compilation committed.

    Attributes:
        program: the captured (or loaded) program and the call structure it was
            captured for.
        executable: the compiler's product.
        device: the attached IPU Model (``None`` offline).
        session: the session running ``executable`` (``None`` offline).
        recapture: captures the program again, uncompiled (``save()`` of a program
            that was not serialized before compiling rewrote it); ``None`` for a
            loaded program, which keeps its blobs.
        steady: the inputs of the last call that ran (see
            :func:`poptorch._executor.call_io.steady_inputs`), ``None`` before one.
    """
    program: Program
    executable: Executable
    device: Optional[IpuModel]
    session: Any
    recapture: Optional[Callable[[], Program]] = None
    steady: Optional[tuple] = None

    @property
    def captured(self) -> Captured:
        return self.program.captured

    @property
    def input_spec(self) -> Spec:
        return self.program.input_spec

    @property
    def input_names(self) -> List[str]:
        return self.program.input_names

    @property
    def num_positional(self) -> int:
        return self.program.num_positional


@dataclasses.dataclass
class ExecutorState:
    """Everything a :class:`~poptorch.PoplarExecutor` holds.

    Attributes:
        options: the executor's private, frozen ``Options`` clone.
        training: a training (``True``) or inference executor.
        user_model: the user's module (instrumented for training).
        model: the module captured (a shallow copy of ``user_model``).
        parser: binds call arguments to ``forward``'s signature.
        poptorch_version: the version that wrapped the model (cache keys, files).
        binding: the optimizer and its device state (training).
        host: the host's view of the device weights (shared with the model's
            instrumentation).
        per_replica_params: replica groupings of weights (docs/semantics.md S-27), by parameter
            name.
        compiled: the committed compilation, or ``None``.
        attached: the device is attached.
        ran: a call ran since the compilation (``cycleCount``).
        progress: the progress bar (and timer) of the last compilation.
        rng_cache: the device RNG state as last read or set (``[seed, *state]``, or
            ``[seed]`` from ``Options.randomSeed``).
        rng_stale: the device RNG may have moved since ``rng_cache`` was read.
        anchor_values: the anchors of the last run, by short name.
        warned: one-time warnings already given.
    """
    options: Any
    training: bool
    user_model: torch.nn.Module
    model: torch.nn.Module
    parser: ArgsParser
    poptorch_version: str
    binding: OptimizerBinding
    host: HostWeights
    per_replica_params: Dict[str, Any] = dataclasses.field(default_factory=dict)
    compiled: Optional[Compiled] = None
    attached: bool = False
    ran: bool = False
    progress: Optional[ProgressBar] = None
    rng_cache: Optional[List[int]] = None
    rng_stale: bool = False
    anchor_values: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    warned: set = dataclasses.field(default_factory=set)

    @property
    def session(self) -> Any:
        """The session, or ``None`` (not compiled, or offline)."""
        return self.compiled.session if self.compiled is not None else None

    @property
    def executable(self) -> Optional[Executable]:
        return self.compiled.executable if self.compiled is not None else None

    def require_compiled(self) -> Compiled:
        """The committed compilation.

        Raises:
            poptorch.Error: :data:`NO_EXECUTABLE`.
        """
        if self.compiled is None:
            raise py_error(NO_EXECUTABLE)
        return self.compiled

    @property
    def batch_factor(self) -> int:
        """``N = D × (R / g) × A``: combined batch / micro-batch of a call
        (docs/semantics.md S-11)."""
        o = self.options
        a = o.Training.gradient_accumulation if self.training else 1
        return o.device_iterations * (o.replication_factor // o.input_group_size) * a


def executor_options(options: Optional[Options], training: bool) -> Options:
    """The executor's private, frozen clone of ``options`` (the caller's object is
    frozen too, docs/api-sections.md options §1), with PopTorch's default output mode (``Final`` in
    training, ``All`` in inference) and anchors inheriting it.

    Raises:
        poptorch.Error: ``options`` is not an ``Options``; gradient accumulation is not
            1 in inference.
    """
    if options is None:
        options = Options()
    if not isinstance(options, Options):
        raise py_error(f"Invalid type: 'options' is of type {type(options)} (Expected "
                       "poptorch.Options)")
    options._freeze()
    opts = options.clone()
    if opts.defaultOutputMode():
        opts.outputMode(enums.OutputMode.Final if training else enums.OutputMode.All)
    if not training and opts.Training.gradient_accumulation != 1:
        pipelined = type(opts._execution_strategy).__name__ == "PipelinedExecution"
        raise py_error(
            "You must set poptorch.Options().Training.gradientAccumulation to 1 or "
            "leave it as its default value (1) when running a poptorch.inferenceModel()."
            + (" Use poptorch.Options().deviceIterations to process a sufficient number "
               "of batches each run for pipelined execution instead." if pipelined else ""))
    for entry in opts.anchored_tensors.values():
        if entry[1]:  # the mode was not given: inherit the model's
            entry[2] = enums.OutputMode(opts.output_mode)
            entry[3] = opts.output_return_period
    opts._freeze()
    return opts
