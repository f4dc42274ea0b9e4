"""PopTorch optimizers (spec api §10, semantics S-50…S-58).

Each class subclasses both the PopTorch :class:`Optimizer` mixin and the corresponding
``torch.optim`` class (``LAMB`` subclasses ``torch.optim.Optimizer``). The device runs
the update itself (``popart_compiler.optim.device_optimizer``); the Python ``step()`` is never
called by PopTorch.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from popart_compiler.errors import py_error
from popart_compiler.optim.description import HYPER_PARAMETERS, OptimizerDescription

from poptorch._logging import logger

__all__ = ["VariableAttributes", "Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "LAMB"]

_ACCUM_TYPES = (torch.float32, torch.float16)


def _check_accum_type(dtype) -> None:
    if dtype not in _ACCUM_TYPES:
        raise AssertionError("Accumulation types must be either torch.float32 or "
                             "torch.float16")


class VariableAttributes:
    """Which hyper-parameters are compiled as variables (changeable by ``setOptimizer``)
    rather than constants (S-52).

    Args:
        variable_attributes: names that start as variables.
        allowed_attributes: every name that may be marked (the optimizer's defaults and
            ``loss_scaling``).
    """

    def __init__(self, variable_attributes: List[str], allowed_attributes: List[str]):
        self._allowed = list(allowed_attributes)
        self._variables = {a for a in variable_attributes if a in self._allowed}

    def _check(self, attr: str) -> None:
        if attr not in self._allowed:
            raise AssertionError(f"Unknown attribute {attr}, allowed values: "
                                 f"{self._allowed}")

    def isConstant(self, attr: str) -> bool:
        """``True`` if ``attr`` is compiled as a constant."""
        return attr not in self._variables

    def markAsConstant(self, attr: str) -> None:
        """Compile ``attr`` as a constant. ``AssertionError`` if unknown."""
        self._check(attr)
        self._variables.discard(attr)

    def markAsVariable(self, attr: str) -> None:
        """Compile ``attr`` as a variable. ``AssertionError`` if unknown."""
        self._check(attr)
        self._variables.add(attr)

    def __repr__(self) -> str:
        return f"VariableAttributes(variables={sorted(self._variables)})"


class Optimizer:
    """Mixin of every PopTorch optimizer: ``loss_scaling``, ``variable_attrs``,
    accumulation types and the device optimizer state (S-56).

    ``state_dict()`` returns torch's ``{"state", "param_groups"}`` plus ``"ipu_state"``
    and ``"ipu_param"`` (``None`` before compilation; the live device state once
    attached to a compiled training executor).
    """

    _poptorch_type: str = ""

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
        self._executor_ref = None

    # -- device state ---------------------------------------------------------------

    def _executor(self):
        ref = getattr(self, "_executor_ref", None)
        return ref() if ref is not None else None

    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict plus ``ipu_state`` / ``ipu_param`` (S-56)."""
        executor = self._executor()
        if executor is not None:
            executor._syncOptimizerStateToHost()
        result = super().state_dict()  # type: ignore[misc]
        result["ipu_state"] = self._state_dict.get("ipu_state")
        result["ipu_param"] = self._state_dict.get("ipu_param")
        return result

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load torch's part (so LR schedulers work), then store the IPU state; it is
        written to the device before the next run (S-56).

        When the optimizer belongs to a compiled training model, the state is checked
        against the device first (names, shapes, dtypes, and the hyper-parameters of
        the loaded param groups against the compiled optimizer, S-52).

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
            executor = self._executor()
            if executor is not None and state_dict["ipu_state"] is not None:
                executor._checkOptimizerStateFits(self, state_dict["ipu_state"])
        except BaseException:
            self.__dict__.update(saved)
            raise
        self._state_dict = {"ipu_state": state_dict["ipu_state"],
                            "ipu_param": state_dict["ipu_param"]}
        self._state_pending = state_dict["ipu_state"] is not None

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

    #: Attributes kept by pickling besides torch's ``defaults``/``state``/``param_groups``.
    _PICKLED = ("loss_scaling", "variable_attrs", "use_combined_accum", "max_grad_norm",
                "bias_correction", "use_tf_variant", "accum_type", "velocity_accum_type",
                "first_order_momentum_accum_type", "second_order_momentum_accum_type",
                "_state_dict", "_state_pending")

    def __getstate__(self):
        executor = self._executor()
        if executor is not None:  # pickle the live device state
            executor._syncOptimizerStateToHost()
        state = dict(super().__getstate__())  # type: ignore[misc]
        state.update({k: self.__dict__[k] for k in self._PICKLED if k in self.__dict__})
        state["_executor_ref"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)  # type: ignore[misc]
        if "_state_dict" in state:  # unpickling (torch's load_state_dict passes less)
            # an unpickled optimizer carrying a device state uploads it on first use
            self._state_pending = self.has_state()


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
    """Stochastic gradient descent with PopTorch's attributes (api §10.2).

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

    _poptorch_type = "SGD"

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
    """Adam with PopTorch's attributes (api §10.3); ``amsgrad=True`` is rejected when
    the optimizer is given to a model. Defaults: lr 1e-3, betas (0.9, 0.999),
    eps 1e-8, weight_decay 0 (L2), loss_scaling 1.0, accumulation types float32,
    max_grad_norm ``inf``.
    """

    _poptorch_type = "Adam"

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
        self._init_poptorch(passed, loss_scaling, {
            "accum_type": accum_type,
            "first_order_momentum_accum_type": first_order_momentum_accum_type,
            "second_order_momentum_accum_type": second_order_momentum_accum_type})


class AdamW(Optimizer, torch.optim.AdamW):
    """AdamW with PopTorch's attributes (api §10.4): decoupled weight decay (default
    1e-2); ``bias_correction`` (default True) — the device applies bias correction even
    when it is False, like PopTorch (S-54).
    """

    _poptorch_type = "AdamW"

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
        self._init_poptorch(passed, loss_scaling, {
            "accum_type": accum_type,
            "first_order_momentum_accum_type": first_order_momentum_accum_type,
            "second_order_momentum_accum_type": second_order_momentum_accum_type})


class RMSprop(Optimizer, torch.optim.RMSprop):
    """RMSprop with PopTorch's attributes (api §10.5). Defaults: lr 1e-2, alpha 0.99,
    eps 1e-8, weight_decay 0, momentum 0, centered False, ``use_tf_variant`` False."""

    _poptorch_type = "RMSprop"

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
    """LAMB (api §10.6, update rule of S-54). Defaults: lr 1e-3, betas (0.9, 0.999),
    eps 1e-8, weight_decay 1e-2, bias_correction True, loss_scaling 1.0,
    max_weight_norm 65500 (``None`` also gives 65500), accumulation types float32.

    ``step()`` runs the same algorithm on the host, so the optimizer also works on the
    CPU.
    """

    _poptorch_type = "LAMB"

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


# -- conversion to the device description ------------------------------------------

_TORCH_TYPES = {torch.optim.SGD: "SGD", torch.optim.Adam: "Adam",
                torch.optim.AdamW: "AdamW", torch.optim.RMSprop: "RMSprop"}
#: torch defaults used to decide const / variable for plain torch optimizers (S-52).
_TORCH_CONST_DEFAULTS = {"weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0,
                         "velocity_scaling": 1.0, "eps": 1e-8, "max_weight_norm": 65500.0}
_ALWAYS_CONST = ("alpha", "nesterov", "betas", "centered")


class OptimizerAttrTracker:
    """Warns about optimizer attributes the converter does not know (S-53).

    The attributes present at the first conversion (param-group keys, ``defaults``
    keys, public attributes of the optimizer object) are accepted silently; any other
    attribute found later produces one message per distinct text, e.g. "Ignoring
    unexpected group 0 attribute in SGD optimizer: ['initial_lr']" — a warning, or a
    debug message with ``Options.relaxOptimizerAttributesChecks()``.

    Args:
        relax: log at debug level instead of warning level.
    """

    def __init__(self, relax: bool = False):
        self._log = logger.debug if relax else logger.warning
        self._printed: set = set()
        self.reset()

    def reset(self) -> None:
        """Record the attributes of the next conversion again."""
        self.known: Optional[Dict[str, set]] = None

    @staticmethod
    def _attributes(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        return {
            "group": [set(g) - {"params"} for g in optimizer.param_groups],
            "optimizer": {k for k in vars(optimizer) if not k.startswith("_")},
            "defaults": set(optimizer.defaults),
        }

    def check(self, optimizer: torch.optim.Optimizer, kind: str) -> None:
        """Record (first call) or check the attributes of ``optimizer``."""
        found = self._attributes(optimizer)
        if self.known is None:
            self.known = {"group": set().union(*found["group"]) if found["group"]
                           else set(), "optimizer": found["optimizer"],
                           "defaults": found["defaults"]}
            return
        for index, keys in enumerate(found["group"]):
            self._report(f"group {index} attribute", kind, keys - self.known["group"])
        self._report("optimizer attribute", kind,
                     found["optimizer"] - self.known["optimizer"])
        self._report("default group variable", kind,
                     found["defaults"] - self.known["defaults"])

    def _report(self, what: str, kind: str, extra: set) -> None:
        if not extra:
            return
        msg = f"Ignoring unexpected {what} in {kind} optimizer: {sorted(extra)}"
        if msg not in self._printed:
            self._printed.add(msg)
            self._log(msg)


def optimizer_type(optimizer: torch.optim.Optimizer) -> str:
    """The device optimizer type of ``optimizer``.

    Raises:
        AssertionError: unsupported optimizer type; RMSprop groups disagreeing on
            ``centered``.
        ValueError: ``amsgrad=True``.
    """
    if isinstance(optimizer, Optimizer):
        kind = type(optimizer)._poptorch_type or next(
            (v for k, v in _TORCH_TYPES.items() if isinstance(optimizer, k)), "")
    else:
        kind = next((v for k, v in _TORCH_TYPES.items() if type(optimizer) is k), "")
        if not kind:
            kind = next((v for k, v in _TORCH_TYPES.items() if isinstance(optimizer, k)), "")
    if not kind:
        raise AssertionError(
            f"Unsupported optimizer type {type(optimizer).__name__}. Types supported: "
            "torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, "
            "poptorch.optim.SGD, poptorch.optim.Adam, poptorch.optim.AdamW, "
            "poptorch.optim.RMSprop, poptorch.optim.LAMB")
    if kind in ("Adam", "AdamW") and any(g.get("amsgrad", False)
                                         for g in optimizer.param_groups):
        raise ValueError("Only non-amsgrad Adam/AdamW optimizers are supported.")
    if kind == "RMSprop":
        centered = {bool(g.get("centered", False)) for g in optimizer.param_groups}
        if len(centered) > 1:
            raise AssertionError("All RMSprop param groups must have the same value for "
                                 "'centered'.")
    bases = type(optimizer).__bases__
    if not (Optimizer in bases or torch.optim.Optimizer in bases
            or type(optimizer) in _TORCH_TYPES):
        logger.warning("Subclassed optimizers are unlikely to behave as intended: "
                       "PopTorch runs its own %s update on the device and never calls the "
                       "Python step() of %s.", kind, type(optimizer).__name__)
    return kind


def _check_number(name: str, value: Any) -> Any:
    if name in ("nesterov", "centered"):
        return bool(value)
    if name == "betas":
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise AssertionError(f"Expected a pair of numbers for betas, got {value!r}")
        return tuple(float(_check_number("betas element", v)) for v in value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise AssertionError(f"Expected a number for {name}, got {value!r} of type "
                             f"{type(value).__name__}")
    return float(value)


def to_description(optimizer: torch.optim.Optimizer, param_names: Dict[int, str],
                   automatic_loss_scaling: bool = False,
                   tracker: Optional[OptimizerAttrTracker] = None) -> OptimizerDescription:
    """Convert ``optimizer`` into what the device runs (S-50…S-55).

    Args:
        optimizer: a supported optimizer.
        param_names: ``id(parameter) → name`` for the model's parameters.
        automatic_loss_scaling: forces ``loss_scaling`` to be variable (S-52).
        tracker: reports attributes added since the first conversion (S-53).

    Raises:
        AssertionError / ValueError: unsupported type or hyper-parameter values (S-50).
        poptorch.Error: ``max_grad_norm`` is NaN, invalid accumulation type.
    """
    kind = optimizer_type(optimizer)
    if tracker is not None:
        tracker.check(optimizer, kind)
    names = HYPER_PARAMETERS[kind]
    is_poptorch = isinstance(optimizer, Optimizer)

    def hyper(source: Dict[str, Any], mandatory: Tuple[str, ...]) -> Dict[str, Any]:
        out = {}
        for name in names:
            if name not in source:
                if name in mandatory:
                    raise AssertionError(f"Mandatory attribute {name} not found in "
                                         "optimizer group")
                continue
            out[name] = _check_number(name, source[name])
        return out

    defaults = hyper(optimizer.defaults, ("lr",))
    group_mandatory = tuple(n for n in names if n != "velocity_scaling")
    groups, group_of = [], {}
    for index, group in enumerate(optimizer.param_groups):
        values = dict(defaults)
        values.update(hyper(group, group_mandatory))
        groups.append(values)
        for p in group["params"]:
            name = param_names.get(id(p))
            if name is not None:
                group_of[name] = index
    if is_poptorch:
        constant = {a for a in list(optimizer.defaults) + ["loss_scaling"]
                    if optimizer.variable_attrs.isConstant(a)}
        loss_scaling = _check_number("loss_scaling", optimizer.loss_scaling)
    else:
        loss_scaling = _check_number("loss_scaling", getattr(optimizer, "loss_scaling", 1.0))
        const_defaults = dict(_TORCH_CONST_DEFAULTS)
        if kind == "AdamW":
            const_defaults["weight_decay"] = 1e-2
        constant = set()
        for attr in names:
            if attr == "lr":
                continue
            values = [g.get(attr) for g in groups] + [defaults.get(attr)]
            if attr in _ALWAYS_CONST or all(
                    v is None or v == const_defaults.get(attr, v) for v in values):
                constant.add(attr)
        if loss_scaling == 1.0:
            constant.add("loss_scaling")
    if automatic_loss_scaling:
        constant.discard("loss_scaling")
    get = lambda attr, default: getattr(optimizer, attr, default)  # noqa: E731
    description = OptimizerDescription(
        type=kind, defaults=defaults, groups=groups, group_of=group_of,
        constant=constant, loss_scaling=loss_scaling,
        use_combined_accum=bool(get("use_combined_accum", False)),
        accum_type=get("accum_type", torch.float32),
        velocity_accum_type=get("velocity_accum_type", torch.float32),
        first_order_type=get("first_order_momentum_accum_type", torch.float32),
        second_order_type=get("second_order_momentum_accum_type", torch.float32),
        max_grad_norm=_check_number("max_grad_norm", get("max_grad_norm", math.inf)),
        bias_correction=bool(get("bias_correction", True)),
        use_tf_variant=bool(get("use_tf_variant", False)))
    description.validate()
    return description
