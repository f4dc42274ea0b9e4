"""PopTorch optimizers (docs/api-sections.md api §10, docs/semantics.md S-50…S-58).

Each class subclasses both the PopTorch :class:`Optimizer` mixin and the corresponding
``torch.optim`` class (``LAMB`` subclasses ``torch.optim.Optimizer``). The device runs
the update itself (``popart_compiler.optim.device_optimizer``); the Python ``step()`` is never
called by PopTorch.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from popart_compiler.errors import py_error
from popart_compiler.optim.description import ACCUMULATION_TYPES

from poptorch._logging import logger

__all__ = ["VariableAttributes", "Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "LAMB"]


def _check_accum_type(dtype) -> None:
    if dtype not in ACCUMULATION_TYPES:
        raise AssertionError("Accumulation types must be either torch.float32 or "
                             "torch.float16")


class VariableAttributes:
    """Which hyper-parameters are compiled as variables (changeable by ``setOptimizer``)
    rather than constants (docs/semantics.md S-52).

    Args:
        variable_attributes: names that start as variables.
        allowed_attributes: every name that may be marked (the optimizer's defaults and
            ``loss_scaling``).
    """

    def __init__(self, variable_attributes: List[str], allowed_attributes: List[str]):
        # PopTorch's attribute names (its tests and clients read and assign them)
        self._allowed_attributes = list(allowed_attributes)
        self._variable_attributes = [a for a in dict.fromkeys(variable_attributes)
                                     if a in self._allowed_attributes]

    def _check(self, attr: str) -> None:
        if attr not in self._allowed_attributes:
            raise AssertionError(f"Unknown attribute {attr}, allowed values: "
                                 f"{self._allowed_attributes}")

    def isConstant(self, attr: str) -> bool:
        """``True`` if ``attr`` is compiled as a constant."""
        return attr not in self._variable_attributes

    def markAsConstant(self, attr: str) -> None:
        """Compile ``attr`` as a constant. ``AssertionError`` if unknown."""
        self._check(attr)
        self._variable_attributes = [a for a in self._variable_attributes if a != attr]

    def markAsVariable(self, attr: str) -> None:
        """Compile ``attr`` as a variable. ``AssertionError`` if unknown."""
        self._check(attr)
        if attr not in self._variable_attributes:
            self._variable_attributes = list(self._variable_attributes) + [attr]

    def __repr__(self) -> str:
        return f"VariableAttributes(variables={sorted(self._variable_attributes)})"


class Optimizer:
    """Mixin of every PopTorch optimizer: ``loss_scaling``, ``variable_attrs``,
    accumulation types and the device optimizer state (docs/semantics.md S-56).

    ``state_dict()`` returns torch's ``{"state", "param_groups"}`` plus ``"ipu_state"``
    and ``"ipu_param"`` (``None`` before compilation; the live device state once
    attached to a compiled training executor).
    """


    def _init_poptorch(self, passed: Dict[str, Any], loss_scaling: Optional[float],
                       accum_types: Dict[str, Optional[torch.dtype]]) -> None:
        for dtype in accum_types.values():
            if dtype is not None:
                _check_accum_type(dtype)
        self.loss_scaling = 1.0 if loss_scaling is None else float(loss_scaling)
        for name, dtype in accum_types.items():
            setattr(self, name, torch.float32 if dtype is None else dtype)
        allowed = list(self.defaults.keys()) + ["loss_scaling"]
        variables = [k for k, v in passed.items() if v is not None]
        if loss_scaling is not None:
            variables.append("loss_scaling")
        self.variable_attrs = VariableAttributes(variables, allowed)
        self._state_dict: Dict[str, Any] = {"ipu_state": None, "ipu_param": None}
        self._state_pending = False
        self._device: Optional[DeviceLink] = None

    # -- device state ---------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict plus ``ipu_state`` / ``ipu_param`` (docs/semantics.md S-56)."""
        if self._device is not None:
            self._device.sync_state()
        result = super().state_dict()  # type: ignore[misc]
        result["ipu_state"] = self._state_dict.get("ipu_state")
        result["ipu_param"] = self._state_dict.get("ipu_param")
        return result

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load torch's part (so LR schedulers work), then store the IPU state; it is
        written to the device before the next run (docs/semantics.md S-56).

        When the optimizer belongs to a compiled training model, the state is checked
        against the device first (names, shapes, dtypes, and the hyper-parameters of
        the loaded param groups against the compiled optimizer, docs/semantics.md S-52).

        Raises:
            RuntimeError: "Cannot load optimizer state dictionary because it is empty."
                or "Only IPU optimizer states can be loaded onto the IPU."
            poptorch.Error: ``ipu_state`` / ``ipu_param`` are not dicts of tensors, or
                do not fit the compiled model.
            ValueError: torch's param groups do not match (raised by torch).

            Nothing changes (host or device) when an error is raised.
        """
        if not state_dict:
            raise RuntimeError("Cannot load optimizer state dictionary because it is empty.")
        if not isinstance(state_dict, dict) or "ipu_state" not in state_dict \
                or "ipu_param" not in state_dict:
            raise RuntimeError("Only IPU optimizer states can be loaded onto the IPU.")
        for key in ("ipu_state", "ipu_param"):
            _check_tensor_dict(key, state_dict[key])
        saved = {k: self.__dict__[k] for k in ("state", "param_groups")}
        if "state" in state_dict and "param_groups" in state_dict:
            super().load_state_dict(  # type: ignore[misc]
                {k: state_dict[k] for k in ("state", "param_groups")})
        try:
            if self._device is not None and state_dict["ipu_state"] is not None:
                self._device.check_state(self, state_dict["ipu_state"])
        except BaseException:
            self.__dict__.update(saved)
            raise
        self._state_dict = {"ipu_state": state_dict["ipu_state"],
                            "ipu_param": state_dict["ipu_param"]}
        self._state_pending = state_dict["ipu_state"] is not None
        # Loaded hyper-parameter tensors are written with the state (PopTorch's
        # ipu_param); a state read back from the device and re-uploaded is not.
        self._params_loaded = self._state_pending and state_dict["ipu_param"] is not None

    def get_state_dict(self) -> Dict[str, Any]:
        """The host copy of the IPU state (no device read)."""
        return self._state_dict

    def set_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace the host copy of the IPU state; it is uploaded at the next run.

        Raises:
            poptorch.Error: ``ipu_state`` / ``ipu_param`` are not dicts of tensors.
        """
        for key in ("ipu_state", "ipu_param"):
            _check_tensor_dict(key, state.get(key))
        self._state_dict = state
        self._state_pending = state.get("ipu_state") is not None

    def has_state(self) -> bool:
        """Whether a device state is stored on the host."""
        return self._state_dict.get("ipu_state") is not None

    def __getstate__(self):
        if self._device is not None:  # pickle the live device state
            self._device.sync_state()
        state = dict(super().__getstate__())  # type: ignore[misc]
        state.update({k: self.__dict__[k] for k in _PICKLED if k in self.__dict__})
        state["_device"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)  # type: ignore[misc]
        self.__dict__.setdefault("_device", None)
        if "_state_dict" in state:  # unpickling (torch's load_state_dict passes less)
            # an unpickled optimizer carrying a device state uploads it on first use
            self._state_pending = self.has_state()


