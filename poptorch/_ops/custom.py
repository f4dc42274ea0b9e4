"""User custom ops (docs/api-sections.md api §8.12): a registry of Python implementations keyed by
PopART's ``(name, domain, domain_version)``.

On an IPU a custom op is a PopART shared library. Here the user registers a Python
implementation, and optionally its gradient, with :func:`register_custom_op`;
``poptorch.custom_op`` then inserts one ``poptorch::custom_op`` node (a
``torch.library`` op) in the captured graph, which calls the implementation with the
actual values at run time, once per micro-batch and replica.

Example::

    def gelu_impl(inputs, attributes):
        (x,) = inputs
        return [x * torch.sigmoid(attributes["alpha"] * x)]

    poptorch.ops.register_custom_op("Gelu", "custom.ops", 1, gelu_impl)

    class Model(torch.nn.Module):
        def forward(self, x):
            return poptorch.custom_op([x], "Gelu", "custom.ops", 1,
                                      example_outputs=[x], attributes={"alpha": 1.702})[0]
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from popart_compiler.errors import py_error
from poptorch._impl import isRunningOnIpu
from poptorch._ops import library as _ops_library
from poptorch._ops.host import check_outputs, empty_outputs, encode_outputs

__all__ = ["custom_op", "register_custom_op", "unregister_custom_op"]

Key = Tuple[str, str, int]


@dataclasses.dataclass(frozen=True)
class _Registered:
    implementation: Callable[[List[torch.Tensor], Dict[str, Any]], Any]
    gradient: Optional[Callable]


_REGISTRY: Dict[Key, _Registered] = {}


def register_custom_op(name: str, domain: str, domain_version: int,
                       implementation: Callable, gradient: Optional[Callable] = None
                       ) -> None:
    """Register the implementation of the custom op ``(name, domain, domain_version)``.

    Args:
        name / domain / domain_version: the PopART op identifier used by
            ``poptorch.custom_op``.
        implementation: ``implementation(inputs, attributes)`` with ``inputs`` a list of
            tensors (on the execution device) and ``attributes`` a dict of ``str`` to
            ``int``, ``float``, ``str`` or a list of one of those; returns a tensor or a
            list of tensors with the shapes and dtypes of the ``example_outputs``.
        gradient: optional ``gradient(inputs, grad_outputs, attributes)`` returning one
            gradient (or ``None``) per input. Without it, training differentiates
            ``implementation`` with PyTorch autograd.

    Registering an op again replaces its implementation (graphs already compiled call
    the new one).

    Raises:
        poptorch.Error: ``implementation`` or ``gradient`` is not callable.
    """
    if not callable(implementation) or (gradient is not None and not callable(gradient)):
        raise py_error("register_custom_op needs a callable implementation (and an "
                       "optional callable gradient)")
    _REGISTRY[(str(name), str(domain), int(domain_version))] = _Registered(
        implementation, gradient)


def unregister_custom_op(name: str, domain: str, domain_version: int) -> None:
    """Remove a registration made with :func:`register_custom_op` (no error if absent)."""
    _REGISTRY.pop((str(name), str(domain), int(domain_version)), None)


def _lookup(name: str, domain: str, domain_version: int) -> _Registered:
    found = _REGISTRY.get((name, domain, domain_version))
    if found is None:
        raise py_error(
            f"Custom op {name!r} (domain {domain!r}, version {domain_version}) is not "
            "registered. On the IPU Model a custom op is a Python function: call "
            f"poptorch.ops.register_custom_op({name!r}, {domain!r}, {domain_version}, "
            "implementation) before compiling the model, where implementation(inputs, "
            "attributes) returns the output tensors.")
    return found


def _what(name: str, domain: str, version: int) -> str:
    return f"Custom op {name!r} (domain {domain!r}, version {version})"


def _kernel(inputs: List[torch.Tensor], name: str, domain: str, domain_version: int,
            attributes: str, outputs: str) -> List[torch.Tensor]:
    entry = _lookup(name, domain, domain_version)
    device = inputs[0].device if inputs else torch.device("cpu")
    with torch.no_grad():
        result = entry.implementation(list(inputs), json.loads(attributes))
    return check_outputs(_what(name, domain, domain_version), result, outputs, device)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[0])
    ctx.key = (inputs[1], inputs[2], inputs[3])
    ctx.attributes = json.loads(inputs[4])


def _backward(ctx, grads):
    grads = list(grads)
    inputs = list(ctx.saved_tensors)
    entry = _lookup(*ctx.key)
    if entry.gradient is not None:
        result = list(entry.gradient(inputs, list(grads), ctx.attributes))
    else:
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        with torch.enable_grad():
            outs = entry.implementation(leaves, ctx.attributes)
            outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
            wrt = [t for t in leaves if t.requires_grad]
            pairs = [(o, g) for o, g in zip(outs, grads)
                     if g is not None and o.requires_grad]
            found = torch.autograd.grad([o for o, _ in pairs], wrt,
                                        [g for _, g in pairs], allow_unused=True) \
                if pairs and wrt else [None] * len(wrt)
        it = iter(found)
        result = [next(it) if t.requires_grad else None for t in leaves]
    if len(result) != len(inputs):
        raise py_error(f"The gradient of {_what(*ctx.key)} returned {len(result)} "
                       f"values for {len(inputs)} inputs")
    return result, None, None, None, None, None


_CUSTOM_OP = _ops_library.define(
    "custom_op(Tensor[] inputs, str name, str domain, int domain_version, "
    "str attributes, str outputs) -> Tensor[]", _kernel,
    lambda inputs, name, domain, version, attributes, outputs: empty_outputs(outputs,
                                                                               inputs),
    backward=_backward, setup_context=_setup, per_micro_batch=True)


def _check_ascii(text: str) -> None:
    if not text.isascii():
        raise ValueError(f"{text} contains non-ASCII characters.")


def _check_attributes(attributes: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Validate custom op attributes as PopTorch does (docs/api-sections.md api §8.12)."""
    if attributes is None:
        return {}
    out = {}
    for key, value in attributes.items():
        if not isinstance(key, str):
            raise ValueError("All attribute keys must be strings.")
        _check_ascii(key)
        if isinstance(value, (list, tuple)):
            kinds = {type(v) for v in value}
            if len(kinds) > 1:
                raise ValueError(f"Attribute {key}: the elements of a list or tuple "
                                 "attribute must all be the same.")
            if kinds and not kinds <= {int, float, str}:
                raise ValueError(f"Attribute {key}: list elements must be float, int or "
                                 f"str, not {next(iter(kinds)).__name__}")
            for v in value:
                if isinstance(v, str):
                    _check_ascii(v)
            out[key] = list(value)
        elif isinstance(value, (int, float, str)):
            if isinstance(value, str):
                _check_ascii(value)
            out[key] = value
        else:
            raise ValueError(f"Attribute {key}: unsupported value type "
                             f"{type(value).__name__} (use float, int, str or a "
                             "list/tuple of one of those)")
    return out


