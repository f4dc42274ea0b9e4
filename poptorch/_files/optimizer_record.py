"""An optimizer as JSON settings plus safetensors state, for exported training
executables (docs/api-sections.md api §2.3 step 6, docs/semantics.md S-62), rebuilt without
unpickling anything.

Only the optimizers PopTorch supports are stored: ``poptorch.optim`` SGD, Adam, AdamW,
RMSprop, LAMB and ``torch.optim`` SGD, Adam, AdamW, RMSprop. The record holds the class,
``defaults``, each param group's hyper-parameters with its parameters by name, the
PopTorch attributes (loss scaling, accumulation types, variable attributes, ...) and
the device optimizer state (``ipu_state`` / ``ipu_param``).
"""
from __future__ import annotations

import collections
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from popart_compiler.errors import Error, backend_error

from poptorch import optim
from poptorch._files.schema import Invalid
from poptorch._files.shapes import checked_tensors, decoded
from poptorch._files.container import encode, tensors_from_bytes, tensors_to_bytes

__all__ = ["device_state_of", "optimizer_record", "rebuild_optimizer",
           "restore_state"]

_CLASSES = {f"poptorch.optim.{c.__name__}": c for c in (
    optim.SGD, optim.Adam, optim.AdamW, optim.RMSprop, optim.LAMB)}
_CLASSES.update({f"torch.optim.{c.__name__}": c for c in (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop)})
_KEY_OF = {cls: key for key, cls in _CLASSES.items()}
#: PopTorch attributes restored on the rebuilt optimizer.
_ATTRIBUTES = optim.ATTRIBUTES
#: Largest finite float32: the device holds hyper-parameters as float32, as PopTorch.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
#: The parts of a stored optimizer state: device state and hyper-parameter tensors.
_STATE_PARTS = ("ipu_state", "ipu_param")


def device_state_of(optimizer: torch.optim.Optimizer, session: Any
                    ) -> Optional[Dict[str, torch.Tensor]]:
    """The device optimizer state (``ipu_state``) of a ``torch.optim`` optimizer,
    which has no host copy of it (momentum, Adam moments, step counts); ``None`` for
    ``poptorch.optim`` optimizers (their host copy is stored) or before compiling."""
    if isinstance(optimizer, optim.Optimizer) or session is None:
        return None
    return session.readOptimizerState()


def restore_state(binding: Any, session: Any, state_bytes: bytes,
                  offline: bool) -> None:
    """Write the device optimizer state a file stores (``optimizer.safetensors``, read
    by :func:`rebuild_optimizer`) to the compiled ``session`` of ``binding`` (the
    executor's optimizer binding), so that training continues exactly where it was
    saved.

    The stored ``ipu_state`` must name exactly the state tensors of the compiled
    optimizer, with their shapes; only a file compiled offline (``connectionType
    Never``, no device at save) may store none.

    Raises:
        Invalid: a missing, unknown or misshapen state tensor ("optimizer.safetensors:
            ..."), or one the device refuses.
    """
    tensors = tensors_from_bytes(state_bytes)
    parts = {part: {k.split("/", 1)[1]: v for k, v in tensors.items()
                    if k.startswith(part + "/")} for part in _STATE_PARTS}
    state = parts["ipu_state"]
    optimizer = binding.optimizer
    if session is None:  # uploaded when a device is attached
        if tensors and isinstance(optimizer, optim.Optimizer):
            optimizer.set_state_dict(parts)
        return
    if tensors or not offline:
        expected = session.readOptimizerState()
        missing = sorted(set(expected) - set(state))
        unknown = sorted(set(state) - set(expected))
        if missing or unknown:
            raise Invalid(f"optimizer.safetensors: {'missing' if missing else 'unknown'} "
                          f"optimizer state ipu_state/{(missing or unknown)[0]} (the "
                          f"compiled {type(optimizer).__name__} has "
                          f"{len(expected)} state tensors, the file {len(state)})")
        for name, value in sorted(state.items()):  # the first misfit by name
            if list(value.shape) != list(expected[name].shape):
                raise Invalid(f"optimizer.safetensors: optimizer state ipu_state/{name} "
                              f"has shape {list(value.shape)} but the compiled optimizer "
                              f"expects {list(expected[name].shape)}")
    if isinstance(optimizer, optim.Optimizer):
        if tensors:
            optimizer.set_state_dict(parts)
            binding.write_pending_state(session)
    elif state:
        session.checkOptimizerState(state)
        session.writeOptimizerState(state)


def optimizer_record(optimizer: torch.optim.Optimizer, param_names: Dict[int, str],
                     device_state: Optional[Dict[str, torch.Tensor]] = None
                     ) -> Tuple[Dict[str, Any], bytes]:
    """``(settings, state_bytes)`` describing ``optimizer``; its device state must
    already be synchronised to the host (``device_state``: that of a ``torch.optim``
    optimizer, see :func:`device_state_of`).

    Raises:
        poptorch.Error: an optimizer class that cannot be stored.
    """
    key = _KEY_OF.get(type(optimizer))
    if key is None:
        raise backend_error(f"Cannot export the optimizer: {type(optimizer).__qualname__} "
                            f"is not one of {sorted(_CLASSES)}.")
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"params": [param_names[id(p)] for p in group["params"]],
                       "hyper": encode(hyper, "the optimizer's param groups")})
    attributes = {a: optimizer.__dict__[a] for a in _ATTRIBUTES if a in optimizer.__dict__}
    settings = {"class": key, "defaults": encode(dict(optimizer.defaults), "defaults"),
                "groups": groups, "attributes": encode(attributes, "the optimizer")}
    tensors: Dict[str, torch.Tensor] = {}
    if isinstance(optimizer, optim.Optimizer) and optimizer.has_state():
        state = optimizer.get_state_dict()
        for part in _STATE_PARTS:
            for name, value in (state.get(part) or {}).items():
                tensors[f"{part}/{name}"] = value
    for name, value in (device_state or {}).items():
        tensors[f"ipu_state/{name}"] = value
    return settings, tensors_to_bytes(tensors)


