"""``PoplarExecutor``: the object returned by ``trainingModel`` / ``inferenceModel``
(docs/api-sections.md api §5, §6; docs/semantics.md S-1…S-36, S-44, S-95…S-97).

The class is PopTorch's API face. Its state is one
:class:`~poptorch._executor.state.ExecutorState`; each public method takes the
executor's lock and hands the state to the module that does the work:
:mod:`.compile` (capture, compile, session), :mod:`.call_io` (a call's arguments and
results), :mod:`.host_sync` (weight, buffer and RNG copies), :mod:`.inspection` (the
read-only inspection API), :mod:`.optimizer_binding` (the optimizer and its device
state) and :mod:`poptorch._files.export` (files). :mod:`.wrapping` creates executors.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Dict, List, Optional

import torch

from popart_compiler.errors import py_error
from popart_compiler.stages import Executable
from poptorch import enums, optim
from poptorch._capture.args import ArgsParser, BoundArgs, Spec
from poptorch._executor import call_io
from poptorch._executor import compile as compile_
from poptorch._executor import host_sync, instrument, lifecycle
from poptorch._executor.inspection_api import InspectionMethods
from poptorch._executor.optimizer_binding import OptimizerBinding
from poptorch._executor.replica_grouping import ReplicaGroupingProxy
from poptorch._executor.state import NO_EXECUTABLE, ExecutorState, executor_options
from poptorch._files import export
from poptorch._files.program import Program
from poptorch._impl import isRunningOnIpu
from poptorch._logging import logger
from poptorch._ops.printing import module_repr
from poptorch.options import Options

__all__ = ["PoplarExecutor", "NO_EXECUTABLE", "ALREADY_WRAPPED"]

#: PopTorch's words for wrapping a model twice for training.
ALREADY_WRAPPED = ("Model has already been wrapped in 'poptorch.trainingModel'. Call "
                   "model.destroy() on the model to unwrap before wrapping again.")


def serialised(method: Callable) -> Callable:
    """Run ``method`` holding its executor's lock: calls, weight copies, optimizer
    changes and attachment of one executor never interleave across threads."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


def _unpickled_model(model: torch.nn.Module) -> torch.nn.Module:
    """What a pickled :class:`PoplarExecutor` loads as: its model."""
    return model


