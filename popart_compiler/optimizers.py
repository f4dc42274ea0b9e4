"""Optimizers of the simulated device (PopART semantics, spec S-50…S-58).

The runtime updates device weights itself; the host optimizer's ``step()`` never runs.
SGD, Adam, AdamW and RMSprop use ``torch.optim``'s functional implementations (so the
updates equal ``torch.optim``'s for the same hyper-parameters); LAMB follows the formula
of S-54. State tensors carry PopART's names (S-56): ``Accl___<p>`` (SGD velocity /
RMSprop momentum), ``Accl1___<p>`` / ``Accl2___<p>`` (first / second moments),
``Step___<p>``, ``Accum___<p>`` (gradient accumulator of the separate SGD variant).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
import torch.optim.adam as _adam
import torch.optim.adamw as _adamw
import torch.optim.rmsprop as _rmsprop
import torch.optim.sgd as _sgd

from .errors import backend_error
from .logging import logger

__all__ = ["OptimizerDescription", "DeviceOptimizer", "HYPER_PARAMETERS"]

#: Per-group hyper-parameters of each optimizer type.
HYPER_PARAMETERS = {
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "velocity_scaling"),
    "Adam": ("lr", "betas", "eps", "weight_decay"),
    "AdamW": ("lr", "betas", "eps", "weight_decay"),
    "RMSprop": ("lr", "alpha", "eps", "weight_decay", "momentum", "centered"),
    "LAMB": ("lr", "betas", "eps", "weight_decay", "max_weight_norm"),
}

#: PopART names of hyper-parameters, used in logs (S-91) and ``ipu_param`` (S-56).
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
        defaults: hyper-parameters for parameters in no group (S-55).
        groups: hyper-parameters of each param group, in order.
        group_of: parameter name → group index (absent: the defaults).
        constant: names of hyper-parameters compiled as constants (S-52).
        loss_scaling: global loss scaling (S-51).
        use_combined_accum: SGD combined variant.
        accum_type / velocity_accum_type / first_order_type / second_order_type:
            storage dtypes of the gradient accumulator, SGD velocity, first and second
            moments (S-54).
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

    def hyper(self, name: str) -> Dict[str, Any]:
        """Hyper-parameters applying to parameter ``name``."""
        index = self.group_of.get(name)
        return self.defaults if index is None else self.groups[index]

    def compile_signature(self):
        """What may not change after compilation (S-52): type, dtypes, constants."""
        consts = {}
        for attr in sorted(self.constant):
            if attr == "loss_scaling":
                consts[attr] = self.loss_scaling
                continue
            consts[attr] = (self.defaults.get(attr),
                            tuple(g.get(attr) for g in self.groups))
        return (self.type, self.use_combined_accum, self.accum_type,
                self.velocity_accum_type, self.first_order_type, self.second_order_type,
                self.use_tf_variant, tuple(sorted(self.constant)), tuple(consts.items()))

    def describe(self) -> str:
        """``Updating graph optimizer with SGD, defaultLearningRate=0.01 (const), ...``"""
        parts = [self.type]
        for key, value in self.defaults.items():
            const = " (const)" if key in self.constant else ""
            parts.append(f"default{_POPART_NAMES.get(key, key)}={value}{const}")
        const = " (const)" if "loss_scaling" in self.constant else ""
        parts.append(f"lossScaling={self.loss_scaling}{const}")
        return ", ".join(parts)


def _bias_corrections(step: float, beta1: float, beta2: float):
    return 1 - beta1 ** step, 1 - beta2 ** step


class DeviceOptimizer:
    """The optimizer state and update of one training session.

    Args:
        description: the optimizer to run.
        names: device parameter names, aligned with the ``params`` given to :meth:`step`.
        params: device parameters (used to allocate state of the right shape).
    """

    def __init__(self, description: OptimizerDescription, names: Sequence[str],
                 params: Sequence[torch.Tensor]):
        self.description = description
        self.names = list(names)
        self.state: Dict[str, torch.Tensor] = {}
        # SGD velocities that hold a value (torch starts the velocity from the first
        # gradient rather than from zero).
        self._started_names: Set[str] = set()
        self._signature = description.compile_signature()
        self._allocate(params)

    # -- state ------------------------------------------------------------------------

    def _allocate(self, params: Sequence[torch.Tensor]) -> None:
        d = self.description
        for name, p in zip(self.names, params):
            if d.type == "SGD":
                if d.hyper(name).get("momentum", 0.0) != 0.0 or d.use_combined_accum:
                    self.state[f"Accl___{name}"] = torch.zeros_like(
                        p, dtype=p.dtype if d.use_combined_accum else d.velocity_accum_type)
            elif d.type in ("Adam", "AdamW", "LAMB"):
                self.state[f"Accl1___{name}"] = torch.zeros_like(p, dtype=d.first_order_type)
                self.state[f"Accl2___{name}"] = torch.zeros_like(p, dtype=d.second_order_type)
                self.state[f"Step___{name}"] = torch.zeros((), dtype=torch.float32,
                                                           device=p.device)
            elif d.type == "RMSprop":
                h = d.hyper(name)
                init = torch.ones_like if d.use_tf_variant else torch.zeros_like
                self.state[f"Accl2___{name}"] = init(p, dtype=d.second_order_type)
                if h.get("centered", False):
                    self.state[f"Accl1___{name}"] = torch.zeros_like(
                        p, dtype=d.first_order_type)
                if h.get("momentum", 0.0) != 0.0:
                    self.state[f"Accl___{name}"] = torch.zeros_like(p, dtype=d.accum_type)
                self.state[f"Step___{name}"] = torch.zeros((), dtype=torch.float32,
                                                           device=p.device)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Copies of the optimizer-state tensors by PopART name (``ipu_state``, S-56)."""
        return {k: v.detach().clone() for k, v in self.state.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Write state tensors; missing entries keep their values (with a warning).

        Raises:
            Error: a tensor whose shape differs from the device state's; nothing is
                written in that case.
        """
        for name, value in state.items():
            if name in self.state and tuple(value.shape) != tuple(self.state[name].shape):
                raise backend_error(
                    f"Optimizer state {name} has shape {list(value.shape)} but the device "
                    f"expects {list(self.state[name].shape)}")
        for name, current in self.state.items():
            if name not in state:
                logger.warning("ignoring missing state %s", name)
                continue
            current.copy_(state[name].to(current.dtype))
        self._started_names.update(n.split("___", 1)[1] for n in state if n.startswith("Accl___"))

    def hyper_parameters(self) -> Dict[str, torch.Tensor]:
        """Hyper-parameter tensors by PopART name (``ipu_param``, S-56)."""
        d = self.description
        out: Dict[str, torch.Tensor] = {}
        scale = d.loss_scaling

        def put(kind: str, name: str, h: Dict[str, Any]):
            lr = float(h.get("lr", 0.0))
            if d.type == "SGD":
                damp = float(h.get("dampening", 0.0))
                wd = float(h.get("weight_decay", 0.0))
                out[f"scaledLearningRate0___{kind}___{name}"] = torch.tensor(
                    lr * (1 - damp) / scale)
                out[f"weightDecayScaleFactor0___{kind}___{name}"] = torch.tensor(
                    1 - lr * (1 - damp) * wd)
            else:
                out[f"learningRate___{kind}___{name}"] = torch.tensor(lr)
                out[f"weightDecay___{kind}___{name}"] = torch.tensor(
                    float(h.get("weight_decay", 0.0)))
        put("default", "", d.defaults)
        for name in self.names:
            put("specific", name, d.hyper(name))
        out["lossScaling_FLOAT"] = torch.tensor(float(scale))
        return {k.replace("______", "___"): v for k, v in out.items()}

    # -- updates ----------------------------------------------------------------------

    def update(self, description: OptimizerDescription) -> None:
        """Apply new hyper-parameter values (``setOptimizer``).

        Raises:
            Error: a change that needs recompilation: optimizer type, accumulation
                types, constant values or const/variable status (S-52).
        """
        if description.compile_signature() != self._signature:
            raise backend_error(
                "The compiled optimizer cannot be changed this way: the optimizer type, "
                "the accumulation types, which attributes are constant and the values of "
                "constant attributes are fixed at compile time. Mark the attribute as "
                "variable (pass it explicitly to the optimizer's constructor or call "
                "optimizer.variable_attrs.markAsVariable(<name>)) before compiling.")
        self.description = description

    def step(self, params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]
             ) -> None:
        """Update ``params`` in place from their reduced, unscaled gradients.

        Parameters whose gradient is ``None`` are not updated.
        """
        d = self.description
        if math.isnan(d.max_grad_norm):
            raise backend_error("Maximum norm of gradients cannot be NaN")
        present = [(n, p, g) for n, p, g in zip(self.names, params, grads) if g is not None]
        if not present:
            return
        if math.isfinite(d.max_grad_norm):
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.float()) for _, _, g in present]))
            factor = torch.clamp(d.max_grad_norm / (norm + 1e-6), max=1.0)
            present = [(n, p, g * factor.to(g.dtype)) for n, p, g in present]
        # Group parameters sharing the same hyper-parameters: one fused call per group.
        buckets: Dict[int, List] = {}
        for n, p, g in present:
            index = d.group_of.get(n, -1)
            buckets.setdefault(index, []).append((n, p, g))
        for index, items in buckets.items():
            h = d.defaults if index < 0 else d.groups[index]
            getattr(self, f"_step_{d.type}")(h, items)

    def _step_SGD(self, h: Dict[str, Any], items) -> None:
        momentum = float(h.get("momentum", 0.0))
        dampening = float(h.get("dampening", 0.0))
        lr = float(h["lr"])
        if momentum == 0.0:
            # PopART scales the step by (1 - dampening) even without momentum (S-54).
            lr = lr * (1.0 - dampening)
        bufs = [self.state.get(f"Accl___{n}") for n, _, _ in items]
        if momentum != 0.0:
            # torch's functional SGD starts the velocity from the first gradient when the
            # buffer is None; our buffers are pre-allocated, so emulate its first step.
            first = [not self._started(n) for n, _, _ in items]
            lists = [None if f else b for f, b in zip(first, bufs)]
        else:
            first, lists = [False] * len(items), [None] * len(items)
        params = [p for _, p, _ in items]
        _sgd.sgd(params, [g.to(p.dtype) for _, p, g in items], lists,
                 weight_decay=float(h.get("weight_decay", 0.0)), momentum=momentum,
                 lr=lr, dampening=dampening, nesterov=bool(h.get("nesterov", False)),
                 maximize=False, foreach=False)
        if momentum != 0.0:
            for (n, _, _), f, new in zip(items, first, lists):
                if f and new is not None:
                    self.state[f"Accl___{n}"].copy_(new)
                self._mark_started(n)

    def _started(self, name: str) -> bool:
        return name in self._started_names

    def _mark_started(self, name: str) -> None:
        self._started_names.add(name)

    def _adam_like(self, h: Dict[str, Any], items, fn, **extra) -> None:
        beta1, beta2 = (float(b) for b in h.get("betas", (0.9, 0.999)))
        params = [p for _, p, _ in items]
        fn(params, [g.to(p.dtype) for _, p, g in items],
           [self.state[f"Accl1___{n}"] for n, _, _ in items],
           [self.state[f"Accl2___{n}"] for n, _, _ in items], [],
           [self.state[f"Step___{n}"] for n, _, _ in items],
           foreach=False, amsgrad=False, beta1=beta1, beta2=beta2, lr=float(h["lr"]),
           weight_decay=float(h.get("weight_decay", 0.0)), eps=float(h.get("eps", 1e-8)),
           maximize=False, **extra)

    def _step_Adam(self, h, items) -> None:
        self._adam_like(h, items, _adam.adam)

    def _step_AdamW(self, h, items) -> None:
        # AdamW always applies bias correction on the device (S-54 quirk).
        self._adam_like(h, items, _adamw.adamw)

    def _step_RMSprop(self, h, items) -> None:
        d = self.description
        if d.use_tf_variant:
            self._step_RMSprop_tf(h, items)
            return
        params = [p for _, p, _ in items]
        momentum = float(h.get("momentum", 0.0))
        centered = bool(h.get("centered", False))
        _rmsprop.rmsprop(
            params, [g.to(p.dtype) for _, p, g in items],
            [self.state[f"Accl2___{n}"] for n, _, _ in items],
            [self.state[f"Accl1___{n}"] for n, _, _ in items] if centered else [],
            [self.state[f"Accl___{n}"] for n, _, _ in items] if momentum != 0 else [],
            [self.state[f"Step___{n}"] for n, _, _ in items],
            foreach=False, lr=float(h["lr"]), alpha=float(h.get("alpha", 0.99)),
            eps=float(h.get("eps", 1e-8)), weight_decay=float(h.get("weight_decay", 0.0)),
            momentum=momentum, centered=centered)

    def _step_RMSprop_tf(self, h, items) -> None:
        lr, alpha = float(h["lr"]), float(h.get("alpha", 0.99))
        eps, wd = float(h.get("eps", 1e-8)), float(h.get("weight_decay", 0.0))
        momentum = float(h.get("momentum", 0.0))
        centered = bool(h.get("centered", False))
        with torch.no_grad():
            for n, p, g in items:
                g = g.to(p.dtype)
                if wd:
                    g = g + wd * p
                sq = self.state[f"Accl2___{n}"]
                sq.mul_(alpha).addcmul_(g, g, value=1 - alpha)
                denom = sq
                if centered:
                    avg = self.state[f"Accl1___{n}"]
                    avg.mul_(alpha).add_(g, alpha=1 - alpha)
                    denom = sq - avg * avg
                denom = (denom + eps).sqrt()
                if momentum:
                    buf = self.state[f"Accl___{n}"]
                    buf.mul_(momentum).addcdiv_(g, denom, value=lr)
                    p.sub_(buf)
                else:
                    p.addcdiv_(g, denom, value=-lr)
                self.state[f"Step___{n}"].add_(1)

    def _step_LAMB(self, h, items) -> None:
        d = self.description
        beta1, beta2 = (float(b) for b in h.get("betas", (0.9, 0.999)))
        lr, eps = float(h["lr"]), float(h.get("eps", 1e-8))
        wd = float(h.get("weight_decay", 1e-2))
        max_norm = h.get("max_weight_norm", 65500.0)
        max_norm = 65500.0 if max_norm is None else float(max_norm)
        with torch.no_grad():
            for n, p, g in items:
                m, v = self.state[f"Accl1___{n}"], self.state[f"Accl2___{n}"]
                step = self.state[f"Step___{n}"]
                step.add_(1)
                g = g.to(m.dtype)
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                if d.bias_correction:
                    c1, c2 = _bias_corrections(float(step), beta1, beta2)
                    m_hat, v_hat = m / c1, v / c2
                else:
                    m_hat, v_hat = m, v
                u = m_hat / (v_hat.sqrt() + eps) + wd * p.to(m.dtype)
                r1 = torch.linalg.vector_norm(p.float()).clamp(max=max_norm)
                r2 = torch.linalg.vector_norm(u.float())
                trust = torch.where((r1 == 0) | (r2 == 0), torch.ones_like(r1), r1 / r2)
                p.sub_((lr * trust * u).to(p.dtype))
