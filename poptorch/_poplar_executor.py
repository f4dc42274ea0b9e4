"""``PoplarExecutor``: the object returned by ``trainingModel`` / ``inferenceModel``
(spec api §5, §6; semantics S-1…S-36, S-44, S-95…S-97).
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from popart_compiler.compiler import Compiler, Executable
from popart_compiler.errors import backend_error, py_error
from popart_compiler.ipu_model import acquire_device
from popart_compiler.session import InferenceSession, TrainingSession
from popart_compiler.warm_up import warm_up
from popart_compiler.ir import annotation_text
from popart_compiler.session_options import (Anchor, ReplicaGrouping, SessionOptions,
                                             ipu_model_env)

from . import _instrument, enums
from ._args import (ArgsParser, BoundArgs, Spec, check_batch, flatten, leaf_names,
                    unflatten, validate)
from ._capture import Captured
from ._executable_cache import program_for
from ._impl import isRunningOnIpu
from ._logging import logger
from ._progress import ProgressBar
from ._replica_grouping import ReplicaGroupingProxy
from .options import Options

__all__ = ["PoplarExecutor", "NO_EXECUTABLE"]

#: The message of every method that needs a compiled executable.
NO_EXECUTABLE = "Model has not been compiled or has been destroyed."

#: Training executors by ``id(user model)`` (live ones only).
_TRAINING_WRAPPERS: "weakref.WeakValueDictionary[int, PoplarExecutor]" = \
    weakref.WeakValueDictionary()


def _no_backward(*args, **kwargs):
    raise py_error("backward() cannot be called explicitly on outputs of a PopTorch "
                   "model. If you're using a trainingModel, the backward pass is "
                   "performed automatically when invoking the model. If you're using an "
                   "inferenceModel, you should use a trainingModel instead.")


def _serialised(method: Callable) -> Callable:
    """Run ``method`` holding its executor's lock: calls, weight copies, optimizer
    changes and attachment of one executor never interleave across threads."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