#: PopTorch's attributes of an optimizer (besides torch's ``defaults`` / ``state`` /
#: ``param_groups``), kept when it is pickled or exported.
ATTRIBUTES = ("loss_scaling", "variable_attrs", "use_combined_accum", "max_grad_norm",
              "bias_correction", "use_tf_variant", "accum_type", "velocity_accum_type",
              "first_order_momentum_accum_type", "second_order_momentum_accum_type")
_PICKLED = ATTRIBUTES + ("_state_dict", "_state_pending")


class DeviceLink:
    """What a PopTorch optimizer bound to a compiled training model asks of the device:
    read its state to the host (``state_dict()``, pickling) and check a state before it
    is loaded. Set by the model's optimizer binding; the callables are held weakly (the
    optimizer does not keep the model alive).

    Args:
        sync_state: copy the device's optimizer state into the optimizer.
        check_state: ``check_state(optimizer, ipu_state)`` raises if the state does not
            fit the compiled optimizer.
    """

    def __init__(self, sync_state: Callable[[], None],
                 check_state: Callable[["Optimizer", Dict[str, torch.Tensor]], None]):
        self._sync = weakref.WeakMethod(sync_state)
        self._check = weakref.WeakMethod(check_state)

    def sync_state(self) -> None:
        sync = self._sync()
        if sync is not None:
            sync()

    def check_state(self, optimizer: "Optimizer", state: Dict[str, torch.Tensor]) -> None:
        check = self._check()
        if check is not None:
            check(optimizer, state)


