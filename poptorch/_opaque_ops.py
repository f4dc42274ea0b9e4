"""Opaque ops: PyTorch functions whose result has a static shape although an ATen
kernel inside them computes a buffer whose shape depends on tensor values.

``torch.export`` runs every ATen kernel on fake tensors (shapes, no values). A few
composite ops reach a kernel tagged ``dynamic_output_shape`` for an *internal* buffer:
``aten::ctc_loss`` calls ``aten::_ctc_loss``, whose ``log_alpha`` buffer is
``[N, T, 2 * max(target_lengths) + 1]``, although the loss itself is ``[N]`` or a scalar.
Such a function cannot be traced op by op, yet its output is as static as any other.

During capture each such function is recorded as ONE graph node instead: a
``torch.library`` op ``poptorch::<name>.<overload>`` that mirrors the schema of the ATen
composite, runs PyTorch's own kernel when the graph executes, declares its output
shape to the tracer (its fake kernel) and differentiates by running the ATen op again
under autograd (so the IPU Model's results and gradients are PyTorch's). Adding an op
of this kind takes one :data:`_OPAQUE` entry: the public attribute that reaches it, the
ATen overload packet and the output declaration.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch

__all__ = ["opaque_functions", "OPAQUE_OPS"]

_LIB = torch.library.Library("poptorch", "FRAGMENT")  # noqa: TOR901


def _ctc_loss_output(log_probs: torch.Tensor, targets, input_lengths, target_lengths,
                     blank: int = 0, reduction: int = 1, zero_infinity: bool = False):
    """``aten::ctc_loss``: ``[N]`` for ``reduction="none"`` of a batched input, else a
    scalar; the dtype of ``log_probs``."""
    batched = log_probs.dim() == 3
    return log_probs.new_empty((log_probs.shape[1],) if reduction == 0 and batched else ())


@dataclasses.dataclass(frozen=True)
class _Opaque:
    """One function recorded as an opaque op.

    Attributes:
        owner / attribute: where PyTorch's Python code looks the function up
            (``torch.ctc_loss``: ``F.ctc_loss`` and ``nn.CTCLoss`` call it).
        aten: the ATen overload packet it dispatches to; every overload is mirrored.
        output: fake kernel: the overload's arguments → an empty tensor (or tuple) of
            the output's shape and dtype.
    """
    owner: Any
    attribute: str
    aten: torch._ops.OpOverloadPacket
    output: Callable[..., Any]


_OPAQUE: Tuple[_Opaque, ...] = (
    _Opaque(torch, "ctc_loss", torch.ops.aten.ctc_loss, _ctc_loss_output),
)


def _save_inputs(ctx, inputs: Tuple[Any, ...], output: Any) -> None:
    ctx.is_tensor = [isinstance(x, torch.Tensor) for x in inputs]
    ctx.others = [x for x in inputs if not isinstance(x, torch.Tensor)]
    ctx.save_for_backward(*[x for x in inputs if isinstance(x, torch.Tensor)])


def _recompute_backward(aten_op: torch._ops.OpOverload) -> Callable:
    """Backward of an opaque op: run the ATen op again under autograd and take the
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
            outputs = aten_op(*inputs)
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


def _mirror(entry: _Opaque) -> torch._ops.OpOverloadPacket:
    """Define ``poptorch::<name>.<overload>`` for every overload of ``entry.aten``."""
    name = entry.aten._qualified_op_name.split("::", 1)[1]
    for overload in entry.aten.overloads():
        aten_op = getattr(entry.aten, overload)
        schema = str(aten_op._schema).split("::", 1)[1]
        _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
        local = name if overload == "default" else f"{name}.{overload}"
        _LIB.impl(local, aten_op, "CompositeExplicitAutograd")
        torch.library.register_fake(f"poptorch::{local}", entry.output, lib=_LIB)
        torch.library.register_autograd(f"poptorch::{local}", _recompute_backward(aten_op),
                                        setup_context=_save_inputs, lib=_LIB)
    return getattr(torch.ops.poptorch, name)


#: ATen overload packet → its opaque mirror in the ``poptorch`` namespace.
OPAQUE_OPS: Dict[torch._ops.OpOverloadPacket, torch._ops.OpOverloadPacket] = {
    entry.aten: _mirror(entry) for entry in _OPAQUE}


def _redirect(mirror: torch._ops.OpOverloadPacket) -> Callable:
    def call(*args, **kwargs):
        return mirror(*args, **kwargs)
    return call


@contextlib.contextmanager
def opaque_functions() -> Iterator[Sequence[str]]:
    """While capturing, route every :data:`_OPAQUE` function to its opaque op.

    The mirrors compute exactly what the ATen ops compute, also eagerly, so code that
    runs outside the capture meanwhile (another thread) gets the same values.

    Yields:
        The qualified names of the redirected functions.
    """
    saved = []
    for entry in _OPAQUE:
        saved.append((entry, getattr(entry.owner, entry.attribute)))
        setattr(entry.owner, entry.attribute, _redirect(OPAQUE_OPS[entry.aten]))
    try:
        yield [f"{entry.owner.__name__}.{entry.attribute}" for entry in _OPAQUE]
    finally:
        for entry, original in saved:
            setattr(entry.owner, entry.attribute, original)