class PoplarExecutor:
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
        self._uploaded_version = -1
        self._rng_cache: Optional[List[int]] = (
            [int(opts.random_seed)] if opts.exists("random_seed") else None)
        self._rng_stale = False
        self._optimizer = None
        self._optimizer_description = None
        self._optimizer_pending = False
        self._optimizer_state_stale = False
        self._anchor_values: Dict[str, torch.Tensor] = {}
        self._ran = False
        self.per_replica_params: Dict[str, Any] = {}
        if training:
            from .optim import OptimizerAttrTracker
            self._attr_tracker = OptimizerAttrTracker(
                bool(opts._relax_optimizer_attributes_checks))
            if optimizer is None:
                from .optim import SGD
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
        if name.startswith("__") or name in ("_user_model", "_training", "_attr_tracker"):
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
        from ._printing import module_repr
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

    def _bind(self, args, kwargs) -> Tuple[BoundArgs, List[torch.Tensor], Spec]:
        bound = self._parser.bind(args, kwargs)
        tensors: List[torch.Tensor] = []
        spec = flatten(tuple(bound.values), tensors)
        names = [n for name, child in zip(bound.names, spec.children)
                 for n in leaf_names(name, child)]
        o = self._options
        d, r, g = o.device_iterations, o.replication_factor, o.input_group_size
        a = o.Training.gradient_accumulation if self._training else 1
        factor = d * (r // g) * a
        for name, t in zip(names, tensors):
            check_batch(name, t, factor, d, r, g, a)
        return bound, tensors, spec

    def _batch_factor(self) -> int:
        o = self._options
        a = o.Training.gradient_accumulation if self._training else 1
        return o.device_iterations * (o.replication_factor // o.input_group_size) * a

    def _device_inputs(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """Contiguous, detached, 32-bit versions of the inputs (S-24, S-44)."""
        out = []
        for t in tensors:
            if t.requires_grad:
                if not self._warned_requires_grad:
                    logger.warning("Input tensor has requires_grad=True set. This tensor "
                                   "will be detached because backward pass via inputs is "
                                   "not supported.")
                    self._warned_requires_grad = True
                t = t.detach()
            if not t.is_contiguous():
                if not self._warned_contiguous:
                    logger.warning("At least one input tensor is not contiguous: non-"
                                   "contiguous tensors will be converted.")
                    self._warned_contiguous = True
                t = t.contiguous()
            if t.dtype == torch.float64:
                t = t.float()
            elif t.dtype == torch.int64:
                t = t.to(torch.int32).to(torch.int64)  # 32-bit range on the device
            out.append(t)
        return out

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
        other = _TRAINING_WRAPPERS.get(id(model))
        if other is not None and other is not self and _instrument.is_instrumented(model):
            raise RuntimeError(
                "Model has already been wrapped in 'poptorch.trainingModel'. Call "
                "model.destroy() on the model to unwrap it before wrapping it again.")
        _instrument.instrument(model, self)
        _TRAINING_WRAPPERS[id(model)] = self

    def _compile(self, bound: BoundArgs, tensors: List[torch.Tensor], spec: Spec) -> None:
        o = self._options
        if self._training:
            self._instrumentModel()
        sess_opts, self._progress = self._session_options()
        self._checkPerReplicaParams(sess_opts)
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
            program = program_for(self, bound, tensors, spec, sess_opts)
            captured = program.captured
            progress(4, 10)
            exe = Compiler.compile(captured.graph, sess_opts, self._training,
                                   progress=lambda p, t: progress(4 + (5 * p) // t, 10),
                                   optimizer=self._optimizer_description
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
                self._session = TrainingSession(exe, device, self._optimizer_description)
                if isinstance(self._optimizer, _optimizer_mixin()) and \
                        self._optimizer.has_state():
                    self._optimizer._state_pending = True  # uploaded with the weights
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
            self._optimizer_pending = False
            if self._session.optimizer.description is not self._optimizer_description:
                self._session.setOptimizer(self._optimizer_description)
            self._writePendingOptimizerState()
        if self._rng_cache is not None:
            if len(self._rng_cache) > 1:
                logger.debug("Setting RNG state")
                self._session.setRngState(self._rng_cache)
            else:
                logger.debug("Setting random seed to: %d", self._rng_cache[0])
                self._session.setRandomSeed(self._rng_cache[0])

    def _checkPerReplicaParams(self, sess_opts: SessionOptions) -> None:
        """S-27: replica-grouped weights hold one value per group on dimension 0.

        Raises:
            poptorch.Error: a scalar weight, a grouping that does not fit the
                replication factor, or a leading dimension that is not the number of
                groups (or of replicas, for ``AllReplicas``).
        """
        replicas = sess_opts.global_replicas  # groups span all processes (S-28)
        with _instrument.syncing():
            params = dict(self._user_model._parameters)
        for name, grouping in sess_opts.replica_groupings.items():
            param = params.get(name)
            if param is None:
                raise py_error(f"{name} is not a parameter of the model: replicaGrouping "
                               "only applies to direct parameters of the wrapped module.")
            if param.dim() == 0:
                raise backend_error("Scalars cannot be passed as per-replica weight tensor "
                                    "values")
            grouping.validate(name, replicas)
            groups = grouping.num_groups(replicas)
            allowed = {groups} | ({replicas} if grouping.retrieval_mode == 2 else set())
            if param.shape[0] not in allowed:
                processes = (f" × {sess_opts.num_processes} processes"
                             if sess_opts.num_processes > 1 else "")
                raise backend_error(
                    f"Per-replica weight {name} has shape {list(param.shape)}: with "
                    f"replicationFactor {sess_opts.replication_factor}{processes} and this "
                    "grouping its dimension 0 must be the number of replica groups "
                    f"({groups}), one value per group.")

    @_serialised
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
        from ._export import save
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
        from ._export import load_executable
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

    @_serialised
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
        if not self._training:
            self._syncFromTrainer()
        elif self._optimizer_pending:
            self._optimizer_pending = False
            self._session.setOptimizer(self._optimizer_description)
        if self._training and self._optimizer is not None and \
                getattr(self._optimizer, "_state_pending", False):
            if self._host_weights_stale:
                self._implicitCopyWeightsToHost()
            self._writePendingOptimizerState()

    def _run_session(self, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
        """Run the session (all or nothing, S-73). The host is told before the run
        that the device may move ahead, so that a Ctrl-C arriving just after the run
        leaves no trained weights unseen; after a rolled-back run the flags are put
        back."""
        flags = (self._rng_stale, self._host_weights_stale, self._optimizer_state_stale)
        self._rng_stale = True
        if self._training:
            self._host_weights_stale = self._optimizer_state_stale = True
        try:
            return self._session.run(inputs)
        except BaseException:
            self._rng_stale, self._host_weights_stale, self._optimizer_state_stale = flags
            raise

    def _validateInputs(self, bound: BoundArgs, spec: Spec) -> None:
        """S-22: the inputs must match those of the compilation."""
        if bound.num_positional != self._num_positional:
            raise py_error(
                f"Number of positional arguments mismatch: expected {self._num_positional} "
                f"arguments but got {bound.num_positional}.\n{_RECOMPILE}")
        compiled = dict(zip(self._input_names, self._input_spec.children))
        for name, now in zip(bound.names, spec.children):
            if name not in compiled:
                raise py_error(f"Keys mismatch for keyword arguments: Unexpected arguments: "
                               f"['{name}']. Missing arguments: "
                               f"{sorted(set(compiled) - set(bound.names))}.\n{_RECOMPILE}")
            validate(name, compiled[name], now)
        missing = [n for n in self._input_names if n not in bound.names]
        if missing:
            raise py_error(f"Keys mismatch for keyword arguments: Unexpected arguments: []. "
                           f"Missing arguments: {missing}.\n{_RECOMPILE}")

    def _writeBackInputs(self, originals: List[torch.Tensor],
                         device_inputs: List[torch.Tensor]) -> None:
        """In-place updates of inputs reach the caller's tensors (S-23): the session runs
        the graph on views of ``device_inputs``, which are copied back where they are
        not the caller's own tensors (converted dtype, made contiguous)."""
        mutated = self._executable.graph.mutated_inputs if self._executable else ()
        for i in mutated:
            src, dst = device_inputs[i], originals[i]
            if src.data_ptr() != dst.data_ptr():
                with torch.no_grad():
                    dst.copy_(src.to(dst.dtype))

    def _buildOutputs(self, outputs: List[torch.Tensor]):
        captured = self._captured
        if captured.output_spec is None:
            return None
        host = iter(captured.host_outputs)
        leaves = [outputs[i] if i is not None else next(host) for i in captured.output_leaves]
        for t in leaves:
            if isinstance(t, torch.Tensor):
                t.backward = _no_backward  # type: ignore[method-assign]
        return unflatten(captured.output_spec, iter(leaves))

    # -- weights ----------------------------------------------------------------------

    def _host_tensors(self) -> Dict[str, torch.Tensor]:
        model = self._user_model
        with _instrument.syncing():
            named = dict(model.named_parameters(remove_duplicate=False))
            named.update(dict(model.named_buffers(remove_duplicate=False)))
        return named

    @_serialised
    def copyWeightsToHost(self) -> None:
        """Device → host: every parameter and buffer, in place, keeping host dtypes
        (api §5.7). Bumps the host weight version (S-31).

        Raises:
            poptorch.Error: not compiled.
        """
        self._require_executable()
        if self._session is None:
            return
        logger.info("Writing weights from IPU to host.")
        values = self._session.readWeights()
        host = self._host_tensors()
        with _instrument.syncing(), torch.no_grad():
            for name, value in values.items():
                target = host.get(name)
                if target is None:
                    continue
                if target.shape != value.shape:  # AllReplicas: one value per replica
                    target.data = value.to(target.dtype).clone()
                else:
                    target.copy_(value.to(target.dtype))
        self._host_weights_stale = False
        self._host_weights_version += 1

    @_serialised
    def _implicitCopyWeightsToHost(self) -> None:
        if not self._host_weights_stale:  # another thread copied while this one waited
            return
        logger.debug("Implicit copyWeightsToHost()")
        self.copyWeightsToHost()

    @_serialised
    def copyWeightsToHostIfNeeded(self) -> bool:
        """Copy device → host if a run happened since the last copy; returns whether it
        copied. Always ``False`` for inference executors (api §5.9)."""
        if self._executable is None or not self._host_weights_stale:
            return False
        self._implicitCopyWeightsToHost()
        return True

    @_serialised
    def copyWeightsToDevice(self) -> None:
        """Host → device: every parameter and buffer (api §5.8). Does not first pull the
        device's weights: un-copied training results are overwritten (S-32).

        Raises:
            poptorch.Error: not compiled.
        """
        self._require_executable()
        if self._session is None:
            return
        if self._training and self._optimizer is not None and self._optimizer_state_stale:
            self._syncOptimizerStateToHost()
        logger.info("Writing weights from host to IPU memory.")
        host = self._host_tensors()
        with _instrument.syncing():
            values = {n: t.detach() for n, t in host.items()}
        self._session.writeWeights(values)
        self._host_weights_stale = False
        trainer = _TRAINING_WRAPPERS.get(id(self._user_model))
        self._uploaded_version = trainer._host_weights_version if trainer is not None \
            else self._host_weights_version

    @_serialised
    def copyNamedBuffersToDevice(self) -> None:
        """Upload only the buffers listed with ``Options.updatableNamedBuffers``.

        Raises:
            poptorch.Error: not compiled; option not set.
        """
        self._require_executable()
        names = self._options._Popart.options.get("updatableNamedBuffers")
        if not names:
            raise py_error("No named buffers marked as updatable via "
                           "updatableNamedBuffers option")
        host = self._host_tensors()
        with _instrument.syncing():
            self._session.writeWeights({n: host[n].detach() for n in names if n in host})

    @_serialised
    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True):
        """``model.load_state_dict`` then, if attached, :meth:`copyWeightsToDevice`."""
        result = self._user_model.load_state_dict(state_dict, strict)
        if self.isAttachedToDevice():
            self.copyWeightsToDevice()
        return result

    def _syncFromTrainer(self) -> None:
        """Inference wrappers of a model being trained see the latest weights (S-31)."""
        trainer = _TRAINING_WRAPPERS.get(id(self._user_model))
        if trainer is None or trainer is self:
            return
        trainer.copyWeightsToHostIfNeeded()
        if trainer._host_weights_version != self._uploaded_version:
            logger.debug("Implicit copyWeightsToDevice()")
            self.copyWeightsToDevice()

    # -- optimizer --------------------------------------------------------------------

    def _param_names(self) -> Dict[int, str]:
        with _instrument.syncing():
            return {id(p): n for n, p in self._user_model.named_parameters()}

    def _checkOptimizerParameters(self, optimizer: torch.optim.Optimizer) -> None:
        """Every parameter in the optimizer's groups must belong to the wrapped model."""
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list):
            return  # optimizer_type() rejects it
        with _instrument.syncing():
            own = {id(p) for p in self._user_model.parameters()}
        for index, group in enumerate(groups):
            foreign = [tuple(p.shape) for p in group.get("params", []) if id(p) not in own]
            if foreign:
                raise py_error(
                    f"The optimizer's param group {index} holds {len(foreign)} tensor(s) "
                    f"(shapes {foreign[:3]}) that are not parameters of the model wrapped "
                    "by this poptorch.trainingModel. Build the optimizer from the "
                    "parameters of the model you pass to poptorch.trainingModel, e.g. "
                    "optimizer = poptorch.optim.SGD(model.parameters(), lr=...).")

    def _describeOptimizer(self, optimizer: torch.optim.Optimizer, track: bool = False):
        from . import optim
        auto_ls = bool(self._options._Popart.options.get(
            "automaticLossScalingSettings.enabled", False))
        return optim.to_description(optimizer, self._param_names(), auto_ls,
                                    self._attr_tracker if track else None)

    def _checkMeanReductionStrategy(self, description) -> bool:
        """S-41: float16 gradient accumulators (except SGD's combined variant) need the
        ``Running`` mean strategy. Returns whether the options must switch to it.

        Raises:
            ValueError: the switch would be needed but the model is already compiled.
        """
        needs_running = description.accum_type == torch.float16 and not (
            description.type == "SGD" and description.use_combined_accum)
        strategy = self._options.Training.meanAccumulationAndReplicationReductionStrategy
        if not needs_running or strategy != enums.MeanReductionStrategy.Post:
            return False
        if self.isCompiled():
            raise ValueError(
                "The optimizer's accum_type is torch.float16, so "
                "poptorch.Options().Training.meanAccumulationAndReplicationReductionStrategy"
                " would have to be MeanReductionStrategy.Running, but the model is already "
                "compiled with MeanReductionStrategy.Post. Use a float16 accum_type before "
                "the first compilation, or call destroy() and compile again.")
        return True

    @_serialised
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
        from . import optim
        self._checkOptimizerParameters(optimizer)
        known = self._attr_tracker.known
        try:
            if optimizer is not self._optimizer:
                self._attr_tracker.reset()  # a new object: its attributes are the baseline
            description = self._describeOptimizer(optimizer, track=True)
            switch = self._checkMeanReductionStrategy(description)
            new_object = self.isCompiled() and self._optimizer is not None and \
                optimizer is not self._optimizer
            carries_state = isinstance(optimizer, optim.Optimizer) and optimizer.has_state()
            if self._session is not None:
                self._session.checkOptimizer(description)
                if new_object and carries_state:
                    self._session.checkOptimizerState(
                        optimizer.get_state_dict()["ipu_state"])
        except BaseException:
            self._attr_tracker.known = known  # a rejected optimizer changes nothing
            raise
        # -- all checks passed: commit --
        if switch:
            logger.info("Optimizer accum_type is float16: setting "
                        "meanAccumulationAndReplicationReductionStrategy to Running")
            self._options._unfreeze()
            self._options.Training.setMeanAccumulationAndReplicationReductionStrategy(
                enums.MeanReductionStrategy.Running)
            self._options._freeze()
        if new_object:
            if isinstance(self._optimizer, optim.Optimizer):
                self._syncOptimizerStateToHost()
                self._optimizer._executor_ref = None
            if carries_state:
                optimizer._state_pending = True
        self._optimizer = optimizer
        if isinstance(optimizer, optim.Optimizer):
            optimizer._executor_ref = weakref.ref(self)
        changed = description != self._optimizer_description
        self._optimizer_description = description
        if self._session is None:
            return
        if self._attached:
            if changed:
                self._session.setOptimizer(description)
            if getattr(optimizer, "_state_pending", False):
                self._writePendingOptimizerState()
        elif changed:
            self._optimizer_pending = True

    @_serialised
    def _checkOptimizerStateFits(self, optimizer, ipu_state) -> None:
        """Called by ``optimizer.load_state_dict``: the loaded state and the loaded
        param groups' hyper-parameters must fit the compiled optimizer.

        Raises:
            poptorch.Error: see ``setOptimizer``.
        """
        if self._session is None or optimizer is not self._optimizer:
            return
        self._session.checkOptimizerState(ipu_state)
        self._session.checkOptimizer(self._describeOptimizer(optimizer))

    @_serialised
    def _syncOptimizerStateToHost(self) -> None:
        from . import optim
        opt = self._optimizer
        if not isinstance(opt, optim.Optimizer) or self._session is None:
            return
        if not self._optimizer_state_stale and opt._state_dict.get("ipu_state") is not None:
            logger.debug("Using cached optimiser state dict")
            return
        if opt._state_pending:  # a loaded state not written yet is the latest one
            return
        logger.info("Writing optimiser state tensors from IPU to host.")
        opt._state_dict = {"ipu_state": self._session.readOptimizerState(),
                           "ipu_param": self._session.readOptimizerParams()}
        self._optimizer_state_stale = False

    def _writePendingOptimizerState(self) -> None:
        """Write a state loaded on the host (``optimizer.load_state_dict``) to the
        device, together with the hyper-parameters of the loaded param groups.

        Raises:
            poptorch.Error: the state does not fit; it is dropped (the device keeps its
                state) so that the model stays usable.
        """
        from . import optim
        opt = self._optimizer
        if not isinstance(opt, optim.Optimizer) or self._session is None:
            return
        if not opt._state_pending:
            if opt._state_dict.get("ipu_state") is None:
                self._optimizer_state_stale = True
            return
        state = opt._state_dict
        try:
            self._session.checkOptimizerState(state["ipu_state"])
            description = self._describeOptimizer(opt)
            self._session.checkOptimizer(description)
        except BaseException:
            opt._state_pending = False  # dropped: a recompile does not retry it
            opt._state_dict = dict(opt._state_dict, ipu_state=None, ipu_param=None)
            raise
        logger.info("Writing optimiser state tensors from host to IPU memory.")
        self._session.writeOptimizerState(state["ipu_state"])
        loaded_params = state.get("ipu_param")
        if isinstance(loaded_params, dict):
            for name in self._session.readOptimizerParams():
                if name not in loaded_params:
                    logger.warning("ignoring missing parameter %s", name)
        if description != self._optimizer_description:
            self._optimizer_description = description
            self._session.setOptimizer(description)
        opt._state_pending = False
        self._optimizer_state_stale = True

    # -- device attachment ---------------------------------------------------------------

    @_serialised
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

    @_serialised
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
        if self._training and isinstance(self._optimizer, _optimizer_mixin()) and \
                self._optimizer.has_state():
            self._optimizer._state_pending = True
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

    @_serialised
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
            if _TRAINING_WRAPPERS.get(id(self._user_model)) is self:
                del _TRAINING_WRAPPERS[id(self._user_model)]

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

    # -- RNG --------------------------------------------------------------------------

    def _readRng(self) -> None:
        if self._session is not None and self._rng_stale:
            logger.debug("Reading RNG state")
            self._rng_cache = self._session.getRngState()
            self._rng_stale = False

    @property
    @_serialised
    def rng_state(self) -> Optional[List[int]]:
        """``[seed, *state]`` of the device RNG (api §5.16, S-96, S-97).

        Raises:
            poptorch.Error: not compiled.
        """
        self._require_executable()
        self._readRng()
        return None if self._rng_cache is None else list(self._rng_cache)

    @rng_state.setter
    @_serialised
    def rng_state(self, state: List[int]) -> None:
        self._require_executable()
        if self._session is not None:
            self._session.checkRngState(state)
        self._rng_cache = state.copy()
        self._rng_stale = False
        if self._attached and self._session is not None:
            logger.debug("Setting RNG state")
            self._session.setRngState(self._rng_cache)

    # -- inspection ---------------------------------------------------------------------

    def cycleCount(self) -> int:
        """Cycles of the last run on the first replica (api §5.17).

        PopTorch counts them on IPU hardware only and fails to compile on the Poplar
        IPU Model. This IPU Model goes further: it returns its estimate of the run
        (:mod:`popart_compiler.cycle_model`: per-op cost, pipeline schedule, weight
        update), which is deterministic and does not depend on the host.

        Raises:
            poptorch.Error: ``Options.logCycleCount(True)`` was not set, or the model
                has not run since it was compiled.
        """
        if not self._options._Popart.options.get("instrumentWithHardwareCycleCounter"):
            raise py_error("Cycle count logging is disabled. Please set option "
                           "logCycleCount to True to enable.")
        if self._executable is None or not self._ran or self._executable.estimate is None:
            raise py_error("Please run the model at least once before obtaining cycle "
                           "count.")
        return int(self._executable.estimate.cycles.run_cycles)

    def estimatedThroughput(self) -> float:
        """The IPU Model's estimate of the samples per second of all replicas (not a
        PopTorch method): micro-batch × micro-batches per step × replicas over the
        estimated time of a step (pipeline schedule, weight update, host transfers).

        Raises:
            poptorch.Error: not compiled.
        """
        return float(self.ipuModelEstimate()["cycles"]["samples_per_second"])

    def ipuModelEstimate(self) -> Dict[str, Any]:
        """The IPU Model's estimate of the compiled program (not a PopTorch method):
        the figures written to ``profile.json`` — memory per IPU by category (bytes),
        largest tensors, cycles per run, pipeline stages and schedule, samples per
        second (see README "Memory and cycle estimates").

        Raises:
            poptorch.Error: not compiled.
        """
        self._require_executable()
        return self._executable.estimate.summary()

    def compilationTime(self) -> datetime.timedelta:
        """Wall-clock time of the last compilation (api §5.18).

        Raises:
            poptorch.Error: not compiled, or the progress bar was disabled.
        """
        if not self._options._show_compilation_progress_bar:
            raise py_error("Compilation time is only available if you set "
                           "showCompilationProgressBar option to True.")
        if self._executable is None or self._progress is None or \
                self._progress.elapsed is None:
            raise py_error("Please compile the model before obtaining compilation time.")
        return datetime.timedelta(seconds=self._progress.elapsed)

    def getPerfCounters(self) -> Dict[str, List[List[float]]]:
        """Host timestamps of the transfers of the last run (api §5.19)."""
        if self._session is None:
            return {k: [[]] for k in ("input", "input_complete", "output", "output_complete")}
        return {k: [list(v) for v in vals] for k, vals in self._session.perf_counters.items()}

    def _latency(self, start: str, start_red, end: str, end_red) -> Tuple[float, float, float]:
        counters = self.getPerfCounters()
        starts = [start_red(v) for v in zip(*counters[start])] if counters[start][0] else []
        ends = [end_red(v) for v in zip(*counters[end])] if counters[end][0] else []
        if not ends or not starts:
            return (0.0, 0.0, 0.0)
        if len(starts) != len(ends):
            if len(starts) % len(ends):
                raise AssertionError("Mismatched numbers of performance counters")
            step = len(starts) // len(ends)
            starts = [min(starts[i:i + step]) for i in range(0, len(starts), step)]
        lat = [e - s for s, e in zip(starts, ends)]
        return (min(lat), max(lat), sum(lat) / len(lat))

    def getHostIpuLatency(self):
        """``(min, max, mean)`` seconds from input start to input complete."""
        return self._latency("input", min, "input_complete", max)

    def getComputeLatency(self):
        """``(min, max, mean)`` seconds from input complete to output start."""
        return self._latency("input_complete", max, "output", max)

    def getIpuHostLatency(self):
        """``(min, max, mean)`` seconds from output start to output complete."""
        return self._latency("output", min, "output_complete", max)

    def getLatency(self):
        """``(min, max, mean)`` seconds from input start to output complete."""
        return self._latency("input", min, "output_complete", max)

    def getTensorNames(self) -> List[str]:
        """Names of the tensors of the compiled graph (S-16).

        Raises:
            AssertionError: not compiled.
        """
        if self._executable is None:
            raise AssertionError("Model must be compiled before calling getTensorNames")
        names = list(self._executable.tensor_names)
        if self._training and self._session is not None:
            names += list(self._session.optimizer.state)
        return names

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """The value of an anchor (``Options.anchorTensor``) captured by the last run.

        Raises:
            AssertionError: "No tensor with name <n> found." (unknown name or no run).
        """
        if short_name not in self._anchor_values:
            raise AssertionError(f"No tensor with name {short_name} found.")
        return self._anchor_values[short_name]

    def placementSummary(self, backward: bool = True) -> str:
        """Where the compiled program runs, as a readable table (api §9, S-60).

        One row per (IPU, pipeline stage, phase) with the number of forward ops, of
        backward ops (training; counted on the joint forward/backward graph, ``-``
        with ``backward=False``), and the number and bytes of the parameters whose
        weight update runs there. The title gives the execution strategy, the IPUs
        per replica and the number of stages (``2F − 1`` for pipelined training,
        S-63). The same table (without backward counts) is logged at DEBUG when
        the model compiles. Not part of PopTorch's API.

        Raises:
            poptorch.Error: the model is not compiled yet.
        """
        self._require_executable()
        return self._executable.placement_summary(backward=backward)

    def _debugGetPopartIR(self) -> str:
        """A text listing of the compiled graph's operations with their scoped names and
        the annotations the IPU compiler would read (``MultiConv``, ``Attribute``,
        available memory; api §8)."""
        self._require_executable()
        names = self._executable.graph.activation_names()
        return "\n".join(f"{name}: {node.format_node()}{annotation_text(node)}"
                         for name, node in names.items())


_RECOMPILE = ("The inputs given at run time differ from the ones the model was compiled "
              "with. To run with these inputs, create a new wrapper or call destroy() on "
              "this one: the next call then recompiles.")


def _forward_of(model: torch.nn.Module) -> Callable:
    return model.forward


def _optimizer_mixin():
    from .optim import Optimizer
    return Optimizer