# The device side of a PopTorch optimizer, for the executor's optimizer binding.

def link_device(optimizer: Optimizer, link: Optional[DeviceLink]) -> None:
    """Bind ``optimizer`` to a compiled model's device (``None``: unbind)."""
    optimizer._device = link


def state_pending(optimizer: Optimizer) -> bool:
    """Whether a state loaded on the host waits to be written to the device."""
    return bool(getattr(optimizer, "_state_pending", False))


def mark_state_pending(optimizer: Optimizer) -> None:
    """The stored state (if any) is written to the device before the next run."""
    optimizer._state_pending = optimizer.has_state()


def store_device_state(optimizer: Optimizer, ipu_state: Dict[str, torch.Tensor],
                       ipu_param: Dict[str, torch.Tensor]) -> None:
    """The device's state read to the host (not pending: the device has it)."""
    optimizer._state_dict = {"ipu_state": ipu_state, "ipu_param": ipu_param}


def drop_pending_state(optimizer: Optimizer) -> None:
    """Forget a loaded state that did not fit the device."""
    optimizer._state_pending = False
    optimizer._params_loaded = False
    optimizer._state_dict = dict(optimizer._state_dict, ipu_state=None, ipu_param=None)


def written_to_device(optimizer: Optimizer) -> None:
    """The pending state is now on the device."""
    optimizer._state_pending = False
    optimizer._params_loaded = False


def params_loaded(optimizer: Optimizer) -> bool:
    """The pending state's ``ipu_param`` came from ``load_state_dict``: the device
    uses those hyper-parameter values until the param groups change."""
    return bool(getattr(optimizer, "_params_loaded", False))


