"""Opaque ops: PyTorch functions whose result has a static shape although an ATen
kernel inside them computes a buffer whose shape depends on tensor values.

``torch.export`` runs every ATen kernel on fake tensors (shapes, no values). A few
composite ops reach a kernel tagged ``dynamic_output_shape`` for an *internal* buffer:
``aten::ctc_loss`` calls ``aten::_ctc_loss``, whose ``log_alpha`` buffer is
``[N, T, 2 * max(target_lengths) + 1]``, although the loss itself is ``[N]`` or a scalar.
Such a function cannot be traced op by op, yet its output is as static as any other.

The same holds for Python functions of PyTorch that read tensor values only to
validate them (``F.gaussian_nll_loss`` checks ``torch.any(var < 0)``).

During capture each such function is recorded as ONE graph node instead: a
``torch.library`` op ``poptorch::<name>[.<overload>]`` that mirrors the schema of the
ATen composite (or declares the Python function's), runs PyTorch's own kernel when the
graph executes, declares its output shape to the tracer (its fake kernel) and
differentiates by running that kernel again under autograd, so the IPU Model's results
and gradients are PyTorch's. Adding a function of this kind takes one :data:`_OPAQUE`
entry: where it is looked up, the ATen packet or schema, and the output declaration.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = ["opaque_functions", "redirect_for", "OPAQUE_OPS"]

_LIB = torch.library.Library("poptorch", "FRAGMENT")  # noqa: TOR901


def _ctc_loss_output(log_probs: torch.Tensor, targets, input_lengths, target_lengths,
                     blank: int = 0, reduction: int = 1, zero_infinity: bool = False):
    """``aten::ctc_loss``: ``[N]`` for ``reduction="none"`` of a batched input, else a
    scalar; the dtype of ``log_probs``."""
    batched = log_probs.dim() == 3
    return log_probs.new_empty((log_probs.shape[1],) if reduction == 0 and batched else ())


def _combinations_output(x: torch.Tensor, r: int = 2, with_replacement: bool = False):
    """``aten::combinations``: ``[C(n, r), r]`` (``C(n + r - 1, r)`` with replacement)."""
    n = x.shape[0]
    if r == 0:
        return x.new_empty((0,))
    return x.new_empty((math.comb(n + r - 1 if with_replacement else n, r), r))


def _gaussian_nll_loss_output(input: torch.Tensor, target: torch.Tensor,  # noqa: A002
                              var: torch.Tensor, full: bool = False, eps: float = 1e-6,
                              reduction: str = "mean"):
    """``F.gaussian_nll_loss`` (which checks ``var >= 0`` by reading its values)."""
    if reduction != "none":
        return input.new_empty(())
    return input.new_empty(torch.broadcast_shapes(input.shape, target.shape))


@dataclasses.dataclass(frozen=True)
class _Opaque:
    """One function recorded as an opaque op.

    Attributes:
        owner / attribute: where PyTorch's Python code looks the function up
            (``torch.ctc_loss``: ``F.ctc_loss`` and ``nn.CTCLoss`` call it).
        output: fake kernel: the op's arguments → an empty tensor (or tuple) of the
            output's shape and dtype.
        aten: the ATen overload packet the function dispatches to (every overload is
            mirrored, with ATen's schema and kernel); or ``None`` for a Python function,
            mirrored with ``schema`` and the function itself as kernel.
        schema: the op's schema without its name (Python functions only).
        prepare: a call's ``(args, kwargs)`` → those of the opaque op, or ``None`` when
            this call goes to the function itself (default: unchanged).
    """
    owner: Any
    attribute: str
    output: Callable[..., Any]
    aten: Optional[torch._ops.OpOverloadPacket] = None
    schema: str = ""
    prepare: Callable[..., Any] = lambda *args, **kwargs: (args, kwargs)

    @property
    def name(self) -> str:
        if self.aten is not None:
            return self.aten._qualified_op_name.split("::", 1)[1]
        return self.attribute


_OPAQUE: Tuple[_Opaque, ...] = (
    _Opaque(torch, "ctc_loss", _ctc_loss_output, torch.ops.aten.ctc_loss),
    _Opaque(torch, "combinations", _combinations_output, torch.ops.aten.combinations),
    _Opaque(torch.nn.functional, "gaussian_nll_loss", _gaussian_nll_loss_output,
            schema="(Tensor input, Tensor target, Tensor var, bool full=False, "
                   "float eps=1e-06, str reduction=\"mean\") -> Tensor",
            prepare=lambda input, target, var, *args, **kwargs: (
                (input, target, var, *args), kwargs) if isinstance(var, torch.Tensor)
            else None),
)


def _save_inputs(ctx, inputs: Tuple[Any, ...], output: Any) -> None:
    ctx.is_tensor = [isinstance(x, torch.Tensor) for x in inputs]
    ctx.others = [x for x in inputs if not isinstance(x, torch.Tensor)]
    ctx.save_for_backward(*[x for x in inputs if isinstance(x, torch.Tensor)])


def _recompute_backward(kernel: Callable) -> Callable:
    """Backward of an opaque op: run its kernel again under autograd and take the
    vector-Jacobian product, so gradients are exactly PyTorch's."""

    def backward(ctx, *grads: torch.Tensor):
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        inputs: List[Any] = [next(tensors) if t else next(others) for t in ctx.is_tensor]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad) if need]
        result: List[Any] = [None] * len(inputs)
        if not wanted:
            return tuple(result)
        with torch.enable_grad():
            for i in wanted:
                inputs[i] = inputs[i].detach().requires_grad_()
            outputs = kernel(*inputs)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            found = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted],
                                        [g for _, g in pairs], allow_unused=True)
            for i, g in zip(wanted, found):
                result[i] = g
        return tuple(result)

    return backward


