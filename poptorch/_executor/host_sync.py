"""Host ↔ device copies of an executor's state (docs/api-sections.md api §5.7-§5.9, §5.16;
docs/semantics.md S-31, S-32, S-96, S-97): weights and buffers in both directions, the updatable
named buffers, the inference wrappers' pick-up of a trainer's latest weights, and the device RNG
state.

Functions of the :class:`~poptorch._executor.state.ExecutorState`; the executor's
public methods call them holding its lock. The registry of live training executors
(docs/semantics.md S-31) lives here too.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

import torch

from popart_compiler.errors import py_error
from poptorch._executor import instrument
from poptorch._executor.state import ExecutorState
from poptorch._logging import logger

__all__ = ["TRAINING_WRAPPERS", "host_tensors", "copy_to_host", "copy_to_device",
           "copy_named_buffers_to_device", "trainer_weights_changed", "read_rng",
           "set_rng", "rng_state"]

#: Training executors by ``id(user model)`` (live ones only).
TRAINING_WRAPPERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def host_tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name (shared ones under each name)."""
    with instrument.syncing():
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(dict(model.named_buffers(remove_duplicate=False)))
    return named


def copy_to_host(state: ExecutorState) -> None:
    """Device → host: every parameter and buffer, in place, keeping host dtypes;
    bumps the host weight version (docs/semantics.md S-31)."""
    state.require_compiled()
    session = state.session
    if session is None:
        return
    logger.info("Writing weights from IPU to host.")
    values = session.readWeights()
    host = host_tensors(state.user_model)
    with instrument.syncing(), torch.no_grad():
        for name, value in values.items():
            target = host.get(name)
            if target is None:
                continue
            if target.shape != value.shape:  # AllReplicas: one value per replica
                target.data = value.to(target.dtype).clone()
            else:
                target.copy_(value.to(target.dtype))
    state.host.stale = False
    state.host.version += 1


def copy_to_device(state: ExecutorState) -> None:
    """Host → device: every parameter and buffer (docs/semantics.md S-32). Records which host copy
    (the executor's own, or that of the live trainer of the same model) was uploaded."""
    state.require_compiled()
    session = state.session
    if session is None:
        return
    binding = state.binding
    if state.training and binding.optimizer is not None and binding.state_stale:
        binding.sync_state_to_host(session)
    logger.info("Writing weights from host to IPU memory.")
    host = host_tensors(state.user_model)
    with instrument.syncing():
        values = {n: t.detach() for n, t in host.items()}
    session.writeWeights(values)
    state.host.stale = False
    trainer = TRAINING_WRAPPERS.get(id(state.user_model))
    source = (instrument.host_weights_of(state.user_model) if trainer is not None
              else None) or state.host
    state.host.uploaded = (weakref.ref(source.owner), source.version)


def check_updatable_buffers(state: ExecutorState) -> None:
    """Every name given to ``Options.updatableNamedBuffers`` is a buffer of the model
    (checked at compile, as PopTorch does, and by ``copyNamedBuffersToDevice``).

    Raises:
        poptorch.Error: a listed name that is not a buffer of the model.
    """
    names = state.options._Popart.options.get("updatableNamedBuffers") or []
    buffers = {n for n, _ in state.user_model.named_buffers()}
    unknown = [n for n in names if n not in buffers]
    if unknown:
        raise py_error(f"updatableNamedBuffers lists {', '.join(map(repr, unknown))}, which "
                       "is not a buffer of the model (its buffers: "
                       f"{', '.join(sorted(buffers)) or 'none'}): name buffers as "
                       "model.named_buffers() does.")


def copy_named_buffers_to_device(state: ExecutorState) -> None:
    """Upload only the buffers listed with ``Options.updatableNamedBuffers``.

    Raises:
        poptorch.Error: not compiled; option not set; a listed name that is not a
            buffer of the model (nothing is uploaded then).
    """
    state.require_compiled()
    names = state.options._Popart.options.get("updatableNamedBuffers")
    if not names:
        raise py_error("No named buffers marked as updatable via "
                       "updatableNamedBuffers option")
    check_updatable_buffers(state)
    host = host_tensors(state.user_model)
    with instrument.syncing():
        state.session.writeWeights({n: host[n].detach() for n in names})


def trainer_weights_changed(state: ExecutorState) -> bool:
    """An inference wrapper of a model being trained by another executor must upload
    the trainer's latest weights (docs/semantics.md S-31): the trainer's host copy is pulled first;
    ``True`` when what this wrapper uploaded last is not that copy."""
    trainer = TRAINING_WRAPPERS.get(id(state.user_model))
    if trainer is None or trainer is state.host.owner:
        return False
    trainer.copyWeightsToHostIfNeeded()
    host = instrument.host_weights_of(state.user_model)
    uploaded = state.host.uploaded
    return host is None or uploaded is None or uploaded[0]() is not trainer \
        or uploaded[1] != host.version


def read_rng(state: ExecutorState) -> None:
    """Refresh the cached RNG state from the device when it may have moved."""
    if state.session is not None and state.rng_stale:
        logger.debug("Reading RNG state")
        state.rng_cache = state.session.getRngState()
        state.rng_stale = False


def set_rng(state: ExecutorState, value: List[int]) -> None:
    """Set the device RNG state (``[seed, *state]``, docs/semantics.md S-96).

    Raises:
        poptorch.Error: not compiled; a state the device rejects.
    """
    state.require_compiled()
    if state.session is not None:
        state.session.checkRngState(value)
    state.rng_cache = value.copy()
    state.rng_stale = False
    if state.attached and state.session is not None:
        logger.debug("Setting RNG state")
        state.session.setRngState(state.rng_cache)


def rng_state(state: ExecutorState) -> Optional[List[int]]:
    """``[seed, *state]`` of the device RNG (docs/semantics.md S-96, S-97).

    Raises:
        poptorch.Error: not compiled.
    """
    state.require_compiled()
    read_rng(state)
    return None if state.rng_cache is None else list(state.rng_cache)
