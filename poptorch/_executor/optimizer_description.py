"""A PopTorch or ``torch.optim`` optimizer as the device runs it: its type, its
hyper-parameters and which of them are compiled as constants (docs/semantics.md
S-50…S-55), and the
warnings about attributes the conversion does not know (docs/semantics.md S-53)."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

from popart_compiler.optim.description import HYPER_PARAMETERS, OptimizerDescription
from popart_compiler.errors import backend_error
from poptorch._logging import logger
from poptorch.optim import KINDS, Optimizer

__all__ = ["OptimizerAttrTracker", "optimizer_type", "to_description"]

_TORCH_TYPES = {torch.optim.SGD: "SGD", torch.optim.Adam: "Adam",
                torch.optim.AdamW: "AdamW", torch.optim.RMSprop: "RMSprop"}
#: torch defaults used to decide const / variable for plain torch optimizers
#: (docs/semantics.md S-52).
_TORCH_CONST_DEFAULTS = {"weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0,
                         "velocity_scaling": 1.0, "eps": 1e-8, "max_weight_norm": 65500.0}
_ALWAYS_CONST = ("alpha", "nesterov", "betas", "centered")


class OptimizerAttrTracker:
    """Warns about optimizer attributes the converter does not know (docs/semantics.md S-53).

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
        kind = next((v for k, v in KINDS.items() if isinstance(optimizer, k)), "") or next(
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


#: Largest finite float32 (hyper-parameters are float32 on the device, as in PopTorch).
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


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
    if math.isfinite(value) and abs(value) > _FLOAT32_MAX:
        raise backend_error(f"The optimizer's {name} = {value!r} is out of float32 range "
                            f"(|x| <= {_FLOAT32_MAX:.6g}): the device holds "
                            "hyper-parameters as float32, as PopTorch; use a smaller value.")
    return float(value)


def to_description(optimizer: torch.optim.Optimizer, param_names: Dict[int, str],
                   automatic_loss_scaling: bool = False,
                   tracker: Optional[OptimizerAttrTracker] = None) -> OptimizerDescription:
    """Convert ``optimizer`` into what the device runs (docs/semantics.md S-50…S-55).

    Args:
        optimizer: a supported optimizer.
        param_names: ``id(parameter) → name`` for the model's parameters.
        automatic_loss_scaling: forces ``loss_scaling`` to be variable (docs/semantics.md S-52).
        tracker: reports attributes added since the first conversion (docs/semantics.md S-53).

    Raises:
        AssertionError / ValueError: unsupported type or hyper-parameter values
            (docs/semantics.md S-50).
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
        # only the hyper-parameters the device optimizer reads (PopTorch ignores
        # torch's flags such as foreach / maximize, and velocity_scaling of the
        # separate SGD variant, which torch optimizers do not have either)
        constant = {a for a in list(names) + ["loss_scaling"]
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