def _check_tensor_dict(key: str, value: Any) -> None:
    """``ipu_state`` / ``ipu_param`` must be ``None`` or a dict of name → Tensor."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise py_error(f"Invalid optimizer state: '{key}' must be a dict of tensors (or "
                       f"None), got {type(value).__name__}")
    for name, tensor in value.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise py_error(f"Invalid optimizer state: '{key}' entry {name!r} must map a "
                           f"tensor name to a torch.Tensor, got {type(tensor).__name__}")


def _maybe(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


class SGD(Optimizer, torch.optim.SGD):
    """Stochastic gradient descent with PopTorch's attributes (docs/api-sections.md api §10.2).

    Args:
        params: iterable of parameters or param-group dicts.
        lr: learning rate (required).
        momentum / dampening / weight_decay / nesterov: as ``torch.optim.SGD``
            (defaults 0, 0, 0, False).
        maximize / foreach / differentiable: accepted for compatibility, no effect.
        loss_scaling: global loss scaling (default 1.0).
        velocity_scaling: velocity scaling of the combined variant (default 1.0;
            ignored with a warning by the separate variant).
        use_combined_accum: use the combined variant (default ``False``: separate).
        accum_type / velocity_accum_type: ``torch.float32`` (default) or
            ``torch.float16``.
        max_grad_norm: clip the global gradient norm (default ``inf``).

    Raises:
        AssertionError: accumulation types other than float32 / float16.
    """


    def __init__(self, params: Iterable, lr: float, momentum: Optional[float] = None,
                 dampening: Optional[float] = None, weight_decay: Optional[float] = None,
                 nesterov: Optional[bool] = None, maximize: Optional[bool] = None,
                 foreach: Optional[bool] = None, differentiable: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 velocity_scaling: Optional[float] = None,
                 use_combined_accum: Optional[bool] = None,
                 accum_type: Optional[torch.dtype] = None,
                 velocity_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None):
        passed = dict(lr=lr, momentum=momentum, dampening=dampening,
                      weight_decay=weight_decay, nesterov=nesterov)
        torch.optim.SGD.__init__(self, params, **_maybe(dict(
            passed, maximize=maximize, foreach=foreach, differentiable=differentiable)))
        self.use_combined_accum = bool(use_combined_accum)
        if velocity_scaling is not None and not self.use_combined_accum:
            logger.warning("velocity_scaling is ignored by the separate SGD variant "
                           "(use_combined_accum=False): it is set equal to loss_scaling.")
        if self.use_combined_accum:
            self.defaults["velocity_scaling"] = 1.0 if velocity_scaling is None \
                else float(velocity_scaling)
            for group in self.param_groups:
                group.setdefault("velocity_scaling", self.defaults["velocity_scaling"])
            passed["velocity_scaling"] = velocity_scaling
        self.max_grad_norm = math.inf if max_grad_norm is None else float(max_grad_norm)
        self._init_poptorch(passed, loss_scaling,
                            {"accum_type": accum_type,
                             "velocity_accum_type": velocity_accum_type})


class Adam(Optimizer, torch.optim.Adam):
    """Adam with PopTorch's attributes (docs/api-sections.md api §10.3); ``amsgrad=True`` is
    rejected when
    the optimizer is given to a model. Defaults: lr 1e-3, betas (0.9, 0.999),
    eps 1e-8, weight_decay 0 (L2), loss_scaling 1.0, accumulation types float32,
    max_grad_norm ``inf``.
    """


    def __init__(self, params: Iterable, lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None, eps: Optional[float] = None,
                 weight_decay: Optional[float] = None, amsgrad: Optional[bool] = None,
                 foreach: Optional[bool] = None, maximize: Optional[bool] = None,
                 capturable: Optional[bool] = None, differentiable: Optional[bool] = None,
                 fused: Optional[bool] = None, loss_scaling: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None):
        passed = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        torch.optim.Adam.__init__(self, params, **_maybe(dict(
            passed, amsgrad=amsgrad, foreach=foreach, maximize=maximize,
            capturable=capturable, differentiable=differentiable, fused=fused)))
        self.max_grad_norm = math.inf if max_grad_norm is None else float(max_grad_norm)
        self._init_poptorch(dict(passed, amsgrad=amsgrad), loss_scaling, {
            "accum_type": accum_type,
            "first_order_momentum_accum_type": first_order_momentum_accum_type,
            "second_order_momentum_accum_type": second_order_momentum_accum_type})


class AdamW(Optimizer, torch.optim.AdamW):
    """AdamW with PopTorch's attributes (docs/api-sections.md api §10.4): decoupled weight decay
    (default 1e-2); ``bias_correction`` (default True) — the device applies bias correction even
    when it is False, like PopTorch (docs/semantics.md S-54).
    """


    def __init__(self, params: Iterable, lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None, eps: Optional[float] = None,
                 weight_decay: Optional[float] = None, amsgrad: Optional[bool] = None,
                 maximize: Optional[bool] = None, foreach: Optional[bool] = None,
                 capturable: Optional[bool] = None, differentiable: Optional[bool] = None,
                 fused: Optional[bool] = None, loss_scaling: Optional[float] = None,
                 bias_correction: Optional[bool] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None):
        passed = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        torch.optim.AdamW.__init__(self, params, **_maybe(dict(
            passed, amsgrad=amsgrad, maximize=maximize, foreach=foreach,
            capturable=capturable, differentiable=differentiable, fused=fused)))
        self.bias_correction = True if bias_correction is None else bool(bias_correction)
        self.max_grad_norm = math.inf if max_grad_norm is None else float(max_grad_norm)
        self._init_poptorch(dict(passed, amsgrad=amsgrad), loss_scaling, {
            "accum_type": accum_type,
            "first_order_momentum_accum_type": first_order_momentum_accum_type,
            "second_order_momentum_accum_type": second_order_momentum_accum_type})


class RMSprop(Optimizer, torch.optim.RMSprop):
    """RMSprop with PopTorch's attributes (docs/api-sections.md api §10.5). Defaults:
    lr 1e-2, alpha
    0.99, eps 1e-8, weight_decay 0, momentum 0, centered False, ``use_tf_variant`` False."""


    def __init__(self, params: Iterable, lr: Optional[float] = None,
                 alpha: Optional[float] = None, eps: Optional[float] = None,
                 weight_decay: Optional[float] = None, momentum: Optional[float] = None,
                 centered: Optional[bool] = None, foreach: Optional[bool] = None,
                 maximize: Optional[bool] = None, differentiable: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 use_tf_variant: Optional[bool] = None):
        passed = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                      momentum=momentum, centered=centered)
        torch.optim.RMSprop.__init__(self, params, **_maybe(dict(
            passed, foreach=foreach, maximize=maximize, differentiable=differentiable)))
        self.use_tf_variant = bool(use_tf_variant)
        self._init_poptorch(passed, loss_scaling, {
            "accum_type": accum_type,
            "first_order_momentum_accum_type": first_order_momentum_accum_type,
            "second_order_momentum_accum_type": second_order_momentum_accum_type})


class LAMB(Optimizer, torch.optim.Optimizer):
    """LAMB (docs/api-sections.md api §10.6, update rule of docs/semantics.md S-54). Defaults: lr
    1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2, bias_correction True, loss_scaling 1.0,
    max_weight_norm 65500 (``None`` also gives 65500), accumulation types float32.

    ``step()`` runs the same algorithm on the host, so the optimizer also works on the
    CPU.
    """


    def __init__(self, params: Iterable, lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None, eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 bias_correction: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 max_weight_norm: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None):
        passed = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                      max_weight_norm=max_weight_norm)
        defaults = dict(lr=1e-3 if lr is None else lr,
                        betas=(0.9, 0.999) if betas is None else tuple(betas),
                        eps=1e-8 if eps is None else eps,
                        weight_decay=1e-2 if weight_decay is None else weight_decay,
                        max_weight_norm=65500.0 if max_weight_norm is None
                        else max_weight_norm)
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.bias_correction = True if bias_correction is None else bool(bias_correction)
        self._init_poptorch(passed, loss_scaling, {
            "accum_type": accum_type,
            "first_order_momentum_accum_type": first_order_momentum_accum_type,
            "second_order_momentum_accum_type": second_order_momentum_accum_type})

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB update of every parameter with a gradient (host implementation)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                g = p.grad
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                if self.bias_correction:
                    m_hat = m / (1 - beta1 ** state["step"])
                    v_hat = v / (1 - beta2 ** state["step"])
                else:
                    m_hat, v_hat = m, v
                u = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                r1 = torch.linalg.vector_norm(p).clamp(max=group["max_weight_norm"])
                r2 = torch.linalg.vector_norm(u)
                trust = 1.0 if float(r1) == 0 or float(r2) == 0 else float(r1 / r2)
                p.sub_(group["lr"] * trust * u)
        return loss


#: The device optimizer type of each PopTorch optimizer class (and its subclasses).
KINDS = {SGD: "SGD", Adam: "Adam", AdamW: "AdamW", RMSprop: "RMSprop", LAMB: "LAMB"}
