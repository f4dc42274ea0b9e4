"""Hyper-parameter tensors by PopART name (``ipu_param`` of PopTorch's optimizer state
dict, docs/semantics.md S-56): read from the running description, and written back by
``optimizer.load_state_dict``.

PopART keeps each hyper-parameter as a tensor on the device (``learningRate___specific
___<param>``, SGD's ``scaledLearningRate0`` = ``lr × (1 − dampening) / lossScaling``,
``weightDecayScaleFactor0`` = ``1 − lr × (1 − dampening) × weight_decay``, ...). Values
written there are used by the following weight updates, until the host optimizer's
hyper-parameters change (``setOptimizer`` sends them again). Here a written value is
turned back into the description's hyper-parameter (a group of its own for a
parameter-specific value) so that the update really uses it, and is read back exactly
as written.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict

import torch

from popart_compiler.optim.description import OptimizerDescription

__all__ = ["LoadedParams", "derived_hyper_parameters", "with_written"]

#: PopART name → description key, for the Adam family, RMSprop and LAMB.
_ADAPTIVE = (("learningRate", "lr"), ("weightDecay", "weight_decay"), ("eps", "eps"))
#: More PopART hyper-parameters by optimizer type (PopART's Adaptive and Adam/LAMB).
_EXTRA = {"RMSprop": (("alpha", "alpha"), ("momentum", "momentum")),
          "LAMB": (("maxWeightNorm", "max_weight_norm"),)}
_LOSS_SCALING = "lossScaling_FLOAT"


def _suffix(kind: str, name: str) -> str:
    return f"___{kind}___{name}" if name else f"___{kind}___FLOAT"


def derived_hyper_parameters(d: OptimizerDescription, names) -> Dict[str, torch.Tensor]:
    """The PopART hyper-parameter tensors of description ``d`` (float32 scalars): the
    defaults' (``___default___FLOAT``) and each parameter's (``___specific___<name>``),
    and ``lossScaling_FLOAT``."""
    out: Dict[str, torch.Tensor] = {}
    scale = d.loss_scaling

    def put(suffix: str, h: Dict[str, Any]):
        lr = float(h.get("lr", 0.0))
        if d.type == "SGD":
            damp = float(h.get("dampening", 0.0))
            wd = float(h.get("weight_decay", 0.0))
            out["scaledLearningRate0" + suffix] = torch.tensor(lr * (1 - damp) / scale)
            out["weightDecayScaleFactor0" + suffix] = torch.tensor(1 - lr * (1 - damp) * wd)
            if "momentum" in h:
                out["momentum0" + suffix] = torch.tensor(float(h["momentum"]))
            if d.use_combined_accum:
                out["velocityScaling" + suffix] = torch.tensor(
                    float(h.get("velocity_scaling", 1.0)))
        else:
            out["learningRate" + suffix] = torch.tensor(lr)
            out["weightDecay" + suffix] = torch.tensor(float(h.get("weight_decay", 0.0)))
            if "eps" in h:
                out["eps" + suffix] = torch.tensor(float(h["eps"]))
            for popart, key in _EXTRA.get(d.type, ()):
                if key in h:
                    out[popart + suffix] = torch.tensor(float(h[key]))
            if "betas" in h:
                out["beta1" + suffix] = torch.tensor(float(h["betas"][0]))
                out["beta2" + suffix] = torch.tensor(float(h["betas"][1]))
    put(_suffix("default", ""), d.defaults)
    for name in names:
        put(_suffix("specific", name), d.hyper(name))
    out[_LOSS_SCALING] = torch.tensor(float(scale))
    return out


def _apply(d_type: str, h: Dict[str, Any], values: Dict[str, float], suffix: str,
           scale: float) -> bool:
    """Write the values named ``<popart name><suffix>`` into ``h``; whether any was."""
    found = False
    if d_type != "SGD":
        for popart, key in _ADAPTIVE + _EXTRA.get(d_type, ()):
            if popart + suffix in values:
                h[key], found = values[popart + suffix], True
        betas = list(h.get("betas", ()))
        for i, popart in enumerate(("beta1", "beta2")):
            if betas and popart + suffix in values:
                betas[i], found = values[popart + suffix], True
        if betas:
            h["betas"] = tuple(betas)
        return found
    if "momentum0" + suffix in values:
        h["momentum"], found = values["momentum0" + suffix], True
    if "velocityScaling" + suffix in values:
        h["velocity_scaling"], found = values["velocityScaling" + suffix], True
    keep = 1.0 - float(h.get("dampening", 0.0))
    if "scaledLearningRate0" + suffix in values and keep != 0.0:
        h["lr"], found = values["scaledLearningRate0" + suffix] * scale / keep, True
    step = float(h.get("lr", 0.0)) * keep
    if "weightDecayScaleFactor0" + suffix in values and step != 0.0:
        h["weight_decay"] = (1.0 - values["weightDecayScaleFactor0" + suffix]) / step
        found = True
    return found


def with_written(d: OptimizerDescription, names, values: Dict[str, float]
                 ) -> OptimizerDescription:
    """A copy of ``d`` whose hyper-parameters are the written PopART values: default
    values change the defaults, a parameter-specific one moves that parameter into a
    group of its own; ``lossScaling_FLOAT`` replaces the loss scaling."""
    scale = float(values.get(_LOSS_SCALING, d.loss_scaling))
    defaults = dict(d.defaults)
    default_written = _apply(d.type, defaults, values, _suffix("default", ""), scale)
    groups = [dict(g) for g in d.groups]
    group_of = dict(d.group_of)
    for name in names:
        index = group_of.get(name)
        h = dict(defaults if index is None else d.groups[index])
        if _apply(d.type, h, values, _suffix("specific", name), scale):
            group_of[name] = len(groups)
            groups.append(h)
    if not default_written and groups == d.groups and group_of == d.group_of and \
            scale == d.loss_scaling:
        return d
    return dataclasses.replace(d, defaults=defaults, groups=groups, group_of=group_of,
                               loss_scaling=scale)


class LoadedParams:
    """Mixin of :class:`~popart_compiler.optim.device_optimizer.DeviceOptimizer`: the
    ``ipu_param`` tensors. Uses ``description``, ``names``, ``_written`` (name → tensor
    written since the last ``update``) and ``_host_description`` (the description
    before they were written)."""

    def hyper_parameters(self) -> Dict[str, torch.Tensor]:
        """Hyper-parameter tensors by PopART name (``ipu_param``, docs/semantics.md
        S-56); written values are read back as written."""
        out = derived_hyper_parameters(self.description, self.names)
        out.update({k: v.clone() for k, v in self._written.items() if k in out})
        return out

    def write_hyper_parameters(self, params: Dict[str, torch.Tensor]) -> None:
        """Write hyper-parameter tensors by PopART name; the following updates use them
        until the next ``update`` (new host values). Unknown names are ignored, missing
        names keep their values.

        Raises:
            TypeError: a value is not a tensor with one element.
        """
        known = derived_hyper_parameters(self.description, self.names)
        for name, value in params.items():
            if name in known:
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    raise TypeError(f"Optimizer parameter {name} must be a tensor with one "
                                    f"element, got {value!r}")
                value = value.detach().to(torch.float32).reshape(())
                # The value read back (float32) of the running one: it stays exact.
                if name not in self._written and torch.equal(value, known[name]):
                    continue
                self._written[name] = value
        if self._host_description is None:
            self._host_description = self.description
        values = {k: float(v) for k, v in self._written.items()}
        self.description = with_written(self._host_description, self.names, values)

    def forget_written(self) -> None:
        """New host values replace the written ones (``setOptimizer``)."""
        self._written = {}
        self._host_description = None
