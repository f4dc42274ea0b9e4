"""The update rule of each optimizer type (docs/semantics.md S-54): SGD, Adam, AdamW and RMSprop
run ``torch.optim``'s functional implementations (so the updates equal
``torch.optim``'s for the same hyper-parameters); LAMB and the TensorFlow RMSprop
variant follow the formulas of docs/semantics.md S-54. The arithmetic runs on float32 working copies
that are rounded to nearest into the parameters' and states' storage dtypes.

The rules are a mixin of :class:`~popart_compiler.optim.device_optimizer.DeviceOptimizer`, which
owns the state they update (reduction, loss scaling and clipping happen there).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.optim.adam as _adam
import torch.optim.adamw as _adamw
import torch.optim.rmsprop as _rmsprop
import torch.optim.sgd as _sgd

__all__ = ["UpdateRules", "float32_work"]


class float32_work:
    """``with float32_work(tensors) as work``: float32 working copies of ``tensors`` (the
    tensors themselves when already float32, ``None`` stays ``None``); on a normal exit
    the copies are rounded back into the originals."""

    __slots__ = ("tensors", "work")

    def __init__(self, tensors: Sequence[Optional[torch.Tensor]]):
        self.tensors = tensors
        self.work = [t if t is None or t.dtype == torch.float32 else t.float()
                     for t in tensors]

    def __enter__(self) -> List[Optional[torch.Tensor]]:
        return self.work

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            for t, w in zip(self.tensors, self.work):
                if w is not t:
                    t.copy_(w)
        return False


def _norms(t: torch.Tensor, grouped: bool) -> torch.Tensor:
    """L2 norm of ``t`` (per slice of the leading group dimension when ``grouped``)."""
    if grouped:
        return torch.linalg.vector_norm(t.float().reshape(t.shape[0], -1), dim=1).reshape(
            (t.shape[0],) + (1,) * (t.dim() - 1))
    return torch.linalg.vector_norm(t.float())


def _real_corrections(step: torch.Tensor, beta1: float, beta2: float) -> bool:
    """Whether torch.optim's Python-float bias corrections for the next step are real
    and non-zero (a user-written step count may make them complex)."""
    t = float(step) + 1
    c1, c2 = 1 - complex(beta1) ** t, 1 - complex(beta2) ** t
    return c1.imag == 0 and c2.imag == 0 and c1.real != 0 and c2.real > 0


class UpdateRules:
    """``step`` and the per-type rules it dispatches to (``_step_<type>``). Uses the
    optimizer's ``description``, ``settings``, ``names``, ``state`` (PopART-named
    tensors, docs/semantics.md S-56), ``_started_names``, ``_grouped`` and ``_clip_factor``."""

    def step(self, params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]
             ) -> None:
        """Update ``params`` in place from their reduced, unscaled gradients (clipped
        here when ``max_grad_norm`` is finite). Parameters whose gradient is ``None``
        are not updated.

        Raises:
            Error: ``max_grad_norm`` is NaN.
        """
        d = self.description
        clip = self._clip_factor(grads)
        present = [(n, p, g if clip is None else g * clip)
                   for n, p, g in zip(self.names, params, grads) if g is not None]
        if not present:
            return
        # Parameters sharing the same hyper-parameters: one call per group.
        buckets: Dict[int, List] = {}
        for n, p, g in present:
            buckets.setdefault(d.group_of.get(n, -1), []).append((n, p, g.float()))
        with torch.no_grad():
            for index, items in buckets.items():
                h = d.defaults if index < 0 else d.groups[index]
                getattr(self, f"_step_{d.type}")(h, items)

    def _step_SGD(self, h: Dict[str, Any], items) -> None:
        momentum = float(h.get("momentum", 0.0))
        dampening = float(h.get("dampening", 0.0))
        lr = float(h["lr"])
        if momentum == 0.0:
            # PopART scales the step by (1 - dampening) even without momentum
            # (docs/semantics.md S-54).
            lr = lr * (1.0 - dampening)
        names = [n for n, _, _ in items]
        bufs = [self.state.get(f"Accl___{n}") if momentum != 0.0 else None for n in names]
        with float32_work([p for _, p, _ in items]) as params, float32_work(bufs) as work:
            # torch's functional SGD starts the velocity from the first gradient when
            # the buffer is None; our buffers are pre-allocated, so emulate that.
            lists = [None if momentum == 0.0 or n not in self._started_names else b
                     for n, b in zip(names, work)]
            _sgd.sgd(params, [g for _, _, g in items], lists,
                     weight_decay=float(h.get("weight_decay", 0.0)), momentum=momentum,
                     lr=lr, dampening=dampening, nesterov=bool(h.get("nesterov", False)),
                     maximize=False, foreach=self.settings.foreach)
            if momentum != 0.0:
                for n, w, new in zip(names, work, lists):
                    if w is not None and new is not None and new is not w:
                        w.copy_(new)
                    self._started_names.add(n)

    def _adam_like(self, h: Dict[str, Any], items, fn, **extra) -> None:
        beta1, beta2 = (float(b) for b in h.get("betas", (0.9, 0.999)))
        odd = [it for it in items
               if not _real_corrections(self.state[f"Step___{it[0]}"], beta1, beta2)]
        if odd:  # a step count written by the user: the device computes NaN, not complex
            for n, p, g in odd:
                self._adam_ieee(h, n, p, g, fn is _adamw.adamw, beta1, beta2)
            items = [it for it in items if all(it is not o for o in odd)]
            if not items:
                return
        names = [n for n, _, _ in items]
        with float32_work([p for _, p, _ in items]) as params, \
                float32_work([self.state[f"Accl1___{n}"] for n in names]) as m, \
                float32_work([self.state[f"Accl2___{n}"] for n in names]) as v:
            fn(params, [g for _, _, g in items], m, v, [],
               [self.state[f"Step___{n}"] for n in names],
               foreach=self.settings.foreach, amsgrad=False, beta1=beta1, beta2=beta2,
               lr=float(h["lr"]),
               weight_decay=float(h.get("weight_decay", 0.0)),
               eps=float(h.get("eps", 1e-8)), maximize=False, **extra)

    def _adam_ieee(self, h, n, p, g, decoupled: bool, beta1: float, beta2: float) -> None:
        """torch.optim's Adam / AdamW update with the bias corrections as float32
        tensors (a negative base gives NaN, as on the device, not a complex number)."""
        lr, eps = float(h["lr"]), float(h.get("eps", 1e-8))
        wd = float(h.get("weight_decay", 0.0))
        step = self.state[f"Step___{n}"]
        step.add_(1)
        with float32_work([p]) as (w,), float32_work([self.state[f"Accl1___{n}"],
                                              self.state[f"Accl2___{n}"]]) as (m, v):
            if decoupled:
                w.mul_(1 - lr * wd)
            elif wd:
                g = g.add(w, alpha=wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            t = step.float()
            correction1 = 1 - torch.pow(torch.tensor(beta1), t)
            correction2 = 1 - torch.pow(torch.tensor(beta2), t)
            denom = v.sqrt() / correction2.sqrt() + eps
            w.sub_(lr / correction1 * m / denom)

    def _step_Adam(self, h, items) -> None:
        self._adam_like(h, items, _adam.adam)

    def _step_AdamW(self, h, items) -> None:
        # AdamW always applies bias correction on the device (docs/semantics.md S-54 quirk).
        self._adam_like(h, items, _adamw.adamw)

    def _step_RMSprop(self, h, items) -> None:
        if self.description.use_tf_variant:
            self._step_RMSprop_tf(h, items)
            return
        names = [n for n, _, _ in items]
        momentum = float(h.get("momentum", 0.0))
        centered = bool(h.get("centered", False))
        if momentum < 0:  # only a written value (torch.optim would drop the momentum)
            self._rmsprop_negative_momentum(h, items, momentum, centered)
            return
        with float32_work([p for _, p, _ in items]) as params, \
                float32_work([self.state[f"Accl1___{n}"] for n in names]) as sq, \
                float32_work([self.state[f"Accl2___{n}"] for n in names] if centered
                         else []) as avg, \
                float32_work([self.state[f"Accl3___{n}"] for n in names] if momentum != 0
                         else []) as mom:
            _rmsprop.rmsprop(
                params, [g for _, _, g in items], sq, avg, mom,
                [self.state[f"Step___{n}"] for n in names],
                foreach=self.settings.foreach, lr=float(h["lr"]), alpha=float(h.get("alpha", 0.99)),
                eps=float(h.get("eps", 1e-8)),
                weight_decay=float(h.get("weight_decay", 0.0)),
                momentum=momentum, centered=centered)

    def _rmsprop_negative_momentum(self, h, items, momentum: float, centered: bool) -> None:
        """torch.optim's RMSprop formulas with a negative momentum written through
        ``ipu_param`` (the device applies the momentum whatever its sign)."""
        lr, alpha = float(h["lr"]), float(h.get("alpha", 0.99))
        eps, wd = float(h.get("eps", 1e-8)), float(h.get("weight_decay", 0.0))
        for n, p, g in items:
            states = [self.state[f"Accl1___{n}"], self.state.get(f"Accl2___{n}"),
                      self.state[f"Accl3___{n}"]]
            with float32_work([p]) as (w,), float32_work(states) as (sq, avg, buf):
                if wd:
                    g = g + wd * w
                sq.mul_(alpha).addcmul_(g, g, value=1 - alpha)
                if centered:
                    avg.lerp_(g, 1 - alpha)
                    denom = sq.addcmul(avg, avg, value=-1).sqrt_().add_(eps)
                else:
                    denom = sq.sqrt().add_(eps)
                buf.mul_(momentum).addcdiv_(g, denom)
                w.add_(buf, alpha=-lr)
            self.state[f"Step___{n}"].add_(1)

    def _step_RMSprop_tf(self, h, items) -> None:
        """TensorFlow RMSprop: squared average starting at one, ``eps`` inside the
        square root, learning rate folded into the momentum buffer (docs/semantics.md S-54)."""
        lr, alpha = float(h["lr"]), float(h.get("alpha", 0.99))
        eps, wd = float(h.get("eps", 1e-8)), float(h.get("weight_decay", 0.0))
        momentum = float(h.get("momentum", 0.0))
        centered = bool(h.get("centered", False))
        for n, p, g in items:
            states = [self.state[f"Accl1___{n}"], self.state.get(f"Accl2___{n}"),
                      self.state.get(f"Accl3___{n}") if momentum else None]
            with float32_work([p]) as (w,), float32_work(states) as (sq, avg, buf):
                if wd:
                    g = g + wd * w
                sq.mul_(alpha).addcmul_(g, g, value=1 - alpha)
                denom = sq
                if centered:
                    avg.mul_(alpha).add_(g, alpha=1 - alpha)
                    denom = sq - avg * avg
                denom = (denom + eps).sqrt()
                if buf is not None:
                    buf.mul_(momentum).addcdiv_(g, denom, value=lr)
                    w.sub_(buf)
                else:
                    w.addcdiv_(g, denom, value=-lr)
            self.state[f"Step___{n}"].add_(1)

    def _step_LAMB(self, h, items) -> None:
        """LAMB per docs/semantics.md S-54; the trust ratio of a replica-grouped weight is per
        group."""
        d = self.description
        beta1, beta2 = (float(b) for b in h.get("betas", (0.9, 0.999)))
        lr, eps = float(h["lr"]), float(h.get("eps", 1e-8))
        wd = float(h.get("weight_decay", 1e-2))
        max_norm = h.get("max_weight_norm", 65500.0)
        max_norm = 65500.0 if max_norm is None else float(max_norm)
        for n, p, g in items:
            grouped = self._grouped(n)
            step = self.state[f"Step___{n}"]
            step.add_(1)
            with float32_work([p]) as (w,), float32_work([self.state[f"Accl1___{n}"],
                                                  self.state[f"Accl2___{n}"]]) as (m, v):
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                if d.bias_correction:
                    t = step.double()  # a written step count may be fractional: NaN
                    m_hat, v_hat = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
                else:
                    m_hat, v_hat = m, v
                u = m_hat / (v_hat.sqrt() + eps) + wd * w
                r1 = _norms(w, grouped).clamp(max=max_norm)
                r2 = _norms(u, grouped)
                trust = torch.where((r1 == 0) | (r2 == 0), torch.ones_like(r1), r1 / r2)
                w.sub_(lr * trust * u)
