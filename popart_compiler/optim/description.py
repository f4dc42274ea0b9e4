"""What the device knows about an optimizer (docs/semantics.md S-41, S-50…S-58, S-91): the
hyper-parameters of each optimizer type, the accepted accumulation dtypes,
:class:`OptimizerDescription` (per-group hyper-parameters, loss scaling, variant,
state dtypes, clipping) with its compile signature (what may not change after
compilation, docs/semantics.md S-52) and the wording of a change to that signature. The host side
(``poptorch.optim``) builds descriptions; :mod:`popart_compiler.optim.device_optimizer` runs them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Set, Tuple

import torch

from popart_compiler.errors import backend_error

__all__ = ["OptimizerDescription", "HYPER_PARAMETERS", "ACCUMULATION_TYPES",
           "describe_change"]

#: Per-group hyper-parameters of each optimizer type.
HYPER_PARAMETERS = {
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "velocity_scaling"),
    "Adam": ("lr", "betas", "eps", "weight_decay"),
    "AdamW": ("lr", "betas", "eps", "weight_decay"),
    "RMSprop": ("lr", "alpha", "eps", "weight_decay", "momentum", "centered"),
    "LAMB": ("lr", "betas", "eps", "weight_decay", "max_weight_norm"),
}

#: Storage dtypes accepted for gradient accumulators, velocities and moments.
ACCUMULATION_TYPES = (torch.float32, torch.float16)

#: Hyper-parameters whose value decides the shape of the optimizer state; they are
#: always fixed at compile time.
_STRUCTURAL = ("centered",)

#: PopART names of hyper-parameters, used in logs (docs/semantics.md S-91).
_POPART_NAMES = {
    "lr": "LearningRate", "momentum": "Momentum", "dampening": "Dampening",
    "weight_decay": "WeightDecay", "velocity_scaling": "VelocityScaling",
    "eps": "Eps", "alpha": "Alpha", "max_weight_norm": "MaxWeightNorm",
    "betas": "Betas", "nesterov": "Nesterov", "centered": "Centered",
}

@dataclasses.dataclass
class OptimizerDescription:
    """What the device needs to know about an optimizer.

    Attributes:
        type: ``"SGD"``, ``"Adam"``, ``"AdamW"``, ``"RMSprop"`` or ``"LAMB"``.
        defaults: hyper-parameters for parameters in no group (docs/semantics.md S-55).
        groups: hyper-parameters of each param group, in order.
        group_of: parameter name → group index (absent: the defaults).
        constant: names of hyper-parameters compiled as constants (docs/semantics.md S-52).
        loss_scaling: global loss scaling (docs/semantics.md S-51).
        use_combined_accum: SGD combined variant.
        accum_type / velocity_accum_type / first_order_type / second_order_type:
            storage dtypes of the gradient accumulator, SGD velocity, first and second
            moments (docs/semantics.md S-54); ``torch.float32`` or ``torch.float16``.
        max_grad_norm: clip the global gradient norm to this (``inf``: off).
        bias_correction: Adam-family bias correction (LAMB; AdamW always corrects).
        use_tf_variant: TensorFlow-style RMSprop.
    """
    type: str
    defaults: Dict[str, Any]
    groups: List[Dict[str, Any]]
    group_of: Dict[str, int]
    constant: Set[str] = dataclasses.field(default_factory=set)
    loss_scaling: float = 1.0
    use_combined_accum: bool = False
    accum_type: torch.dtype = torch.float32
    velocity_accum_type: torch.dtype = torch.float32
    first_order_type: torch.dtype = torch.float32
    second_order_type: torch.dtype = torch.float32
    max_grad_norm: float = math.inf
    bias_correction: bool = True
    use_tf_variant: bool = False

    def validate(self) -> None:
        """Check what the device cannot run.

        Raises:
            Error: unknown optimizer type, accumulation dtype other than float32 /
                float16, ``NaN`` maximum gradient norm, non-positive loss scaling.
        """
        if self.type not in HYPER_PARAMETERS:
            raise backend_error(f"Unsupported optimizer type {self.type}: pick one of "
                                f"{sorted(HYPER_PARAMETERS)}")
        for field in ("accum_type", "velocity_accum_type", "first_order_type",
                      "second_order_type"):
            if getattr(self, field) not in ACCUMULATION_TYPES:
                raise backend_error(f"Optimizer {field} must be torch.float32 or "
                                    f"torch.float16, got {getattr(self, field)}")
        if math.isnan(self.max_grad_norm):
            raise backend_error("Maximum norm of gradients cannot be NaN")
        if not (self.loss_scaling > 0 and math.isfinite(self.loss_scaling)):
            raise backend_error(f"Loss scaling must be a positive finite number, got "
                                f"{self.loss_scaling}")

    def hyper(self, name: str) -> Dict[str, Any]:
        """Hyper-parameters applying to parameter ``name``."""
        index = self.group_of.get(name)
        return self.defaults if index is None else self.groups[index]

    def values_of(self, attr: str) -> Tuple[Any, Tuple[Any, ...]]:
        """``(default value, value in each group)`` of a hyper-parameter."""
        if attr == "loss_scaling":
            return self.loss_scaling, ()
        return self.defaults.get(attr), tuple(g.get(attr) for g in self.groups)

    def is_variable(self, attr: str) -> bool:
        """Whether ``attr`` may change after compilation."""
        return attr not in self.constant and attr not in _STRUCTURAL

    def compile_signature(self) -> Dict[str, Any]:
        """What may not change after compilation (docs/semantics.md S-52): type, variant, dtypes,
        clipping, which attributes are constant and the values of the constants."""
        sig: Dict[str, Any] = {
            "optimizer type": self.type,
            "use_combined_accum": self.use_combined_accum,
            "accum_type": self.accum_type,
            "velocity_accum_type": self.velocity_accum_type,
            "first_order_momentum_accum_type": self.first_order_type,
            "second_order_momentum_accum_type": self.second_order_type,
            "use_tf_variant": self.use_tf_variant,
            "bias_correction": self.bias_correction,
            "max_grad_norm": self.max_grad_norm,
            "set of constant attributes": tuple(sorted(self.constant)),
        }
        attrs = set(self.constant) | set(_STRUCTURAL)
        for attr in sorted(attrs):
            if attr == "loss_scaling" or attr in HYPER_PARAMETERS[self.type]:
                sig[f"constant attribute {attr}"] = self.values_of(attr)
        return sig

    def describe(self) -> List[str]:
        """The lines logged when the optimizer is pushed to the device (docs/semantics.md S-91):
        ``SGD, defaultLearningRate=0.01 (const), ..., lossScaling=1.0 (const)`` and one
        ``learningRate=…`` line per group."""
        def fmt(prefix: str, values: Dict[str, Any]) -> List[str]:
            out = []
            for key, value in values.items():
                const = " (const)" if key in self.constant else ""
                name = _POPART_NAMES.get(key, key)
                name = prefix + name if prefix else name[0].lower() + name[1:]
                out.append(f"{name}={value}{const}")
            return out
        const = " (const)" if "loss_scaling" in self.constant else ""
        lines = [", ".join([self.type] + fmt("default", self.defaults)
                           + [f"lossScaling={self.loss_scaling}{const}"])]
        for group in self.groups:
            lines.append(", ".join(fmt("", group)))
        return lines

def describe_change(key: str, old: Any, new: Any) -> str:
    """``momentum of group 0: 0.0 -> 0.5`` for a changed compile-signature entry."""
    if key.startswith("constant attribute ") and isinstance(old, tuple) and \
            isinstance(new, tuple) and len(old) == len(new) == 2:
        attr = key[len("constant attribute "):]
        parts = []
        if old[0] != new[0]:
            parts.append(f"constant {attr} (default): {old[0]} -> {new[0]}")
        for i, (a, b) in enumerate(zip(old[1], new[1])):
            if a != b:
                parts.append(f"constant {attr} of group {i}: {a} -> {b}")
        if parts:
            return "; ".join(parts)
    if key == "set of constant attributes":
        old_set, new_set = set(old or ()), set(new or ())
        parts = [f"{a} became variable" for a in sorted(old_set - new_set)]
        parts += [f"{a} became constant" for a in sorted(new_set - old_set)]
        return "; ".join(parts)
    return f"{key}: {old} -> {new}"