def _overloads(entry: _Opaque) -> List[Tuple[str, str, Callable]]:
    """(local name, schema with name, kernel) of each op to define for ``entry``."""
    if entry.aten is None:
        return [(entry.name, entry.name + entry.schema, getattr(entry.owner,
                                                                 entry.attribute))]
    found = []
    for overload in entry.aten.overloads():
        aten_op = getattr(entry.aten, overload)
        if aten_op._schema.is_mutable:
            continue  # out= variants
        local = entry.name if overload == "default" else f"{entry.name}.{overload}"
        found.append((local, str(aten_op._schema).split("::", 1)[1], aten_op))
    return found


def _mirror(entry: _Opaque) -> torch._ops.OpOverloadPacket:
    """Define ``poptorch::<name>[.<overload>]`` for ``entry``."""
    for local, schema, kernel in _overloads(entry):
        _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
        _LIB.impl(local, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"poptorch::{local}", entry.output, lib=_LIB)
        torch.library.register_autograd(f"poptorch::{local}", _recompute_backward(kernel),
                                        setup_context=_save_inputs, lib=_LIB)
    return getattr(torch.ops.poptorch, entry.name)


#: Opaque op of each entry, by the name of the function it replaces.
OPAQUE_OPS: Dict[str, torch._ops.OpOverloadPacket] = {
    f"{entry.owner.__name__}.{entry.attribute}": _mirror(entry) for entry in _OPAQUE}


def _redirect(entry: _Opaque, original: Callable) -> Callable:
    mirror = OPAQUE_OPS[f"{entry.owner.__name__}.{entry.attribute}"]

    @functools.wraps(original)
    def call(*args, **kwargs):
        prepared = entry.prepare(*args, **kwargs)
        if prepared is None:
            return original(*args, **kwargs)
        return mirror(*prepared[0], **prepared[1])
    return call


#: PyTorch's function → the function that routes its calls to the opaque op.
_REDIRECTS: Dict[Callable, Callable] = {
    getattr(entry.owner, entry.attribute): _redirect(entry, getattr(entry.owner,
                                                                    entry.attribute))
    for entry in _OPAQUE}


def redirect_for(func: Callable) -> Optional[Callable]:
    """The opaque routing of ``func`` if it is one of :data:`_OPAQUE`'s functions (for
    calls the capture sees directly, however the caller got hold of ``func``)."""
    try:
        return _REDIRECTS.get(func)
    except TypeError:  # unhashable callable
        return None


@contextlib.contextmanager
def opaque_functions() -> Iterator[Sequence[str]]:
    """While capturing, route every :data:`_OPAQUE` function to its opaque op where
    PyTorch's own Python code looks it up (``F.ctc_loss`` calls ``torch.ctc_loss``).

    The opaque ops compute exactly what the functions compute, also eagerly, so code
    that runs outside the capture meanwhile (another thread) gets the same values.

    Yields:
        The names of the redirected functions.
    """
    saved = [(entry, getattr(entry.owner, entry.attribute)) for entry in _OPAQUE]
    for entry, original in saved:
        setattr(entry.owner, entry.attribute, _REDIRECTS[original])
    try:
        yield list(OPAQUE_OPS)
    finally:
        for entry, original in saved:
            setattr(entry.owner, entry.attribute, original)