class PoplarExecutor(InspectionMethods):
    """A model wrapped for the (simulated) IPU. Created by :func:`poptorch.trainingModel`,
    :func:`poptorch.inferenceModel` — not directly.

    Calling it runs ``deviceIterations × gradientAccumulation`` micro-batches on each
    replica (docs/semantics.md S-10); the first call (or :meth:`compile`) captures ``forward`` once
    with ``torch.export`` and compiles it for the IPU Model (docs/semantics.md S-1). Attributes not
    defined here are looked up on the wrapped model (docs/api-sections.md api §5.22). Behaviour
    follows PopTorch.

    Reliability (beyond PopTorch's docs/semantics.md S-73): a call is all-or-nothing —
    an exception
        or
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
        opts = executor_options(options, training)
        #: ``ConnectionType.Never`` (the options are frozen): calls are refused.
        self._offline = int(opts.connection_type) == int(enums.ConnectionType.Never)
        user_model = user_model if user_model is not None else model
        link = optim.DeviceLink(self._syncOptimizerStateToHost,
                                self._checkOptimizerStateFits)
        self._state = ExecutorState(
            options=opts, training=training, user_model=user_model, model=model,
            parser=ArgsParser(model.forward), poptorch_version=poptorch_version,
            binding=OptimizerBinding(user_model, opts, training, link),
            host=instrument.HostWeights(self, self._implicitCopyWeightsToHost),
            rng_cache=[int(opts.random_seed)] if opts.exists("random_seed") else None)
        #: Replica groupings of weights (docs/semantics.md S-27), by parameter name.
        self.per_replica_params: Dict[str, Any] = self._state.per_replica_params
        if training:
            self.setOptimizer(optimizer if optimizer is not None else
                              optim.SGD(user_model.parameters(), lr=0.01))
            self._instrumentModel()

    # -- properties -------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The user's module (instrumented for training executors)."""
        return self._state.user_model

    @property
    def options(self) -> Options:
        """This executor's private, frozen ``Options`` clone."""
        return self._state.options

    # PopTorch's private attributes that its clients read (lightning-graphcore's
    # IPUStrategy reads ``_executable`` and ``_options``); never used by this package.

    @property
    def _executable(self):
        """The compiled executable, or ``None`` (PopTorch's attribute)."""
        return self._state.executable

    @property
    def _options(self) -> Options:
        """Same as :attr:`options` (PopTorch's attribute)."""
        return self._state.options

    @property
    def _user_model(self) -> torch.nn.Module:
        """Same as :attr:`model` (PopTorch's attribute)."""
        return self._state.user_model

    @property
    def _training(self) -> bool:
        """Whether this is a training executor (PopTorch's attribute)."""
        return self._state.training

    def __getattr__(self, name: str):
        state = self.__dict__.get("_state")
        if name.startswith("__") or state is None:
            raise AttributeError(name)
        model = state.user_model
        value = getattr(model, name)
        if isinstance(value, torch.nn.Parameter):
            with instrument.syncing():
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
        """Pickling (``torch.save(executor, f)``, as PopTorch programs do) stores the
        wrapped model: its original class with the latest weights (pulled from the
        device first); loading gives that plain ``nn.Module``, to wrap again."""
        return _unpickled_model, (self._state.user_model,)

    def __repr__(self) -> str:
        return module_repr(self._state.user_model)

    # -- state ------------------------------------------------------------------------

    def isCompiled(self) -> bool:
        """Whether an executable exists (not before the first compile nor after
        :meth:`destroy`)."""
        return self._state.compiled is not None

    def isAttachedToDevice(self) -> bool:
        """Whether the device is attached (``False`` when not compiled)."""
        return self._state.compiled is not None and self._state.attached

    # -- compilation -------------------------------------------------------------------

    def _instrumentModel(self) -> None:
        """Training: (re-)instrument the user model for this executor — at wrap time and
        when recompiling after :meth:`destroy` removed the instrumentation.

        Raises:
            RuntimeError: another live training executor wraps the model.
        """
        model = self._state.user_model
        if instrument.executor_of(model) is self:
            return
        other = host_sync.TRAINING_WRAPPERS.get(id(model))
        if other is not None and other is not self and instrument.is_instrumented(model):
            raise RuntimeError(ALREADY_WRAPPED)
        instrument.instrument(model, self._state.host)
        host_sync.TRAINING_WRAPPERS[id(model)] = self

    def _compile(self, bound: Optional[BoundArgs], tensors: List[torch.Tensor], spec: Spec,
                 loaded: Optional[Program] = None, keep_blobs: bool = False) -> None:
        """Compile (see :func:`compile_.compile_program`), then commit: attach, upload
        the weights, the optimizer and its state, and the RNG state. A failure (or
        Ctrl-C) while doing so leaves the executor uncompiled."""
        if self._state.training:
            self._instrumentModel()
        lifecycle.commit(self._state, compile_.compile_program(
            self._state, bound, tensors, spec, loaded, keep_blobs))

    @serialised
    def _compile_until(self, stop_after: str, *args, check_capture=None,
                       **kwargs) -> Executable:
        """Capture these example arguments afresh and compile them up to the compiler
        pass ``stop_after`` (:func:`compile_.compile_program`, which calls
        ``check_capture(graph)`` on the capture first), committing nothing: the executor
        stays uncompiled. ``poptorch.plan`` compiles this way.

        Raises:
            poptorch.Error: capture and compile errors; ``stop_after`` names no pass of
                ``popart_compiler.compiler.PASSES``; what ``check_capture`` raises.
        """
        bound, tensors, spec = call_io.bind(self._state, args, kwargs, running=False)
        return compile_.compile_program(self._state, bound, tensors, spec,
                                        stop_after=stop_after,
                                        check_capture=check_capture).executable

    @serialised
    def compile(self, *args, **kwargs) -> None:
        """Capture and compile with these example arguments, attach and upload weights,
        optimizer and RNG state — like the first call, without running
        (docs/api-sections.md api §5.3).

        Logs a warning and does nothing if already compiled.
        """
        if self.isCompiled():
            logger.warning("Call to compile() ignored: the executable is already compiled")
            return
        self._compile(*call_io.bind(self._state, args, kwargs, running=False))

    def compileAndExport(self, filename: str, *args, export_model: bool = True,
                         **kwargs) -> None:
        """:meth:`compile` with these arguments, then :meth:`save` to ``filename`` with
        the RNG state (docs/api-sections.md api §5.4, docs/semantics.md S-62): offline
            precompilation."""
        with self._lock:
            if self.isCompiled():
                logger.warning("Call to compile() ignored: the executable is already "
                               "compiled")
            else:
                bound, tensors, spec = call_io.bind(self._state, args, kwargs, running=False)
                self._compile(bound, tensors, spec, keep_blobs=True)
        self.save(filename, export_model=export_model, save_rng_state=True)

    @serialised
    def save(self, filename: str, export_model: bool = True,
             save_rng_state: bool = True) -> None:
        """Write the compiled executable and its metadata to one file
        (docs/api-sections.md api §5.5, docs/semantics.md S-62). The format is described in
        ``docs/executables.md``.

        Args:
            filename: the file; its parent directory is created. A directory, or a
                path ending in a separator, gets ``<dir>/model.poptorch`` (with a
                warning).
            export_model: also store the model (weights, layout and, if picklable,
                the pickled Python object), the training optimizer and its state, so
                that :func:`poptorch.load` can rebuild everything.
            save_rng_state: store :attr:`rng_state`.

        Raises:
            poptorch.Error: not compiled (``NO_EXECUTABLE``); nothing to export (no
                device work); values that cannot be stored (custom-class constants,
                custom-parser arguments, unsupported optimizer classes); an empty
                ``filename``; a ``filename`` that is a device, FIFO or socket.
            AssertionError: the parent of ``filename`` exists but is not a directory.
        """
        export.save(filename, lifecycle.saved(self._state, export_model, save_rng_state))

    @serialised
    def loadExecutable(self, filename: str) -> None:
        """Load an executable saved by :meth:`save` into this wrapper, which must wrap
        an equivalent model with the same compile-time options (docs/api-sections.md api §5.6,
        docs/semantics.md S-62). No capture takes place; the weights uploaded are this wrapper's
        model's current host weights (not the file's), with its optimizer and RNG settings.

        Raises:
            poptorch.Error: "Invalid file <f>: <reason>": unreadable or corrupted file,
                another format or PopTorch version, a training / inference mismatch, a
                model with other weights or ``forward`` arguments, other compile-time
                options.
        """
        self._compile_from(export.load_executable(filename, lifecycle.expected(self._state)))

    def _compile_from(self, program: Program) -> None:
        """Compile ``program`` (read from a file) instead of capturing the model."""
        if self.isCompiled():
            self.destroy()
        self._compile(None, [], program.input_spec, loaded=program)

    # -- running ----------------------------------------------------------------------

    @serialised
    def __call__(self, *args, **kwargs):
        """Run the model on the device (docs/api-sections.md api §5.2). Takes what ``forward``
        takes.

        Returns:
            The structure ``forward`` returned at capture time, each tensor with its
            first dimension multiplied per the output mode (docs/semantics.md S-12…S-14); ``None``
            if ``forward`` returned ``None``.

        Raises:
            AssertionError: bad batch dimension (docs/semantics.md S-11), bad arguments
                (docs/semantics.md S-20), running an offline (``ConnectionType.Never``) model.
            poptorch.Error: inputs that differ from the compiled ones (docs/semantics.md S-22), a
                missing mandatory argument, capture or compile errors.
            Exception: whatever the run raises (e.g. ``IndexError`` for an
                out-of-range class label); the device and host then hold what they
                held before the call.
        """
        st = self._state
        if isRunningOnIpu():
            raise py_error(
                "A PopTorch model cannot be called inside the forward of another wrapped "
                "model: call the underlying module (executor.model) there instead.")
        if self._offline:
            raise AssertionError(
                "Trying to run a model on an offline device (ConnectionType.Never): use "
                "model.compile(inputs) instead of model(inputs).")
        compiled = st.compiled
        first = compiled is None
        steady = None if first else call_io.steady_inputs(compiled, args, kwargs)
        if steady is not None:
            bound, tensors, spec = steady
        else:
            bound, tensors, spec = call_io.bind(st, args, kwargs)
            if first:
                self._compile(bound, tensors, spec)
            else:
                call_io.validate_inputs(compiled, bound, spec)
        if not first and not st.attached:
            self.attachToDevice()
        compiled = st.compiled
        try:
            lifecycle.prepare_run(st)
            inputs = call_io.device_inputs(st, tensors)
            outputs = lifecycle.run_session(st, inputs)
        except BaseException:
            if first:  # a compile is committed by its first successful run
                lifecycle.discard(st)
            raise
        st.ran = True
        if steady is None:
            call_io.remember_inputs(compiled, args, kwargs, bound, spec)
        call_io.write_back_inputs(compiled, tensors, inputs)
        anchors = compiled.session.anchors
        st.anchor_values = {a.key: anchors[a.key] for a in compiled.executable.options.anchors
                            if a.key in anchors}
        return call_io.build_outputs(compiled, outputs)

    # -- host ↔ device (see host_sync.py) ---------------------------------------------------

    @serialised
    def copyWeightsToHost(self) -> None:
        """Device → host: every parameter and buffer, in place, keeping host dtypes
        (docs/api-sections.md api §5.7). Bumps the host weight version (docs/semantics.md S-31).

        Raises:
            poptorch.Error: not compiled.
        """
        host_sync.copy_to_host(self._state)

    @serialised
    def _implicitCopyWeightsToHost(self) -> bool:
        # the host's view (HostWeights.pull): another thread may have copied meanwhile
        override = self.__dict__.get("copyWeightsToHost")
        if callable(override):
            # As PopTorch, the implicit copy calls the instance's copyWeightsToHost, so
            # a method the user set on the wrapper (to count or log copies) runs.
            if self._state.compiled is None or not self._state.host.stale:
                return False
            logger.debug("Implicit copyWeightsToHost()")
            override()
            return True
        return lifecycle.pull_weights_if_stale(self._state)

    @serialised
    def copyWeightsToHostIfNeeded(self) -> bool:
        """Copy device → host if a run happened since the last copy; returns whether it
        copied. Always ``False`` for inference executors (docs/api-sections.md api §5.9).
        The copy calls the wrapper's ``copyWeightsToHost`` when one was set on the
        instance (as PopTorch)."""
        return self._implicitCopyWeightsToHost()

    @serialised
    def copyWeightsToDevice(self) -> None:
        """Host → device: every parameter and buffer (docs/api-sections.md api §5.8).
        Does not first
        pull the device's weights: un-copied training results are overwritten
        (docs/semantics.md S-32).

        Raises:
            poptorch.Error: not compiled.
        """
        host_sync.copy_to_device(self._state)

    @serialised
    def copyNamedBuffersToDevice(self) -> None:
        """Upload only the buffers listed with ``Options.updatableNamedBuffers``.

        Raises:
            poptorch.Error: not compiled; option not set.
        """
        host_sync.copy_named_buffers_to_device(self._state)

    @serialised
    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True):
        """``model.load_state_dict`` then, if attached, :meth:`copyWeightsToDevice`."""
        result = self._state.user_model.load_state_dict(state_dict, strict)
        if self.isAttachedToDevice():
            self.copyWeightsToDevice()
        return result

    @property
    @serialised
    def rng_state(self) -> Optional[List[int]]:
        """``[seed, *state]`` of the device RNG (docs/api-sections.md api §5.16,
        docs/semantics.md S-96, S-97).

        Raises:
            poptorch.Error: not compiled.
        """
        return host_sync.rng_state(self._state)

    @rng_state.setter
    @serialised
    def rng_state(self, state: List[int]) -> None:
        host_sync.set_rng(self._state, state)

    # -- optimizer (see optimizer_binding.py) --------------------------------------------

    @serialised
    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Set or update the optimizer (docs/api-sections.md api §5.12,
        docs/semantics.md S-50…S-58).

        New hyper-parameter values of variable attributes are pushed to the device
        immediately if attached (at the next attach otherwise), without recapturing or
        recompiling. Every check runs before anything changes: on error the current
        optimizer, the device weights and the device optimizer state stay as they were.

        Raises:
            AttributeError: inference models.
            AssertionError / ValueError: unsupported optimizer or attribute values;
                a float16 ``accum_type`` after compiling with the ``Post`` mean strategy.
            poptorch.Error: parameters that do not belong to the model; a change that
                needs recompilation (docs/semantics.md S-52); a stored optimizer state that does not
                fit.
        """
        st = self._state
        if not st.training:
            raise AttributeError("setOptimizer is only supported by training models "
                                 "(poptorch.trainingModel).")
        st.binding.bind(optimizer, st.session, self.isCompiled(), st.attached)

    @serialised
    def _checkOptimizerStateFits(self, optimizer, ipu_state) -> None:
        """Called by ``optimizer.load_state_dict``: the loaded state and the loaded
        param groups' hyper-parameters must fit the compiled optimizer.

        Raises:
            poptorch.Error: see ``setOptimizer``.
        """
        self._state.binding.check_state_fits(self._state.session, optimizer, ipu_state)

    @serialised
    def _syncOptimizerStateToHost(self) -> None:
        """Device → host: the optimizer state, unless the host copy is current."""
        self._state.binding.sync_state_to_host(self._state.session)

    # -- device attachment ---------------------------------------------------------------

    @serialised
    def detachFromDevice(self) -> None:
        """Release the device (docs/api-sections.md api §5.13). Training executors first copy
        weights and optimizer state back; every executor saves its RNG state.

        Raises:
            poptorch.Error: not compiled, or not attached.
        """
        lifecycle.detach(self._state)

    @serialised
    def attachToDevice(self) -> None:
        """Attach again and re-upload weights, optimizer and RNG state
        (docs/api-sections.md api §5.13).

        Raises:
            poptorch.Error: not compiled, or already attached.
            AssertionError: ``ConnectionType.Never``.
        """
        lifecycle.attach(self._state)

    @serialised
    def destroy(self) -> None:
        """Discard the executable (docs/api-sections.md api §5.15). Training executors copy weights
        and optimizer state back first and remove the model's instrumentation. The executor
        can be called again afterwards: it recompiles."""
        lifecycle.destroy(self._state, self)

    def __del__(self):
        """A training executor that goes away hands its trained weights and its optimizer
        state to the host and removes the instrumentation, so nothing trained is lost."""
        # At interpreter shutdown the modules used here may already be gone.
        with contextlib.suppress(Exception):
            state = self.__dict__.get("_state")
            if state is not None:
                with self._lock:
                    lifecycle.release(state, self)
