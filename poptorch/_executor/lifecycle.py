"""The life cycle of an executor's device state (docs/api-sections.md api §5.2, §5.13, §5.15;
docs/semantics.md S-31, S-73, S-80): committing a compilation and uploading the host state,
attaching and detaching, preparing and running a call all-or-nothing, destroying.

Functions of the :class:`~poptorch._executor.state.ExecutorState`; the executor calls
them holding its lock.
"""
from __future__ import annotations

from typing import List

import torch

from popart_compiler.errors import py_error
from poptorch import enums
from poptorch._executor import host_sync, instrument
from poptorch._executor.state import Compiled, ExecutorState
from poptorch._files import export
from poptorch._logging import logger

__all__ = ["commit", "upload_state", "discard", "attach", "detach", "destroy",
           "release", "pull_weights_if_stale", "prepare_run", "run_session", "saved",
           "expected"]


def pull_weights_if_stale(state: ExecutorState) -> bool:
    """The implicit device → host copy (docs/semantics.md S-31); whether it copied."""
    if state.compiled is None or not state.host.stale:
        return False
    logger.debug("Implicit copyWeightsToHost()")
    host_sync.copy_to_host(state)
    return True


def upload_state(state: ExecutorState) -> None:
    """Host → device at compile / attach: weights, optimizer, optimizer state, RNG."""
    host_sync.copy_to_device(state)
    if state.training:
        state.binding.upload(state.session)
    if state.rng_cache is not None:
        if len(state.rng_cache) > 1:
            logger.debug("Setting RNG state")
            state.session.setRngState(state.rng_cache)
        else:
            logger.debug("Setting random seed to: %d", state.rng_cache[0])
            state.session.setRandomSeed(state.rng_cache[0])


def commit(state: ExecutorState, compiled: Compiled) -> None:
    """Make ``compiled`` the executor's compilation: attach, upload the host state and,
    in a multi-process run, start from process 0's state. A failure (or Ctrl-C) while
    doing so leaves the executor uncompiled."""
    try:
        state.compiled = compiled
        state.ran = False
        if compiled.session is None:  # offline (ConnectionType.Never)
            state.attached = False
            return
        if state.training:
            state.binding.mark_state_pending()  # uploaded with the weights
        state.attached = True
        upload_state(state)
        # several processes: every process starts from process 0's state
        compiled.session.broadcast_state()
    except BaseException:
        discard(state)
        raise


def discard(state: ExecutorState) -> None:
    """Forget a compilation whose first run failed: the next call captures and
    compiles again (possibly for other input types). Nothing ran on the device, so
    there is nothing to copy back."""
    state.compiled = None
    state.attached = False


def _sync_to_host(state: ExecutorState) -> None:
    """Training: trained weights and optimizer state back to the host."""
    pull_weights_if_stale(state)
    state.binding.sync_state_to_host(state.session)


def attach(state: ExecutorState) -> None:
    """Attach again and re-upload the host state (docs/api-sections.md api §5.13).

    Raises:
        poptorch.Error: not compiled, or already attached.
        AssertionError: ``ConnectionType.Never``.
    """
    state.require_compiled()
    if int(state.options.connection_type) == int(enums.ConnectionType.Never):
        raise AssertionError("Trying to attach to an offline device "
                             "(ConnectionType.Never)")
    if state.attached:
        raise py_error("Device is already attached")
    state.attached = True
    if state.training:
        state.binding.mark_state_pending()
    upload_state(state)


def detach(state: ExecutorState) -> None:
    """Release the device (docs/api-sections.md api §5.13), keeping the RNG state and,
    for training,
    the trained weights and optimizer state on the host.

    Raises:
        poptorch.Error: not compiled, or not attached.
    """
    compiled = state.require_compiled()
    if not state.attached:
        raise py_error("Device is not attached")
    host_sync.read_rng(state)
    if state.training:
        _sync_to_host(state)
    state.attached = False
    logger.debug("Detached from device %d",
                 compiled.device.device_id if compiled.device else 0)


def destroy(state: ExecutorState, owner) -> None:
    """Discard the executable (docs/api-sections.md api §5.15); training executors copy weights and
    optimizer state back first and remove the model's instrumentation."""
    if state.compiled is None:
        return
    if state.training:
        _sync_to_host(state)
    if state.session is not None:
        state.session.close()
    state.compiled = None
    state.attached = False
    if state.training:
        if instrument.is_instrumented(state.user_model):
            instrument.uninstrument(state.user_model)
        if host_sync.TRAINING_WRAPPERS.get(id(state.user_model)) is owner:
            del host_sync.TRAINING_WRAPPERS[id(state.user_model)]


def release(state: ExecutorState, owner) -> None:
    """A training executor (``owner``) that goes away hands its trained weights and its
    optimizer state to the host and removes the instrumentation, so nothing trained is
    lost."""
    if not state.training:
        return
    if state.compiled is not None:
        _sync_to_host(state)
    model = state.user_model
    other = instrument.executor_of(model)
    if (other is None or other is owner) and instrument.is_instrumented(model):
        instrument.uninstrument(model)


def prepare_run(state: ExecutorState) -> None:
    """What a call does on the device before running: the trainer's latest weights
    (inference, docs/semantics.md S-31), a pending optimizer and optimizer state (training)."""
    binding = state.binding
    if not state.training:
        if host_sync.trainer_weights_changed(state):
            logger.debug("Implicit copyWeightsToDevice()")
            host_sync.copy_to_device(state)
        return
    if binding.pending:
        binding.pending = False
        state.session.setOptimizer(binding.description)
    if binding.optimizer is not None and binding.state_pending():
        pull_weights_if_stale(state)
        binding.write_pending_state(state.session)


def run_session(state: ExecutorState, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    """Run the session (all or nothing, docs/semantics.md S-73). The host is told before the run
    that the device may move ahead, so that a Ctrl-C arriving just after the run leaves no trained
    weights unseen; after a rolled-back run the flags are put back."""
    binding = state.binding
    flags = (state.rng_stale, state.host.stale, binding.state_stale)
    state.rng_stale = True
    if state.training:
        state.host.stale = binding.state_stale = True
    try:
        return state.session.run(inputs)
    except BaseException:
        state.rng_stale, state.host.stale, binding.state_stale = flags
        raise


def saved(state: ExecutorState, export_model: bool, save_rng_state: bool) -> export.Saved:
    """What ``save()`` writes: with ``export_model``, the model and (training) its
    optimizer, their device state synchronised to the host first.

    Raises:
        poptorch.Error: not compiled.
    """
    compiled = state.require_compiled()
    optimizer = None
    if export_model and state.training:
        _sync_to_host(state)
        optimizer = state.binding.optimizer
    rng = host_sync.rng_state(state) if save_rng_state else None
    return export.Saved(
        program=compiled.program, recapture=compiled.recapture,
        executable=compiled.executable, options=state.options, training=state.training,
        forward=state.model.forward, groupings=dict(state.per_replica_params),
        version=state.poptorch_version, model=state.user_model if export_model else None,
        optimizer=optimizer, param_names=state.binding.param_names(),
        session=state.session, rng_state=rng)


def expected(state: ExecutorState) -> export.Expected:
    """What a file loaded into this executor must hold (docs/semantics.md S-62)."""
    return export.Expected(
        training=state.training, tensors=host_sync.host_tensors(state.model),
        groupings=dict(state.per_replica_params), signature=state.parser.signature,
        options=state.options, version=state.poptorch_version)