def _check_float32(value: Any, where: str) -> None:
    """Raise ``Invalid`` for a finite number (or tuple of them) beyond float32's range."""
    for v in value if isinstance(value, tuple) else (value,):
        if type(v) in (int, float) and math.isfinite(v) and abs(v) > _FLOAT32_MAX:
            raise Invalid(f"{where} = {v!r} is out of float32 range (|x| <= "
                          f"{_FLOAT32_MAX:.6g}): the device holds hyper-parameters as "
                          "float32")


def _check_hyper(hyper: Any, reference: Dict[str, Any], where: str) -> None:
    """Hyper-parameters of the types the optimizer class uses: numbers, booleans,
    ``None`` (``foreach``, ``fused``) and tuples of numbers (``betas``); every
    hyper-parameter of the class present, its numbers finite and not negative."""
    def number(v: Any) -> bool:
        return type(v) in (int, float)

    if not isinstance(hyper, dict) or not all(isinstance(k, str) for k in hyper):
        raise Invalid(f"{where} must map names to values")
    for name, value in hyper.items():
        default = reference.get(name)
        if isinstance(default, bool) or default is None and name in reference:
            ok = value is None or isinstance(value, bool)
        elif isinstance(default, tuple):
            ok = isinstance(value, tuple) and len(value) == len(default) and \
                all(number(v) for v in value)
        else:  # numbers, and entries such as an LR scheduler's initial_lr
            ok = number(value) or value is None and name not in reference
        numbers = value if isinstance(value, tuple) else (value,)
        if ok and name in reference and not all(
                isinstance(v, bool) or v is None or 0 <= v < math.inf for v in numbers):
            ok = False  # torch.optim refuses negative (and NaN) rates, decays, ...
        if not ok:
            raise Invalid(f"{where}: {name} = {value!r} is not a valid value")
        _check_float32(value, f"{where}: {name}")
    missing = sorted(set(reference) - set(hyper))
    if missing:
        raise Invalid(f"{where}: the hyper-parameter {missing[0]!r} is missing")


def rebuild_optimizer(settings: Dict[str, Any], state_bytes: bytes,
                      params: Dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer :func:`optimizer_record` described, over ``params`` (by name);
    its device state is written by :func:`restore_state` once compiled. ``settings`` has the shape
    :data:`poptorch._files.shapes.OPTIMIZER`.

    Raises:
        Invalid: an unknown class or attribute, a parameter the model does not have,
            hyper-parameters the optimizer refuses, or a malformed state blob.
    """
    cls = _CLASSES.get(settings["class"])
    if cls is None:
        raise Invalid(f"metadata.json.optimizer: unknown optimizer class "
                      f"{settings['class']!r} (one of {sorted(_CLASSES)})")
    groups: List[Dict[str, Any]] = []
    hypers = [decoded(g["hyper"], f"metadata.json.optimizer.groups[{i}].hyper")
              for i, g in enumerate(settings["groups"])]
    defaults = decoded(settings["defaults"], "metadata.json.optimizer.defaults")
    attributes = decoded(settings["attributes"], "metadata.json.optimizer.attributes")
    reference = cls([torch.nn.Parameter(torch.zeros(1))], lr=0.1).defaults
    for i, hyper in enumerate(hypers + [defaults]):
        where = f"groups[{i}].hyper" if i < len(hypers) else "defaults"
        _check_hyper(hyper, reference, f"metadata.json.optimizer.{where}")
    if not isinstance(attributes, dict):
        raise Invalid("metadata.json.optimizer.attributes must map names to values")
    unknown = sorted(set(attributes) - set(_ATTRIBUTES))
    if unknown:
        raise Invalid(f"metadata.json.optimizer.attributes: unknown attribute "
                      f"{unknown[0]!r}")
    for name, value in attributes.items():
        _check_float32(value, f"metadata.json.optimizer.attributes: {name}")
    for group, hyper in zip(settings["groups"], hypers):
        missing = [n for n in group["params"] if n not in params]
        if missing:
            raise Invalid(f"metadata.json.optimizer: the optimizer refers to parameters "
                          f"{missing} that the model does not have")
        twice = sorted(n for n, k in collections.Counter(group["params"]).items() if k > 1)
        if twice:
            raise Invalid(f"metadata.json.optimizer: a param group lists {twice[0]!r} "
                          "more than once")
        groups.append({**hyper, "params": [params[n] for n in group["params"]]})
    unknown = sorted(n for n in checked_tensors(state_bytes, "optimizer.safetensors")
                     if n.split("/", 1)[0] not in _STATE_PARTS)
    if unknown:
        raise Invalid(f"optimizer.safetensors: unexpected tensor {unknown[0]!r} (not "
                      "ipu_state/... or ipu_param/...)")
    try:
        optimizer = cls(groups, lr=defaults.get("lr", groups[0].get("lr")))
        optimizer.defaults.clear()
        optimizer.defaults.update(defaults)
        for index, hyper in enumerate(hypers):
            optimizer.param_groups[index].update(hyper)
        for name, value in attributes.items():
            optimizer.__dict__[name] = value
    except Error as exc:
        raise Invalid(f"metadata.json.optimizer: {exc.message}") from None
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise Invalid(f"metadata.json.optimizer: {type(exc).__name__}: {exc}") from None
    return optimizer