def custom_op(inputs: Sequence[torch.Tensor], name: str, domain: str,
              domain_version: int, example_outputs: Sequence[torch.Tensor],
              attributes: Optional[Dict[str, Any]] = None) -> List[torch.Tensor]:
    """Invoke the custom op ``(name, domain, domain_version)`` (docs/api-sections.md api §8.12).

    Args:
        inputs: tuple or list of tensors.
        name / domain / domain_version: the op's identifier (see
            :func:`register_custom_op`).
        example_outputs: tensors whose shapes and dtypes (not values) describe the
            outputs.
        attributes: ``str`` keys to ``float``, ``int``, ``str`` or a homogeneous
            list/tuple of one of those; the implementation receives them with those
            Python types (tuples as lists).

    Returns:
        One tensor per example output. Outside a wrapped model: zero tensors shaped like
        ``example_outputs`` (docs/semantics.md S-4).

    Raises:
        ValueError: attribute keys not strings, unsupported or mixed value types,
            non-ASCII text.
        poptorch.Error: (in a wrapped model) the op is not registered; at run time, an
            implementation returning other shapes or dtypes than declared.
    """
    attrs = _check_attributes(attributes)
    tensors = list(inputs)
    examples = list(example_outputs)
    if not isRunningOnIpu():
        return [torch.zeros_like(t) for t in examples]
    _lookup(str(name), str(domain), int(domain_version))
    return list(_CUSTOM_OP(tensors, str(name), str(domain), int(domain_version),
                           json.dumps(attrs), encode_outputs(examples)))
