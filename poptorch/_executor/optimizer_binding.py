"""The optimizer binding of a :class:`poptorch.PoplarExecutor` (docs/api-sections.md api §5.12;
docs/semantics.md S-41, S-50…S-58): which optimizer the executor trains with, its description for
the compiler, the checks a new optimizer passes before anything changes, and the transfers of the
optimizer state between the host optimizer and the device.

The executor owns one :class:`OptimizerBinding`; it holds no strong reference back to
the executor (so the executor is still freed, and its ``__del__`` still runs, as soon as
the user drops it). Methods that work on the device take the session.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from popart_compiler.errors import py_error
from poptorch import enums, optim
from poptorch._executor import instrument
from poptorch._executor.optimizer_description import OptimizerAttrTracker, to_description
from poptorch._logging import logger

__all__ = ["OptimizerBinding"]


class OptimizerBinding:
    """The optimizer of one executor and the device's view of it.

    Args:
        model: the user's model (the optimizer must hold its parameters).
        options: the executor's ``Options`` (read for the loss-scaling settings;
            ``meanAccumulationAndReplicationReductionStrategy`` may be switched,
            docs/semantics.md S-41).
        training: whether the executor trains (inference executors bind nothing).
        link: what a bound PopTorch optimizer calls on the device (see
            :class:`poptorch.optim.DeviceLink`).

    Attributes:
        optimizer: the bound ``torch.optim.Optimizer`` (``None`` before the first
            ``setOptimizer`` and for inference executors).
        description: its ``OptimizerDescription``, as given to the compiler.
        pending: a changed description waits for the next attach (docs/semantics.md S-50).
        state_stale: the device's optimizer state may have moved on since the host
            last read it.
        tracker: the ``OptimizerAttrTracker`` of a training executor (docs/semantics.md S-52).
    """

    def __init__(self, model: torch.nn.Module, options: Any, training: bool,
                 link: Optional[optim.DeviceLink] = None):
        self._model = model
        self._options = options
        self._link = link
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.description = None
        self.pending = False
        self.state_stale = False
        self.tracker = None
        if training:
            self.tracker = OptimizerAttrTracker(
                bool(options._relax_optimizer_attributes_checks))

    def param_names(self) -> Dict[int, str]:
        """``id(parameter) → name`` of the model's parameters."""
        with instrument.syncing():
            return {id(p): n for n, p in self._model.named_parameters()}

    def check_parameters(self, optimizer: torch.optim.Optimizer) -> None:
        """Every parameter in the optimizer's groups must belong to the wrapped model."""
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list):
            return  # optimizer_type() rejects it
        with instrument.syncing():
            own = {id(p) for p in self._model.parameters()}
        for index, group in enumerate(groups):
            foreign = [tuple(p.shape) for p in group.get("params", []) if id(p) not in own]
            if foreign:
                raise py_error(
                    f"The optimizer's param group {index} holds {len(foreign)} tensor(s) "
                    f"(shapes {foreign[:3]}) that are not parameters of the model wrapped "
                    "by this poptorch.trainingModel. Build the optimizer from the "
                    "parameters of the model you pass to poptorch.trainingModel, e.g. "
                    "optimizer = poptorch.optim.SGD(model.parameters(), lr=...).")

    def describe(self, optimizer: torch.optim.Optimizer, track: bool = False):
        """The ``OptimizerDescription`` of ``optimizer``; ``track``: record its
        attribute values with :attr:`tracker` (docs/semantics.md S-52)."""
        auto_ls = bool(self._options._Popart.options.get(
            "automaticLossScalingSettings.enabled", False))
        return to_description(optimizer, self.param_names(), auto_ls,
                              self.tracker if track else None)

    def check_mean_reduction_strategy(self, description, compiled: bool) -> bool:
        """docs/semantics.md S-41: float16 gradient accumulators (except SGD's combined variant)
        need the ``Running`` mean strategy. Returns whether the options must switch to it.

        Raises:
            ValueError: the switch would be needed but the model is already compiled.
        """
        needs_running = description.accum_type == torch.float16 and not (
            description.type == "SGD" and description.use_combined_accum)
        strategy = self._options.Training.meanAccumulationAndReplicationReductionStrategy
        if not needs_running or strategy != enums.MeanReductionStrategy.Post:
            return False
        if compiled:
            raise ValueError(
                "The optimizer's accum_type is torch.float16, so "
                "poptorch.Options().Training.meanAccumulationAndReplicationReductionStrategy"
                " would have to be MeanReductionStrategy.Running, but the model is already "
                "compiled with MeanReductionStrategy.Post. Use a float16 accum_type before "
                "the first compilation, or call destroy() and compile again.")
        return True

    def bind(self, optimizer: torch.optim.Optimizer, session: Any, compiled: bool,
             attached: bool) -> None:
        """``setOptimizer(optimizer)`` of a training executor (its ``session``, if
        compiled, and whether it is attached): check everything, then commit (see
        ``PoplarExecutor.setOptimizer``)."""
        optim_class = optim.Optimizer
        self.check_parameters(optimizer)
        known = self.tracker.known
        try:
            if optimizer is not self.optimizer:
                self.tracker.reset()  # a new object: its attributes are the baseline
            description = self.describe(optimizer, track=True)
            switch = self.check_mean_reduction_strategy(description, compiled)
            new_object = compiled and self.optimizer is not None and \
                optimizer is not self.optimizer
            carries_state = isinstance(optimizer, optim_class) and optimizer.has_state()
            if session is not None:
                session.checkOptimizer(description)
                if new_object and carries_state:
                    session.checkOptimizerState(optimizer.get_state_dict()["ipu_state"])
        except BaseException:
            self.tracker.known = known  # a rejected optimizer changes nothing
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
            if isinstance(self.optimizer, optim_class):
                self.sync_state_to_host(session)
                optim.link_device(self.optimizer, None)
            if carries_state:
                optim.mark_state_pending(optimizer)
        self.optimizer = optimizer
        if isinstance(optimizer, optim_class):
            optim.link_device(optimizer, self._link)
        changed = description != self.description
        self.description = description
        if session is None:
            return
        if attached:
            if changed:
                session.setOptimizer(description)
            if self.state_pending():
                self.write_pending_state(session)
        elif changed:
            self.pending = True

    def mark_state_pending(self) -> None:
        """A device state stored on the host optimizer is uploaded with the weights
        (at compile and attach)."""
        if isinstance(self.optimizer, optim.Optimizer) and self.optimizer.has_state():
            optim.mark_state_pending(self.optimizer)

    def state_pending(self) -> bool:
        """A state loaded on the host optimizer waits to be written to the device."""
        return isinstance(self.optimizer, optim.Optimizer) and \
            optim.state_pending(self.optimizer)

    def upload(self, session: Any) -> None:
        """Host → device at compile / attach: the description and a pending state."""
        self.pending = False
        if session.optimizer.description is not self.description:
            session.setOptimizer(self.description)
        self.write_pending_state(session)

    def check_state_fits(self, session: Any, optimizer, ipu_state) -> None:
        """Called by ``optimizer.load_state_dict``: the loaded state and the loaded
        param groups' hyper-parameters must fit the compiled optimizer.

        Raises:
            poptorch.Error: see ``setOptimizer``.
        """
        if session is None or optimizer is not self.optimizer:
            return
        session.checkOptimizerState(ipu_state)
        session.checkOptimizer(self.describe(optimizer))

    def sync_state_to_host(self, session: Any) -> None:
        """Device → host: the optimizer state and parameters into the host optimizer's
        state dict (``ipu_state`` / ``ipu_param``, docs/semantics.md S-56), unless the host copy is
        current."""
        opt = self.optimizer
        if not isinstance(opt, optim.Optimizer) or session is None:
            return
        if not self.state_stale and opt.has_state():
            logger.debug("Using cached optimiser state dict")
            return
        if optim.state_pending(opt):  # a loaded state not written yet is the latest one
            return
        logger.info("Writing optimiser state tensors from IPU to host.")
        optim.store_device_state(opt, session.readOptimizerState(),
                                 session.readOptimizerParams())
        self.state_stale = False

    def write_pending_state(self, session: Any) -> None:
        """Write a state loaded on the host (``optimizer.load_state_dict``) to the
        device, together with the hyper-parameters of the loaded param groups.

        Raises:
            poptorch.Error: the state does not fit; it is dropped (the device keeps its
                state) so that the model stays usable.
        """
        opt = self.optimizer
        if not isinstance(opt, optim.Optimizer) or session is None:
            return
        if not optim.state_pending(opt):
            if not opt.has_state():
                self.state_stale = True
            return
        state = opt.get_state_dict()
        try:
            session.checkOptimizerState(state["ipu_state"])
            description = self.describe(opt)
            session.checkOptimizer(description)
        except BaseException:
            optim.drop_pending_state(opt)  # dropped: a recompile does not retry it
            raise
        logger.info("Writing optimiser state tensors from host to IPU memory.")
        session.writeOptimizerState(state["ipu_state"])
        loaded_params = state.get("ipu_param")
        if isinstance(loaded_params, dict):
            for name in session.readOptimizerParams():
                if name not in loaded_params:
                    logger.warning("ignoring missing parameter %s", name)
        if description != self.description:
            self.description = description
            session.setOptimizer(description)
        if isinstance(loaded_params, dict) and optim.params_loaded(opt):
            # PopTorch's ipu_param: used until the param groups change
            session.writeOptimizerParams(loaded_params)
        optim.written_to_device(opt)
        self.state_stale = True
