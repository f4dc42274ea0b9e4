"""Compiling an executor's model (docs/semantics.md S-1, S-61, S-64, S-81, S-82): the program (a
fresh capture of one micro-batch, an executable-cache entry, or a program loaded from a
file), the compiler, the Inductor warm-up, the device and the session.

:func:`compile_program` returns a :class:`~poptorch._executor.state.Compiled` without
committing it: the executor commits it (and uploads its state) only once everything
has succeeded, so that a failure leaves it uncompiled.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from popart_compiler import compiler
from popart_compiler.enums import ConnectionType
from popart_compiler.ir import Graph
from popart_compiler.runtime import reports
from popart_compiler.runtime.device import acquire_device
from popart_compiler.runtime.lowering import lower
from popart_compiler.runtime.sessions import open_session
from popart_compiler.runtime.warm_up import warm_up
from popart_compiler.session_options import (Anchor, ReplicaGrouping, SessionOptions,
                                             ipu_model_env)
from poptorch._capture.args import BoundArgs, Spec
from poptorch._capture.capture import capture
from poptorch._executor import call_io, host_sync, instrument
from poptorch._executor.progress import ProgressBar
from poptorch._executor.replica_grouping import check_per_replica_params, one_replica_slices
from poptorch._executor.state import Compiled, ExecutorState
from poptorch._files import cache
from poptorch._files.program import Program, to_blobs
from poptorch._files.proto_export import export_proto_if_requested
from poptorch._logging import logger

__all__ = ["session_options", "options_to_session", "model_selection", "capture_program",
           "compile_program"]


def session_options(state: ExecutorState) -> Tuple[SessionOptions, ProgressBar]:
    """The session options and the compilation progress bar (a silent timer when
    ``showCompilationProgressBar(False)``)."""
    return options_to_session(state.options, state.per_replica_params)


def options_to_session(o, per_replica_params=None) -> Tuple[SessionOptions, ProgressBar]:
    """The :class:`SessionOptions` of ``poptorch.Options`` ``o`` (with the replica
    groupings ``per_replica_params``) and its compilation progress bar."""
    values = o.toDict()
    bar = values.pop("compilation_progress_bar_fn", None) or ProgressBar(show=False)
    anchors = [Anchor(long_name, int(mode), int(period) if int(mode) == 1 else 1, key=short)
               for short, (long_name, _inherit, mode, period) in o.anchored_tensors.items()]
    groupings = {name: ReplicaGrouping(int(cgt), int(shards), int(mode))
                 for name, (cgt, shards, mode) in (per_replica_params or {}).items()}
    return SessionOptions.from_dict(values, anchors, replica_groupings=groupings), bar


def model_selection(options) -> Tuple[bool, Optional[bool], bool]:
    """``(use_ipu_model, explicitly_requested, small)`` as PopTorch decides
    (docs/semantics.md S-82)."""
    env_model, env_small = ipu_model_env()
    if options.exists("use_model"):
        logger.info("From the user configuration: Ipu model: %s",
                    "Enabled" if options.use_model else "Disabled")
        return bool(options.use_model), bool(options.use_model), env_small and not env_model
    return True, env_model or env_small, env_small and not env_model


def capture_program(state: ExecutorState, bound: BoundArgs, spec: Spec,
                    micro: List[torch.Tensor], device: str) -> Program:
    """Capture the executor's model for one micro-batch ``micro`` of the bound inputs
    (training models with their instrumentation suspended, replica-grouped weights as
    one group's slice, docs/semantics.md S-27)."""
    model = state.model
    # Capture reads shapes, not values: no implicit device → host copy for a model
    # trained by another executor (it could wait on that executor from inside the
    # process-wide capture lock).
    suspend = instrument.suspended(state.user_model) if state.training \
        else instrument.syncing()
    with suspend, one_replica_slices(state.user_model, state.per_replica_params):
        captured = capture(model, model.forward, bound, spec, micro, state.training, device,
                           strategy=state.options._execution_strategy,
                           module_namescope=state.options._module_namescope_enabled)
    return Program(captured, spec, list(bound.names), bound.num_positional)


def _program(state: ExecutorState, bound: BoundArgs, tensors: List[torch.Tensor],
             spec: Spec, sess_opts: SessionOptions, keep_blobs: bool, use_cache: bool = True
             ) -> Tuple[Program, Callable[[], Program]]:
    """The program of a fresh compilation: the cache entry for these inputs, else a
    capture of one micro-batch (which then fills the entry; ``use_cache=False``: always
    a capture, the cache untouched); and how to capture it again. ``keep_blobs``:
    serialize it before the compiler rewrites it."""
    factor = state.batch_factor
    micro = [t[: t.shape[0] // factor] if t.dim() else t
             for t in call_io.device_inputs(state, tensors)]

    def recapture() -> Program:
        return capture_program(state, bound, spec, micro, sess_opts.device)

    request = cache.CacheRequest(
        state.model, state.options, state.training, dict(state.per_replica_params), spec,
        list(bound.names), bound.num_positional, sess_opts.device, sess_opts.backend,
        state.poptorch_version)
    program = cache.obtain_program(request, recapture) if use_cache else recapture()
    if keep_blobs and program.blobs is None:
        program.blobs = to_blobs(program)
    return program, recapture


def compile_program(state: ExecutorState, bound: Optional[BoundArgs],
                    tensors: List[torch.Tensor], spec: Spec,
                    loaded: Optional[Program] = None, keep_blobs: bool = False,
                    stop_after: Optional[str] = None,
                    check_capture: Optional[Callable[[Graph], None]] = None) -> Compiled:
    """Compile: obtain the program (``loaded``, a cache entry or a capture), compile it,
    report it (:func:`~popart_compiler.runtime.reports.report`: the profile report, a
    program that does not fit), lower it and warm up Inductor, acquire the device and
    create the session. Writes the ONNX model-proto file when
    ``POPTORCH_EXPORT_PROTO_FILE`` is set. Sets ``state.progress``; commits nothing
    else.

    ``stop_after`` (the name of a compiler pass, see
    :func:`popart_compiler.compiler.compile`) compiles a fresh capture up to that pass
    and stops there: no cache, proto file, report, lowering, device or session (the
    ``Compiled`` has ``device`` and ``session`` ``None``). ``poptorch.plan`` compiles
    this way. ``check_capture`` is called with the captured graph before the compiler
    runs (it raises what it refuses).

    Raises:
        poptorch.Error: capture and compile errors, device selection (docs/semantics.md S-64, S-81),
            a ``stop_after`` that names no compiler pass.
    """
    o = state.options
    sess_opts, progress = session_options(state)
    state.progress = progress
    check_per_replica_params(state.user_model, sess_opts)
    host_sync.check_updatable_buffers(state)
    use_model, explicit, small = model_selection(o)
    sess_opts.small_ipu_model = small
    offline = sess_opts.connection_type is ConnectionType.Never
    partial = stop_after is not None
    try:
        progress(0, 10)
        if not partial:
            compiler.prepare(sess_opts)  # overlaps the capture
        if loaded is not None:
            program, recapture = loaded, None
        else:
            program, recapture = _program(state, bound, tensors, spec, sess_opts, keep_blobs,
                                          use_cache=not partial)
        if check_capture is not None:
            check_capture(program.captured.graph)
        if not partial:
            export_proto_if_requested(program)
        progress(4, 10)
        exe = compiler.compile(program.captured.graph, sess_opts, state.training,
                               progress=lambda p, t: progress(4 + (5 * p) // t, 10),
                               optimizer=state.binding.description
                               if state.training else None, stop_after=stop_after)
        if partial:
            return Compiled(program, exe, None, None, recapture)
        reports.report(exe)  # the profile report; a program that does not fit
        runners = lower(exe)  # what the session runs, lowered to the backend
        warm_up(exe, runners)  # the inductor backend compiles its kernels here
        # The IPUs needed are known once the graph is placed (docs/semantics.md S-64); with
        # ConnectionType.OnDemand the device is acquired after compiling too.
        device = acquire_device(exe.num_ipus, sess_opts.ipu_model_version,
                                use_ipu_model=use_model, explicit_model_request=explicit,
                                small=small, offline=offline,
                                ipu_id=o.ipu_id if o.exists("ipu_id") else None,
                                torch_device=sess_opts.device,
                                auto_round_num_ipus=bool(o.auto_round_num_ipus))
        progress(10, 10)
    finally:
        progress.close()
    session = None
    if not offline:
        session = open_session(exe, device, state.binding.description
                               if state.training else None, runners)
    return Compiled(program, exe, device, session, recapture)
