"""Optimizers of the simulated device (PopART semantics, docs/semantics.md S-41, S-50…S-58).

The runtime updates device weights itself; the host optimizer's ``step()`` never runs.
One weight update of a training session goes through :class:`DeviceOptimizer`:

1. :meth:`DeviceOptimizer.begin_step`;
2. :meth:`DeviceOptimizer.accumulate` once per micro-batch and replica with the
   *loss-scaled* gradients of that micro-batch (docs/semantics.md S-51);
3. :meth:`DeviceOptimizer.finish_step`: reduction over accumulation steps and replicas
   (docs/semantics.md S-41), removal of the loss scaling, gradient clipping, the update
   (docs/semantics.md S-54) and the automatic-loss-scaling rule (docs/semantics.md S-57).

Precision model (what the IPU Model does):

* gradients are produced by PyTorch autograd in the dtype of their parameter;
* the gradient accumulator (``Accum___<p>``, only with gradient accumulation) is stored
  in ``accum_type``; velocities and moments in ``velocity_accum_type`` /
  ``first_order_momentum_accum_type`` / ``second_order_momentum_accum_type``; the
  velocity of the combined SGD variant in the parameter's dtype;
* the ``Mean`` division happens after all micro-batches (``Post``) or as a running
  mean ``acc ← acc·k/(k+1) + g/(k+1)`` per micro-batch (``Running``, evaluated in
  float32 and rounded once into the accumulator), per replica, followed by the
  cross-replica sum divided by the global replication factor;
* the update arithmetic itself runs in float32 (``torch.optim``'s functional kernels
  on float32 working copies); results are rounded to nearest into the parameters' and
  states' storage dtypes.

The update rule of each optimizer type (docs/semantics.md S-54) is in :mod:`.updates`; what the
device knows of an optimizer (:class:`OptimizerDescription`, docs/semantics.md S-52) in
:mod:`.description`; the
shared machinery here: state allocation and transfer, accumulation and reduction,
clipping, loss scaling and the combined SGD variant. State tensors carry PopART's names
(docs/semantics.md S-56): ``Accl___<p>`` (SGD velocity), ``Accl1___<p>`` / ``Accl2___<p>`` (Adam /
LAMB first / second moments; RMSprop mean square / centered mean), ``Accl3___<p>`` (RMSprop
momentum), ``Step___<p>``, ``Accum___<p>`` (gradient accumulator) and ``lossScaleUpdateFactor``
(automatic loss scaling).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from popart_compiler.errors import backend_error
from popart_compiler.logging import logger
from popart_compiler.optim.description import OptimizerDescription, describe_change
from popart_compiler.optim.loaded_params import LoadedParams
from popart_compiler.optim.step_settings import StepSettings
from popart_compiler.optim.updates import UpdateRules, float32_work

__all__ = ["DeviceOptimizer", "StepSettings", "FLOAT16_MAX"]

#: Largest finite float16 value.
FLOAT16_MAX = 65504.0
#: Smallest normal float16 value (lower bound of the automatic loss scale).
_FLOAT16_MIN_NORMAL = 2.0 ** -14


class DeviceOptimizer(UpdateRules, LoadedParams):
    """The optimizer state and update of one training session.

    Args:
        description: the optimizer to run (validated here).
        names: device parameter names, aligned with the ``params`` given to
            :meth:`finish_step` / :meth:`step`.
        params: device parameters (used to allocate state of the right shape / dtype;
            replica-grouped parameters have their group dimension).
        settings: reduction, replication and loss-scaling settings (defaults: one
            replica, no accumulation).

    Raises:
        Error: an invalid description (:meth:`OptimizerDescription.validate`).
    """

    def __init__(self, description: OptimizerDescription, names: Sequence[str],
                 params: Sequence[torch.Tensor], settings: Optional[StepSettings] = None):
        description.validate()
        self.description = description
        self.settings = settings or StepSettings()
        self.names = list(names)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.state: Dict[str, torch.Tensor] = {}
        # SGD velocities that hold a value (torch starts the velocity from the first
        # gradient rather than from zero).
        self._started_names: Set[str] = set()
        self._signature = description.compile_signature()
        # ipu_param values written (docs/semantics.md S-56)
        self._written: Dict[str, torch.Tensor] = {}
        self._host_description: Optional[OptimizerDescription] = None
        self._params = list(params)
        self._allocate(params)
        if self.settings.auto_loss_scaling:
            device = params[0].device if params else "cpu"
            self.state["lossScaleUpdateFactor"] = torch.ones((), device=device)
        self._als = [0, 0]  # [elements in the top bin, elements seen] this period
        self._updates = 0
        self._step: Optional[Dict[str, Any]] = None

    # -- state ------------------------------------------------------------------------

    def _has_velocity(self, name: str) -> bool:
        d = self.description
        return d.hyper(name).get("momentum", 0.0) != 0.0 or d.is_variable("momentum")

    def _allocate(self, params: Sequence[torch.Tensor]) -> None:
        d = self.description
        accumulating = self.settings.accumulation > 1
        for name, p in zip(self.names, params):
            zeros = lambda dtype: torch.zeros_like(p, dtype=dtype)  # noqa: E731
            if d.type == "SGD":
                if d.use_combined_accum:
                    if self._has_velocity(name) or accumulating:
                        self.state[f"Accl___{name}"] = zeros(p.dtype)
                    continue
                if self._has_velocity(name):
                    self.state[f"Accl___{name}"] = zeros(d.velocity_accum_type)
            elif d.type in ("Adam", "AdamW", "LAMB"):
                self.state[f"Accl1___{name}"] = zeros(d.first_order_type)
                self.state[f"Accl2___{name}"] = zeros(d.second_order_type)
                self.state[f"Step___{name}"] = torch.zeros((), device=p.device)
            elif d.type == "RMSprop":
                h = d.hyper(name)
                init = torch.ones_like if d.use_tf_variant else torch.zeros_like
                # PopART's Adaptive names: Accl1 mean square, Accl2 mean (centered),
                # Accl3 momentum
                self.state[f"Accl1___{name}"] = init(p, dtype=d.second_order_type)
                if h.get("centered", False):
                    self.state[f"Accl2___{name}"] = zeros(d.first_order_type)
                if self._has_velocity(name):
                    self.state[f"Accl3___{name}"] = zeros(d.accum_type)
                self.state[f"Step___{name}"] = torch.zeros((), device=p.device)
            if accumulating:
                self.state[f"Accum___{name}"] = zeros(d.accum_type)

    @property
    def loss_scale(self) -> float:
        """The effective loss scale of the next weight update: ``loss_scaling`` times
        ``lossScaleUpdateFactor`` with automatic loss scaling (docs/semantics.md S-57)."""
        factor = self.state.get("lossScaleUpdateFactor")
        scale = float(self.description.loss_scaling)
        return scale * float(factor) if factor is not None else scale

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Copies of the optimizer-state tensors by PopART name (``ipu_state``,
        docs/semantics.md S-56)."""
        return {k: v.detach().clone() for k, v in self.state.items()}

    def check_state(self, state: Any) -> None:
        """Validate state tensors for :meth:`load_state_dict` without writing anything.

        Raises:
            Error: ``state`` is not a dict of tensors, or a tensor's shape differs from
                the device state's, or its dtype is not a real number type.
        """
        if not isinstance(state, dict):
            raise backend_error(f"The optimizer state (ipu_state) must be a dict of "
                                f"tensors, got {type(state).__name__}")
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise backend_error(f"Optimizer state {name} must be a torch.Tensor, got "
                                    f"{type(value).__name__}")
            if value.dtype == torch.bool or value.is_complex():
                raise backend_error(f"Optimizer state {name} has dtype {value.dtype}: "
                                    "expected a floating point tensor")
            current = self.state.get(name)
            if current is not None and tuple(value.shape) != tuple(current.shape):
                raise backend_error(
                    f"Optimizer state {name} has shape {list(value.shape)} but the device "
                    f"expects {list(current.shape)}")

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Write state tensors; missing entries keep their values (with a warning),
        unknown entries are ignored (with a warning).

        Raises:
            Error: see :meth:`check_state`; nothing is written in that case.
        """
        self.check_state(state)
        for name in state:
            if name not in self.state:
                logger.warning("ignoring unexpected state %s", name)
        for name, current in self.state.items():
            if name not in state:
                logger.warning("ignoring missing state %s", name)
                continue
            current.copy_(state[name].detach().to(device=current.device,
                                                  dtype=current.dtype))
        self.note_state_written(state)

    def note_state_written(self, names: Sequence[str]) -> None:
        """After state tensors ``names`` were overwritten: an SGD velocity that holds
        a value has started (torch starts a momentum buffer from the first gradient)."""
        for name in names:
            if name.startswith("Accl___") and name in self.state:
                base = name.split("___", 1)[1]
                if bool(self.state[name].any()):
                    self._started_names.add(base)
                else:
                    self._started_names.discard(base)

    def state_tensors(self) -> List[torch.Tensor]:
        """The optimizer-state tensors a weight update writes in place."""
        return list(self.state.values())

    def snapshot(self, copy_state: bool = True) -> Dict[str, Any]:
        """Everything a weight update changes (for :meth:`restore` after a failed run).

        Args:
            copy_state: also copy the state tensors; ``False`` when the caller saves
                :meth:`state_tensors` itself.
        """
        return {"state": self.state_dict() if copy_state else {},
                "started": set(self._started_names), "als": list(self._als),
                "updates": self._updates}

    def restore(self, snap: Dict[str, Any]) -> None:
        """Undo the updates made since :meth:`snapshot`."""
        with torch.no_grad():
            for name, value in snap["state"].items():
                self.state[name].copy_(value)
        self._started_names = set(snap["started"])
        self._als = list(snap["als"])
        self._updates = snap["updates"]
        self._step = None

    # -- hyper-parameter updates ------------------------------------------------------

    def check_update(self, description: OptimizerDescription) -> None:
        """Raise if ``description`` cannot replace the compiled one (no side effects).

        Raises:
            Error: invalid description, or a change that needs recompilation: optimizer
                type, variant, accumulation types, clipping, constant values or
                const/variable status (docs/semantics.md S-52). The message names what changed.
        """
        description.validate()
        new = description.compile_signature()
        changed = [k for k in sorted(set(new) | set(self._signature))
                   if new.get(k) != self._signature.get(k)]
        if "optimizer type" in changed:
            changed = ["optimizer type"]  # everything else follows from it
        if changed:
            details = "; ".join(describe_change(k, self._signature.get(k), new.get(k))
                                for k in changed)
            raise backend_error(
                "The compiled optimizer cannot be changed this way: the optimizer type, "
                "the accumulation types, which attributes are constant and the values of "
                "constant attributes are fixed at compile time. Changed: " + details +
                ". Mark the attribute as variable (pass it explicitly to the optimizer's "
                "constructor or call optimizer.variable_attrs.markAsVariable(<name>)) "
                "before compiling, or create a new wrapper.")

    def update(self, description: OptimizerDescription) -> None:
        """Apply new hyper-parameter values (``setOptimizer``).

        Raises:
            Error: see :meth:`check_update`; nothing changes in that case.
        """
        self.check_update(description)
        self.forget_written()
        self.description = description

    # -- one weight update -------------------------------------------------------------

    def _grouped(self, name: str) -> bool:
        return name in self.settings.replica_groups

    def _slice(self, t: torch.Tensor, name: str, replica: int) -> torch.Tensor:
        groups = self.settings.replica_groups.get(name)
        return t if groups is None else t[groups[replica]]

    def _combined_factor(self, name: str) -> float:
        """Dampening factor of this update's gradients in the combined variant: the
        first update with momentum starts the velocity from the gradient (like torch)."""
        h = self.description.hyper(name)
        momentum = float(h.get("momentum", 0.0))
        if momentum != 0.0 and name not in self._started_names:
            return 1.0
        return 1.0 - float(h.get("dampening", 0.0))

    def begin_step(self) -> None:
        """Start a weight update: clear the accumulators (and, for the combined SGD
        variant, remember the velocity the update starts from)."""
        d, s = self.description, self.settings
        scale = self.loss_scale
        divisor = s.accumulation * s.global_replicas if s.mean else 1
        step: Dict[str, Any] = {"acc": {}, "scale": scale, "divisor": divisor,
                                "als_start": list(self._als)}
        if d.type == "SGD" and d.use_combined_accum:
            accl, start, factor = {}, {}, {}
            for name, p in zip(self.names, self._params):
                h = d.hyper(name)
                buf = self.state.get(f"Accl___{name}")
                if buf is None:  # no momentum, no accumulation: a transient velocity
                    buf = torch.zeros_like(p)
                accl[name] = buf
                start[name] = buf.detach().float().clone()
                f = self._combined_factor(name)
                factor[name] = (f, float(h.get("velocity_scaling", 1.0)) * f / (scale * divisor))
            step.update(accl=accl, start=start, factor=factor, touched=set())
        self._step = step

    def accumulate(self, replica: int, micro_batch: int,
                   grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Add the loss-scaled gradients of one micro-batch of one replica.

        Args:
            replica: replica index ``0 ≤ replica < R``.
            micro_batch: index ``0 ≤ micro_batch < A`` within the weight update.
            grads: one entry per parameter (``None``: no gradient), each of the shape
                the replica sees (one slice of a replica-grouped parameter).
        """
        d, s, st = self.description, self.settings, self._step
        if st is None:
            self.begin_step()
            st = self._step
        with torch.no_grad():
            for name, g in zip(self.names, grads):
                if g is not None and s.auto_loss_scaling and g.dtype == torch.float16:
                    top = (g.abs() >= s.als_bin_edge * FLOAT16_MAX) | ~torch.isfinite(g)
                    self._als[0] += int(top.sum())
                    self._als[1] += g.numel()
                if d.type == "SGD" and d.use_combined_accum:
                    if g is not None:
                        st["touched"].add(name)
                        view = self._slice(st["accl"][name], name, replica)
                        view.copy_(view.float() + g.float() * st["factor"][name][1])
                    continue
                key = (replica, name)
                acc = st["acc"].get(key)
                if s.running and s.mean:
                    if g is None and acc is None:
                        continue
                    if acc is None:
                        dtype = d.accum_type if s.accumulation > 1 else g.dtype
                        acc = torch.zeros_like(g, dtype=dtype)
                        st["acc"][key] = acc
                    k = micro_batch  # one rounding per write: float32 arithmetic
                    mean = acc.float() * (k / (k + 1.0))
                    if g is not None:
                        mean = mean + g.float() * (1.0 / (k + 1.0))
                    acc.copy_(mean)
                elif g is not None:
                    if acc is None:
                        dtype = d.accum_type if s.accumulation > 1 else g.dtype
                        st["acc"][key] = g.to(dtype, copy=True) if dtype != g.dtype \
                            or s.accumulation > 1 else g
                    else:
                        acc.add_(g.to(acc.dtype))

    def _local_totals(self) -> List[Optional[torch.Tensor]]:
        """Per parameter, the sum of the local replicas' accumulators (into each
        group's slice for replica-grouped parameters), float32, still loss-scaled."""
        s, st = self.settings, self._step
        if s.replicas == 1 and not s.replica_groups:  # one accumulator per parameter
            out = []
            for name in self.names:
                acc = st["acc"].get((0, name))
                out.append(None if acc is None else acc.float())
            return out
        per_name: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
        for (replica, name), acc in st["acc"].items():
            per_name.setdefault(name, []).append((replica, acc))
        out = []
        for name, p in zip(self.names, self._params):
            items = sorted(per_name.get(name, []), key=lambda x: x[0])
            if not items:
                out.append(None)
                continue
            groups = s.replica_groups.get(name)
            if groups is None:
                total = items[0][1].clone() if len(items) > 1 else items[0][1]
                for _, acc in items[1:]:
                    total.add_(acc)
            else:
                total = torch.zeros_like(p, dtype=items[0][1].dtype)
                for replica, acc in items:
                    total[groups[replica]].add_(acc)
            out.append(total.float())
        return out

    def _sum_over_processes(self, tensors: List[Optional[torch.Tensor]],
                            names: Optional[List[str]] = None
                            ) -> List[Optional[torch.Tensor]]:
        """Sum this update's per-parameter totals (of ``names``, default all), and the
        automatic loss scaling statistics, over the processes of a multi-process run
        (docs/semantics.md S-28): one ``all_reduce`` per dtype; in a pipeline across processes, over
        the processes holding each parameter (:attr:`StepSettings.sharing`). ``None`` entries (no
        gradient) stay ``None``."""
        s, start = self.settings, self._step["als_start"]
        if s.sharing is None and s.all_reduce is None:
            return tensors
        stats = torch.tensor([self._als[0] - start[0], self._als[1] - start[1]],
                             dtype=torch.float64) if s.auto_loss_scaling else None
        if s.sharing is not None:
            stats = None if stats is None else s.sharing.sum_statistics(stats)
            out = s.sharing.sum(self.names if names is None else names, tensors)
        else:
            present = [i for i, t in enumerate(tensors) if t is not None]
            summed = s.all_reduce([tensors[i] for i in present] + ([] if stats is None
                                                                   else [stats]))
            stats = None if stats is None else summed.pop()
            out = list(tensors)
            for i, t in zip(present, summed):
                out[i] = t
        if stats is not None:
            self._als = [start[0] + int(stats[0]), start[1] + int(stats[1])]
        return out

    def _reduced_gradients(self) -> List[Optional[torch.Tensor]]:
        """Reduction over replicas (and processes) of the accumulators, unscaled, in
        float32."""
        s, st = self.settings, self._step
        divisor = s.global_replicas if (s.running and s.mean) else st["divisor"]
        factor = 1.0 / (st["scale"] * divisor)
        totals = self._sum_over_processes(self._local_totals())
        return [t if t is None or factor == 1.0 else t * factor for t in totals]

    def finish_step(self, params: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """Reduce, unscale, clip and apply the accumulated gradients; adjust the
        automatic loss scale.

        Returns:
            The gradient applied to each parameter (reduced and unscaled, before
            clipping, float32), ``None`` where a parameter received none.
        """
        d = self.description
        if self._step is None:
            self.begin_step()
        with torch.no_grad():
            if d.type == "SGD" and d.use_combined_accum:
                grads = self._finish_combined(params)
            else:
                grads = self._reduced_gradients()
                self.step(params, grads)
            self._adjust_loss_scale()
        self._step = None
        return grads

    def _clip_factor(self, grads: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        max_norm = self.description.max_grad_norm
        if math.isnan(max_norm):
            raise backend_error("Maximum norm of gradients cannot be NaN")
        if not math.isfinite(max_norm):
            return None
        norms = [None if g is None else torch.linalg.vector_norm(g.float()) for g in grads]
        if self.settings.sharing is not None:  # every stage's gradients count
            norms = self.settings.sharing.norms(norms)
        present = [n for n in norms if n is not None]
        if not present:
            return None
        norm = torch.linalg.vector_norm(torch.stack(present))
        return torch.where(norm > max_norm, max_norm / norm, torch.ones_like(norm))

    def _finish_combined(self, params: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """End of an update of the combined SGD variant: the velocity tensor already
        holds ``velocity_scaling × (momentum × v + dampening-scaled gradients)``."""
        d, st = self.description, self._step
        if self.settings.all_reduce is not None or self.settings.sharing is not None:
            # velocities move by the global sum
            touched = [name for name in self.names if name in st["touched"]]
            deltas = self._sum_over_processes(
                [st["accl"][name].float() - st["start"][name] for name in touched], touched)
            for name, delta in zip(touched, deltas):
                st["accl"][name].copy_(st["start"][name] + delta)
        grads: List[Optional[torch.Tensor]] = []
        for name in self.names:
            if name not in st["touched"]:
                grads.append(None)
                continue
            f, _ = st["factor"][name]
            vs = float(d.hyper(name).get("velocity_scaling", 1.0))
            delta = st["accl"][name].float() - st["start"][name]
            grads.append(delta / (vs * f) if f != 0 else torch.zeros_like(delta))
        clip = self._clip_factor(grads)
        for name, p in zip(self.names, params):
            if name not in st["touched"]:  # no gradient: not updated (like torch)
                continue
            h = d.hyper(name)
            f, _ = st["factor"][name]
            vs = float(h.get("velocity_scaling", 1.0))
            momentum, lr = float(h.get("momentum", 0.0)), float(h["lr"])
            wd = float(h.get("weight_decay", 0.0))
            buf = st["accl"][name]
            start = st["start"][name]
            acc = buf.float()
            if clip is not None:
                acc = start + (acc - start) * clip
            with float32_work([p]) as (w,):
                if wd:
                    acc = acc + (vs * f * wd) * w
                velocity = acc / vs
                if bool(h.get("nesterov", False)):
                    step = (acc - start) / vs + momentum * velocity
                else:
                    step = velocity
                w.sub_(step * lr)
            buf.copy_(acc * momentum)
            if momentum != 0.0:
                self._started_names.add(name)
        if clip is not None:
            grads = [None if g is None else g * clip for g in grads]
        return grads

    def _adjust_loss_scale(self) -> None:
        """docs/semantics.md S-57 rule, every ``als_update_period`` updates: halve the factor if the
        proportion of float16 gradient elements at or above ``als_bin_edge × 65504``
        (or non-finite) exceeds ``als_threshold``, else double it; the effective scale
        stays within ``[2^-14, 65504]``. float32 gradients are not looked at; without
        float16 gradients the factor does not change."""
        s = self.settings
        factor = self.state.get("lossScaleUpdateFactor")
        if factor is None:
            return
        self._updates += 1
        if self._updates % max(1, s.als_update_period):
            return
        upper, total = self._als
        self._als = [0, 0]
        if total == 0:
            return
        scale = float(self.description.loss_scaling)
        value = float(factor)
        if upper / total > s.als_threshold:
            if scale * value / 2 >= _FLOAT16_MIN_NORMAL:
                value /= 2
        elif scale * value * 2 <= FLOAT16_MAX:
            value *= 2
        factor.fill_(value)
