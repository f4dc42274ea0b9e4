"""Creating executors: ``trainingModel`` / ``inferenceModel`` (:func:`wrap`),
``poptorch.load`` (:func:`wrap_loaded`, the one entry that builds a wrapper from a loaded
program) and the short-lived executor of ``poptorch.plan``'s capture (:func:`transient`)."""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Optional

import torch

from poptorch._executor import host_sync, instrument, lifecycle
from poptorch._executor.executor import ALREADY_WRAPPED, PoplarExecutor
from poptorch._files import export
from poptorch._compat.release import __version__
from poptorch.options import Options

__all__ = ["wrap", "wrap_loaded", "transient"]


def wrap(model: torch.nn.Module, options: Optional[Options], training: bool,
         optimizer: Optional[torch.optim.Optimizer] = None,
         version: str = __version__) -> PoplarExecutor:
    """``trainingModel`` / ``inferenceModel``: wrap ``model`` (or the user model of a
    wrapper). The executor captures a shallow copy of it (the user's instance is never
    patched) and syncs weights with the user's model itself.

    Raises:
        RuntimeError: training: the model is already wrapped by a live training
            executor.
    """
    user_model = model.model if isinstance(model, PoplarExecutor) else model
    if training and id(user_model) in host_sync.TRAINING_WRAPPERS and \
            instrument.is_instrumented(user_model):
        raise RuntimeError(ALREADY_WRAPPED)
    with instrument.syncing():
        model_copy = copy.copy(user_model)
    if instrument.is_instrumented(model_copy):
        model_copy.__class__ = instrument.original_class(model_copy)
        instrument.forget(model_copy)
    return PoplarExecutor(model_copy, options, training, version, optimizer=optimizer,
                          user_model=user_model)


def wrap_loaded(loaded: "export.Loaded") -> PoplarExecutor:
    """Build the wrapper of a file read by :func:`poptorch._files.export.read_exported`
    (``poptorch.load``): a training or inference executor of the loaded model with the
    stored options and optimizer, its replica groupings, the stored program compiled
    (no capture), the optimizer's device state and the RNG state restored.

    Raises:
        poptorch.Error: "Invalid file <f>: ...": the file's program, optimizer or RNG
            state does not fit the rebuilt model.
    """
    with loaded.part("metadata.json.optimizer"):
        executor = wrap(loaded.model, loaded.options, loaded.training,
                        optimizer=loaded.optimizer, version=loaded.version)
    st = executor._state
    st.per_replica_params.update(loaded.groupings)
    loaded.check(lifecycle.expected(st))
    executor._compile_from(loaded.program)
    if loaded.training:
        with loaded.part("optimizer.safetensors"):
            export.restore_state(st.binding, st.session, loaded.optimizer_state,
                                 loaded.offline)
    if loaded.rng_state is not None:
        with loaded.part("metadata.json.rng_state"):
            executor.rng_state = loaded.rng_state
    return executor


@contextlib.contextmanager
def transient(model: torch.nn.Module, options: Optional[Options], training: bool,
              optimizer: Optional[torch.optim.Optimizer] = None) -> Iterator[PoplarExecutor]:
    """An executor of ``model`` (:func:`wrap`) for the ``with`` block only: on exit a
    training executor hands back what it holds and removes the model's instrumentation
    (as when it goes away), and the model is no longer registered as wrapped for
    training, whether the block succeeded or raised.

    Raises:
        RuntimeError: training: the model is already wrapped by a live training
            executor.
    """
    executor = wrap(model, options, training, optimizer=optimizer)
    state = executor._state
    try:
        yield executor
    finally:
        lifecycle.release(state, executor)
        if host_sync.TRAINING_WRAPPERS.get(id(state.user_model)) is executor:
            del host_sync.TRAINING_WRAPPERS[id(state.user_model)]
