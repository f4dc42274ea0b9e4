"""``PoplarExecutor``: the object returned by ``trainingModel`` / ``inferenceModel``
(spec api §5, §6; semantics S-1…S-36, S-44, S-95…S-97).

This module holds the executor's life cycle: construction, compilation, running a
call, optimizer changes, attach / detach and destroy. Its other parts live beside it:
:mod:`._executor_io` (a call's arguments and results), :mod:`._executor_sync` (weight,
buffer and RNG copies between host and device), :mod:`._executor_inspection` (the
read-only inspection API), :mod:`._optimizer_binding` (the optimizer the executor
trains with and its device state) and :mod:`._executor_lock` (the per-executor lock).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from popart_compiler import compiler
from popart_compiler.stages import Executable
from popart_compiler.errors import py_error
from popart_compiler.cost.ipu_model import acquire_device
from popart_compiler.runtime.session import InferenceSession
from popart_compiler.runtime.training import TrainingSession
from popart_compiler.runtime.warm_up import warm_up
from popart_compiler.session_options import (Anchor, ReplicaGrouping, SessionOptions,
                                             ipu_model_env)

from poptorch._executor import instrument as _instrument
from poptorch import enums
from poptorch._capture.args import ArgsParser, BoundArgs, Spec
from poptorch._capture.capture import Captured
from poptorch._files.cache import program_for
from poptorch._executor.inspection import InspectionMixin
from poptorch._executor.call_io import CallIOMixin
from poptorch._executor.lock import serialised
from poptorch._executor.host_sync import TRAINING_WRAPPERS, HostSyncMixin
from poptorch._impl import isRunningOnIpu
from poptorch._logging import logger
from poptorch._executor.optimizer_binding import OptimizerBinding
from poptorch._executor.progress import ProgressBar
from poptorch._executor.replica_grouping import ReplicaGroupingProxy, check_per_replica_params
from poptorch.options import Options

__all__ = ["PoplarExecutor", "NO_EXECUTABLE"]

#: The message of every method that needs a compiled executable.
NO_EXECUTABLE = "Model has not been compiled or has been destroyed."


class PoplarExecutor(CallIOMixin, HostSyncMixin, InspectionMixin):
    """A model wrapped for the (simulated) IPU. Created by :func:`poptorch.trainingModel`,
    :func:`poptorch.inferenceModel` — not directly.

    Calling it runs ``deviceIterations × gradientAccumulation`` micro-batches on each
    replica (S-10); the first call (or :meth:`compile`) captures ``forward`` once with
    ``torch.export`` and compiles it for the IPU Model (S-1). Attributes not defined
    here are looked up on the wrapped model (api §5.22). Behaviour follows PopTorch.

    Reliability (beyond PopTorch's S-73): a call is all-or-nothing — an exception or
    ``KeyboardInterrupt`` during the run leaves device weights, optimizer state,
    buffers, the device RNG and the host's view as before the call, and a first call
    that fails commits no compilation (the next call captures again). Executors may be
    used from several threads: one executor runs one call (or weight copy, optimizer
    change, attach / detach) at a time, captures are serialised process-wide, and a
    Ctrl-C during a capture is raised once the capture has ended.
    """

    def __init__(self, model: torch.nn.Module, options: Optional[Options], training: bool,
                 poptorch_version: str, optimizer: Optional[torch.optim.Optimizer] = None,
                 user_model: Optional[torch.nn.Module] = None):
        #: One call at a time per executor (re-entrant: a call may copy weights).
        self._lock = threading.RLock()
        if options is None:
            options = Options()
        if not isinstance(options, Options):
            raise py_error(f"Invalid type: 'options' is of type {type(options)} (Expected "
                           "poptorch.Options)")
        options._freeze()
        opts = options.clone()
        self._poptorch_version = poptorch_version
        self._training = training
        self._user_model = user_model if user_model is not None else model
        self._model = model
        if opts.defaultOutputMode():
            opts.outputMode(enums.OutputMode.Final if training else enums.OutputMode.All)
        if not training and opts.Training.gradient_accumulation != 1:
            pipelined = (type(opts._execution_strategy).__name__ == "PipelinedExecution")
            raise py_error(
                "You must set poptorch.Options().Training.gradientAccumulation to 1 or "
                "leave it as its default value (1) when running a poptorch.inferenceModel()."
                + (" Use poptorch.Options().deviceIterations() to process a larger number "
                   "of batches simultaneously instead." if pipelined else ""))
        for short, entry in opts.anchored_tensors.items():
            if entry[1]:  # the mode was not given: inherit the model's
                entry[2] = enums.OutputMode(opts.output_mode)
                entry[3] = opts.output_return_period
        opts._freeze()
        self._options = opts
        self._parser = ArgsParser(model.forward)
        self._executable: Optional[Executable] = None
        self._session = None
        self._device = None
        self._attached = False
        self._captured: Optional[Captured] = None
        self._program = None  # the Program compiled (see _program.py)
        self._loaded_program = None  # set by loadExecutable: compiled instead of capturing
        self._capture_args = None  # (bound, spec, micro-batch) of the last capture
        self._serialize_program = False  # keep the uncompiled program (compileAndExport)
        self._input_spec: Optional[Spec] = None
        self._input_names: List[str] = []
        self._num_positional = 0
        self._warned_contiguous = False
        self._warned_requires_grad = False
        self._progress: Optional[ProgressBar] = None
        self._host_weights_stale = False
        self._host_weights_version = 0
        self._uploaded_version: Optional[Tuple[Any, int]] = None  # see HostSyncMixin
        self._rng_cache: Optional[List[int]] = (
            [int(opts.random_seed)] if opts.exists("random_seed") else None)
        self._rng_stale = False
        self._optimizer_binding = OptimizerBinding(self._user_model, opts, training)
        self._anchor_values: Dict[str, torch.Tensor] = {}
        self._ran = False
        self.per_replica_params: Dict[str, Any] = {}
        if training:
            if optimizer is None:
                from poptorch.optim import SGD
                optimizer = SGD(self._user_model.parameters(), lr=0.01)
            self.setOptimizer(optimizer)
            self._instrumentModel()

    # -- properties -------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The user's module (instrumented for training executors)."""
        return self._user_model

    @property
    def options(self) -> Options:
        """This executor's private, frozen ``Options`` clone."""
        return self._options

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_user_model", "_training",
                                                "_optimizer_binding"):
            raise AttributeError(name)
        model = self.__dict__["_user_model"]
        value = getattr(model, name)
        if isinstance(value, torch.nn.Parameter):
            with _instrument.syncing():
                direct = model._parameters.get(name) is value
            if direct:
                return ReplicaGroupingProxy(self, name, value)
        return value

    def __deepcopy__(self, memo):
        raise py_error("A PoplarExecutor cannot be copied: copy the model "
                       "(copy.deepcopy(executor.model)) and wrap the copy instead.")

    def __copy__(self):
        self.__deepcopy__({})

    def __reduce_ex__(self, protocol):
        raise py_error("A PoplarExecutor cannot be pickled: save the model (or its "
                       "state_dict()) instead, and wrap it again after loading.")

    def __repr__(self) -> str:
        from poptorch._ops.printing import module_repr
        return module_repr(self._user_model)

    # -- state ------------------------------------------------------------------------

    def isCompiled(self) -> bool:
        """Whether an executable exists (not before the first compile nor after
        :meth:`destroy`)."""
        return self._executable is not None

    def isAttachedToDevice(self) -> bool:
        """Whether the device is attached (``False`` when not compiled)."""
        return self._executable is not None and self._attached

    def _require_executable(self) -> None:
        if self._executable is None:
            raise py_error(NO_EXECUTABLE)

    # -- compilation -------------------------------------------------------------------

    def _session_options(self) -> Tuple[SessionOptions, ProgressBar]:
        """The session options and the compilation progress bar (a silent timer when
        ``showCompilationProgressBar(False)``)."""
        o = self._options
        values = o.toDict()
        bar = values.pop("compilation_progress_bar_fn", None) or ProgressBar(show=False)
        anchors = []
        for short, (long_name, _inherit, mode, period) in o.anchored_tensors.items():
            anchors.append(Anchor(long_name, int(mode), int(period) if int(mode) == 1 else 1,
                                  key=short))
        groupings = {name: ReplicaGrouping(int(cgt), int(shards), int(mode))
                     for name, (cgt, shards, mode) in self.per_replica_params.items()}
        return SessionOptions.from_dict(values, anchors, replica_groupings=groupings), bar

    def _model_selection(self) -> Tuple[bool, Optional[bool], bool]:
        """``(use_ipu_model, explicitly_requested, small)`` as PopTorch decides (S-82)."""
        env_model, env_small = ipu_model_env()
        o = self._options
        if o.exists("use_model"):
            logger.info("From the user configuration: Ipu model: %s",
                        "Enabled" if o.use_model else "Disabled")
            return bool(o.use_model), bool(o.use_model), env_small and not env_model
        return True, env_model or env_small, env_small and not env_model

    def _instrumentModel(self) -> None:
        """Training: (re-)instrument the user model for this executor — at wrap time and
        when recompiling after :meth:`destroy` removed the instrumentation.

        Raises:
            RuntimeError: another live training executor wraps the model.
        """
        model = self._user_model
        ref = _instrument.executor_ref_of(model)
        if ref is not None and ref() is self:
            return
        other = TRAINING_WRAPPERS.get(id(model))
        if other is not None and other is not self and _instrument.is_instrumented(model):
            raise RuntimeError(
                "Model has already been wrapped in 'poptorch.trainingModel'. Call "
                "model.destroy() on the model to unwrap it before wrapping it again.")
        _instrument.instrument(model, self)
        TRAINING_WRAPPERS[id(model)] = self

    def _compile(self, bound: BoundArgs, tensors: List[torch.Tensor], spec: Spec) -> None:
        o = self._options
        if self._training:
            self._instrumentModel()
        sess_opts, self._progress = self._session_options()
        check_per_replica_params(self._user_model, sess_opts)
        use_model, explicit, small = self._model_selection()
        sess_opts.small_ipu_model = small
        connection = int(o.connection_type)
        offline = connection == int(enums.ConnectionType.Never)

        def acquire(num_ipus):
            return acquire_device(num_ipus, sess_opts.ipu_model_version,
                                  use_ipu_model=use_model, explicit_model_request=explicit,
                                  small=small, offline=offline,
                                  ipu_id=o.ipu_id if o.exists("ipu_id") else None,
                                  torch_device=sess_opts.device,
                                  auto_round_num_ipus=bool(o.auto_round_num_ipus))

        progress = self._progress
        try:
            progress(0, 10)
            compiler.prepare(sess_opts)  # overlaps the capture
            program = program_for(self, bound, tensors, spec, sess_opts)
            captured = program.captured
            progress(4, 10)
            exe = compiler.compile(captured.graph, sess_opts, self._training,
                                   progress=lambda p, t: progress(4 + (5 * p) // t, 10),
                                   optimizer=self._optimizer_binding.description
                                   if self._training else None)
            warm_up(exe)  # the inductor backend compiles its kernels here
            # The IPUs needed are known once the graph is placed (S-64); with
            # ConnectionType.OnDemand the device is acquired after compiling too.
            device = acquire(exe.num_ipus)  # offline: raises for the rejected cases
            progress(10, 10)
        finally:
            progress.close()
        # Committed only once complete: a failure (or Ctrl-C) while creating the
        # session or uploading the state leaves the executor uncompiled.
        try:
            self._program = program
            self._captured = captured
            self._input_spec = program.input_spec
            self._input_names = list(program.input_names)
            self._num_positional = program.num_positional
            self._executable = exe
            self._device = device
            self._ran = False
            if offline:
                self._session = None
                self._attached = False
                return
            if self._training:
                self._session = TrainingSession(exe, device,
                                                self._optimizer_binding.description)
                self._optimizer_binding.mark_state_pending()  # uploaded with the weights
            else:
                self._session = InferenceSession(exe, device)
            self._attached = True
            self._uploadState()
            if self._training:  # multi-process: every process starts from process 0's state
                self._session.broadcast_state()
        except BaseException:
            self._discard_executable()
            raise

    def _uploadState(self) -> None:
        """Host → device at compile / attach: weights, optimizer, optimizer state, RNG."""
        self.copyWeightsToDevice()
        if self._training:
            self._optimizer_binding.upload(self._session)
        if self._rng_cache is not None:
            if len(self._rng_cache) > 1:
                logger.debug("Setting RNG state")
                self._session.setRngState(self._rng_cache)
            else:
                logger.debug("Setting random seed to: %d", self._rng_cache[0])
                self._session.setRandomSeed(self._rng_cache[0])

    @serialised
    def compile(self, *args, **kwargs) -> None:
        """Capture and compile with these example arguments, attach and upload weights,
        optimizer and RNG state — like the first call, without running (api §5.3).

        Logs a warning and does nothing if already compiled.
        """
        if self.isCompiled():
            logger.warning("Call to compile() ignored: the executable is already compiled")
            return
        bound, tensors, spec = self._bind(args, kwargs)
        self._compile(bound, tensors, spec)

    def compileAndExport(self, filename: str, *args, export_model: bool = True,
                         **kwargs) -> None:
        """:meth:`compile` with these arguments, then :meth:`save` to ``filename`` with
        the RNG state (api §5.4, S-62): offline precompilation."""
        self._serialize_program = True
        try:
            self.compile(*args, **kwargs)
        finally:
            self._serialize_program = False
        self.save(filename, export_model=export_model, save_rng_state=True)

    def save(self, filename: str, export_model: bool = True,
             save_rng_state: bool = True) -> None:
        """Write the compiled executable and its metadata to one file (api §5.5, S-62).
        The format is described in the README ("Precompiled executables").

        Args:
            filename: the file; its parent directory is created. A directory gets
                ``<dir>/model.poptorch`` (with a warning).
            export_model: also store the model (weights, layout and, if picklable,
                the pickled Python object), the training optimizer and its state, so
                that :func:`poptorch.load` can rebuild everything.
            save_rng_state: store :attr:`rng_state`.

        Raises:
            poptorch.Error: not compiled (``NO_EXECUTABLE``); nothing to export (no
                device work); values that cannot be stored (custom-class constants,
                custom-parser arguments, unsupported optimizer classes).
            AssertionError: the parent of ``filename`` exists but is not a directory.
        """
        from poptorch._files.export import save
        save(self, filename, export_model, save_rng_state)

    def loadExecutable(self, filename: str) -> None:
        """Load an executable saved by :meth:`save` into this wrapper, which must wrap
        an equivalent model with the same compile-time options (api §5.6, S-62). No
        capture takes place; the weights uploaded are this wrapper's model's current
        host weights (not the file's), with its optimizer and RNG settings.

        Raises:
            poptorch.Error: "Invalid file <f>: <reason>": unreadable or corrupted file,
                another format or PopTorch version, a training / inference mismatch, a
                model with other weights or ``forward`` arguments, other compile-time
                options.
        """
        from poptorch._files.export import load_executable
        load_executable(self, filename)

    def _loadProgram(self, program) -> None:
        """Compile ``program`` (read from a file) instead of capturing the model."""
        if self.isCompiled():
            self.destroy()
        self._loaded_program = program
        try:
            self._compile(None, [], program.input_spec)
        finally:
            self._loaded_program = None

    # -- running ----------------------------------------------------------------------

    @serialised
    def __call__(self, *args, **kwargs):
        """Run the model on the device (api §5.2). Takes what ``forward`` takes.

        Returns:
            The structure ``forward`` returned at capture time, each tensor with its
            first dimension multiplied per the output mode (S-12…S-14); ``None`` if
            ``forward`` returned ``None``.

        Raises:
            AssertionError: bad batch dimension (S-11), bad arguments (S-20), running an
                offline (``ConnectionType.Never``) model.
            poptorch.Error: inputs that differ from the compiled ones (S-22), a missing
                mandatory argument, capture or compile errors.
            Exception: whatever the run raises (e.g. ``IndexError`` for an
                out-of-range class label); the device and host then hold what they
                held before the call.
        """
        if isRunningOnIpu():
            raise py_error(
                "A PopTorch model cannot be called inside the forward of another wrapped "
                "model: call the underlying module (executor.model) there instead.")
        if int(self._options.connection_type) == int(enums.ConnectionType.Never):
            raise AssertionError(
                "Trying to run a model on an offline device (ConnectionType.Never): use "
                "model.compile(inputs) instead of model(inputs).")
        bound, tensors, spec = self._bind(args, kwargs)
        first = not self.isCompiled()
        if first:
            self._compile(bound, tensors, spec)
        else:
            self._validateInputs(bound, spec)
            if not self._attached:
                self.attachToDevice()
        try:
            self._prepare_run()
            inputs = self._device_inputs(tensors)
            outputs = self._run_session(inputs)
        except BaseException:
            if first:  # a compile is committed by its first successful run
                self._discard_executable()
            raise
        self._ran = True
        self._writeBackInputs(tensors, inputs)
        self._anchor_values = {a.key: self._session.anchors[a.key]
                               for a in self._executable.options.anchors
                               if a.key in self._session.anchors}
        return self._buildOutputs(outputs)

    def _prepare_run(self) -> None:
        """What a call does on the device before running: the trainer's latest weights
        (inference, S-31), a pending optimizer and optimizer state (training)."""
        binding = self._optimizer_binding
        if not self._training:
            self._syncFromTrainer()
        elif binding.pending:
            binding.pending = False
            self._session.setOptimizer(binding.description)
        if self._training and binding.optimizer is not None and \
                getattr(binding.optimizer, "_state_pending", False):
            if self._host_weights_stale:
                self._implicitCopyWeightsToHost()
            binding.write_pending_state(self._session)

    def _run_session(self, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
        """Run the session (all or nothing, S-73). The host is told before the run
        that the device may move ahead, so that a Ctrl-C arriving just after the run
        leaves no trained weights unseen; after a rolled-back run the flags are put
        back."""
        binding = self._optimizer_binding
        flags = (self._rng_stale, self._host_weights_stale, binding.state_stale)
        self._rng_stale = True
        if self._training:
            self._host_weights_stale = binding.state_stale = True
        try:
            return self._session.run(inputs)
        except BaseException:
            self._rng_stale, self._host_weights_stale, binding.state_stale = flags
            raise

    # -- optimizer (see _optimizer_binding.py) --------------------------------------------

    @serialised
    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Set or update the optimizer (api §5.12, S-50…S-58).

        New hyper-parameter values of variable attributes are pushed to the device
        immediately if attached (at the next attach otherwise), without recapturing or
        recompiling. Every check runs before anything changes: on error the current
        optimizer, the device weights and the device optimizer state stay as they were.

        Raises:
            AttributeError: inference models.
            AssertionError / ValueError: unsupported optimizer or attribute values;
                a float16 ``accum_type`` after compiling with the ``Post`` mean strategy.
            poptorch.Error: parameters that do not belong to the model; a change that
                needs recompilation (S-52); a stored optimizer state that does not fit.
        """
        if not self._training:
            raise AttributeError("setOptimizer is only supported by training models "
                                 "(poptorch.trainingModel).")
        self._optimizer_binding.bind(self, optimizer)

    @serialised
    def _checkOptimizerStateFits(self, optimizer, ipu_state) -> None:
        """Called by ``optimizer.load_state_dict``: the loaded state and the loaded
        param groups' hyper-parameters must fit the compiled optimizer.

        Raises:
            poptorch.Error: see ``setOptimizer``.
        """
        self._optimizer_binding.check_state_fits(self._session, optimizer, ipu_state)

    @serialised
    def _syncOptimizerStateToHost(self) -> None:
        """Device → host: the optimizer state, unless the host copy is current."""
        self._optimizer_binding.sync_state_to_host(self._session)

    # -- device attachment ---------------------------------------------------------------

    @serialised
    def detachFromDevice(self) -> None:
        """Release the device (api §5.13). Training executors first copy weights and
        optimizer state back; every executor saves its RNG state.

        Raises:
            poptorch.Error: not compiled, or not attached.
        """
        self._require_executable()
        if not self._attached:
            raise py_error("Device is not attached")
        self._readRng()
        if self._training:
            self.copyWeightsToHostIfNeeded()
            self._syncOptimizerStateToHost()
        self._attached = False
        logger.debug("Detached from device %d", self._device.device_id if self._device else 0)

    @serialised
    def attachToDevice(self) -> None:
        """Attach again and re-upload weights, optimizer and RNG state (api §5.13).

        Raises:
            poptorch.Error: not compiled, or already attached.
            AssertionError: ``ConnectionType.Never``.
        """
        self._require_executable()
        if int(self._options.connection_type) == int(enums.ConnectionType.Never):
            raise AssertionError("Trying to attach to an offline device "
                                 "(ConnectionType.Never)")
        if self._attached:
            raise py_error("Device is already attached")
        self._attached = True
        if self._training:
            self._optimizer_binding.mark_state_pending()
        self._uploadState()

    def _discard_executable(self) -> None:
        """Forget a compilation whose first run failed: the next call captures and
        compiles again (possibly for other input types). Nothing ran on the device,
        so there is nothing to copy back."""
        self._executable = None
        self._program = None
        self._session = None
        self._attached = False
        self._captured = None
        self._input_spec = None
        self._input_names = []

    @serialised
    def destroy(self) -> None:
        """Discard the executable (api §5.15). Training executors copy weights and
        optimizer state back first and remove the model's instrumentation. The executor
        can be called again afterwards: it recompiles."""
        if self._executable is None:
            return
        if self._training:
            self.copyWeightsToHostIfNeeded()
            self._syncOptimizerStateToHost()
        self._executable = None
        self._session = None
        self._attached = False
        self._captured = None
        if self._training:
            if _instrument.is_instrumented(self._user_model):
                _instrument.uninstrument(self._user_model)
            if TRAINING_WRAPPERS.get(id(self._user_model)) is self:
                del TRAINING_WRAPPERS[id(self._user_model)]

    def __del__(self):
        """A training executor that goes away hands its trained weights and its optimizer
        state to the host and removes the instrumentation, so nothing trained is lost."""
        # At interpreter shutdown the modules used here may already be gone.
        with contextlib.suppress(Exception):
            if not self.__dict__.get("_training") or "_user_model" not in self.__dict__:
                return
            if self._executable is not None and self._host_weights_stale:
                self.copyWeightsToHost()
            if self._executable is not None:
                self._syncOptimizerStateToHost()
            model = self._user_model
            ref = _instrument.executor_ref_of(model)
            if ref is not None and ref() in (None, self):
                _instrument.uninstrument(model)


def _forward_of(model: torch.nn.Module) -> Callable:
    return model.forward

