"""Host ↔ device copies of a :class:`poptorch.PoplarExecutor`'s state (spec api §5.7-§5.9,
§5.16; S-31, S-32, S-96, S-97): weights and buffers in both directions, the updatable
named buffers, ``load_state_dict``, the inference wrappers' pick-up of a trainer's
latest weights, and the device RNG state. A mixin: these are public ``PoplarExecutor``
methods; the registry of live training executors (S-31) lives here too."""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional

import torch

from popart_compiler.errors import py_error

from poptorch._executor import instrument
from poptorch._executor.lock import serialised
from poptorch._logging import logger

__all__ = ["HostSyncMixin", "TRAINING_WRAPPERS"]

#: Training executors by ``id(user model)`` (live ones only).
TRAINING_WRAPPERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


class HostSyncMixin:
    """Weight, buffer and RNG transfers of a ``PoplarExecutor``. The executor owns the
    flags used here: ``_host_weights_stale`` (a run moved the device ahead of the
    host), ``_host_weights_version`` (bumped at each device → host copy, S-31),
    ``_uploaded_version`` (which executor's host copy, and which version of it, was
    last uploaded: a weak reference and a version, so that a new trainer of the same
    model, whose count starts again, is never taken for the old one), ``_rng_cache`` and
    ``_rng_stale``."""

    def _host_tensors(self) -> Dict[str, torch.Tensor]:
        model = self._user_model
        with instrument.syncing():
            named = dict(model.named_parameters(remove_duplicate=False))
            named.update(dict(model.named_buffers(remove_duplicate=False)))
        return named

    @serialised
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
        with instrument.syncing(), torch.no_grad():
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

    @serialised
    def _implicitCopyWeightsToHost(self) -> None:
        if not self._host_weights_stale:  # another thread copied while this one waited
            return
        logger.debug("Implicit copyWeightsToHost()")
        self.copyWeightsToHost()

    @serialised
    def copyWeightsToHostIfNeeded(self) -> bool:
        """Copy device → host if a run happened since the last copy; returns whether it
        copied. Always ``False`` for inference executors (api §5.9)."""
        if self._executable is None or not self._host_weights_stale:
            return False
        self._implicitCopyWeightsToHost()
        return True

    @serialised
    def copyWeightsToDevice(self) -> None:
        """Host → device: every parameter and buffer (api §5.8). Does not first pull the
        device's weights: un-copied training results are overwritten (S-32).

        Raises:
            poptorch.Error: not compiled.
        """
        self._require_executable()
        if self._session is None:
            return
        binding = self._optimizer_binding
        if self._training and binding.optimizer is not None and binding.state_stale:
            self._syncOptimizerStateToHost()
        logger.info("Writing weights from host to IPU memory.")
        host = self._host_tensors()
        with instrument.syncing():
            values = {n: t.detach() for n, t in host.items()}
        self._session.writeWeights(values)
        self._host_weights_stale = False
        trainer = TRAINING_WRAPPERS.get(id(self._user_model))
        source = trainer if trainer is not None else self
        self._uploaded_version = (weakref.ref(source), source._host_weights_version)

    @serialised
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
        with instrument.syncing():
            self._session.writeWeights({n: host[n].detach() for n in names if n in host})

    @serialised
    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True):
        """``model.load_state_dict`` then, if attached, :meth:`copyWeightsToDevice`."""
        result = self._user_model.load_state_dict(state_dict, strict)
        if self.isAttachedToDevice():
            self.copyWeightsToDevice()
        return result

    def _syncFromTrainer(self) -> None:
        """Inference wrappers of a model being trained see the latest weights (S-31)."""
        trainer = TRAINING_WRAPPERS.get(id(self._user_model))
        if trainer is None or trainer is self:
            return
        trainer.copyWeightsToHostIfNeeded()
        uploaded = self._uploaded_version
        if uploaded is None or uploaded[0]() is not trainer \
                or uploaded[1] != trainer._host_weights_version:
            logger.debug("Implicit copyWeightsToDevice()")
            self.copyWeightsToDevice()

    # -- RNG --------------------------------------------------------------------------

    def _readRng(self) -> None:
        if self._session is not None and self._rng_stale:
            logger.debug("Reading RNG state")
            self._rng_cache = self._session.getRngState()
            self._rng_stale = False

    @property
    @serialised
    def rng_state(self) -> Optional[List[int]]:
        """``[seed, *state]`` of the device RNG (api §5.16, S-96, S-97).

        Raises:
            poptorch.Error: not compiled.
        """
        self._require_executable()
        self._readRng()
        return None if self._rng_cache is None else list(self._rng_cache)

    @rng_state.setter
    @serialised
    def rng_state(self, state: List[int]) -> None:
        self._require_executable()
        if self._session is not None:
            self._session.checkRngState(state)
        self._rng_cache = state.copy()
        self._rng_stale = False
        if self._attached and self._session is not None:
            logger.debug("Setting RNG state")
            self._session.setRngState(self._rng_cache)

