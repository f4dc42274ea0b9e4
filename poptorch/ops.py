"""Device-side ops usable inside a wrapped model's ``forward`` (docs/api-sections.md api §8).

This module holds the loss marker and the control-flow ops; the other ops live in
modules of ``poptorch/_ops/`` and are re-exported here: ``compiler_hints``
(checkpoints, serialised matmul, memory and overlap hints), ``host``
(``ipu_print_tensor``, ``CPU``), ``custom`` (the custom-op registry),
``dynamic_slicing``, ``search`` (CTC beam search, ``fps``, ``nearest``) and ``scopes``
(``NameScope``, ``Attribute``, ``MultiConv``). Their ``torch.library`` definitions are
in ``library``.
"""
from __future__ import annotations

from typing import Callable, List

import torch

from popart_compiler.errors import py_error

from poptorch._ops import library
from poptorch._ops.compiler_hints import (recomputationCheckpoint, serializedMatMul,
                              set_available_memory, set_overlap_for_input,
                              set_overlap_for_output)
from poptorch._ops.custom import custom_op, register_custom_op, unregister_custom_op
from poptorch._ops.dynamic_slicing import dynamic_slice, dynamic_update
from poptorch._ops.host import CPU, ipu_print_tensor
from poptorch._impl import capturing_training, isRunningOnIpu
from poptorch._ops.scopes import Attribute, MultiConv, NameScope
from poptorch._ops.search import ctc_beam_search_decoder, fps, nearest

__all__ = ["identity_loss", "cond", "for_loop", "nop", "recomputationCheckpoint",
           "serializedMatMul", "set_available_memory", "set_overlap_for_input",
           "set_overlap_for_output", "custom_op", "dynamic_slice", "dynamic_update", "CPU",
           "ipu_print_tensor", "Attribute", "MultiConv", "NameScope",
           "ctc_beam_search_decoder", "fps", "nearest"]

#: Not star-exported (not PopTorch names): ``poptorch.ops.register_custom_op``.
_REGISTRY_FUNCTIONS = (register_custom_op, unregister_custom_op)

_REDUCTIONS = {"sum": 0, "mean": 1, "none": 2}


@torch.library.custom_op("poptorch::identity_loss", mutates_args=())
def _identity_loss(x: torch.Tensor, reduction: int) -> torch.Tensor:
    if reduction == 0:
        return x.sum()
    if reduction == 1:
        return x.mean()
    return x.clone()


@_identity_loss.register_fake
def _identity_loss_fake(x, reduction):
    return x.new_empty(()) if reduction < 2 else torch.empty_like(x)


def _identity_loss_setup(ctx, inputs, output):
    x, reduction = inputs
    ctx.shape, ctx.reduction, ctx.numel = x.shape, reduction, x.numel()


def _identity_loss_backward(ctx, grad):
    if ctx.reduction == 0:
        return grad.expand(ctx.shape), None
    if ctx.reduction == 1:
        return (grad / ctx.numel).expand(ctx.shape), None
    return grad, None


_identity_loss.register_autograd(_identity_loss_backward, setup_context=_identity_loss_setup)


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark ``x`` as (part of) the loss to back-propagate from (docs/semantics.md S-40, S-42).

    Args:
        x: any tensor.
        reduction: ``"sum"`` (sum of all elements, 0-d), ``"mean"`` (mean, 0-d) or
            ``"none"`` (``x`` unchanged, a copy).

    Returns:
        The reduced tensor, dtype of ``x``. Outside a wrapped model the same arithmetic
        is done on the CPU, as in PopTorch.

    Raises:
        AssertionError: "Unsupported reduction type!" for any other ``reduction``.
    """
    if reduction not in _REDUCTIONS:
        raise AssertionError("Unsupported reduction type!")
    return _identity_loss(x, _REDUCTIONS[reduction])


def _as_list(value) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return list(value)


def cond(condition: torch.Tensor, then_body: Callable, then_inps: List[torch.Tensor],
         else_body: Callable, else_inps: List[torch.Tensor]) -> List[torch.Tensor]:
    """On-device if/else (docs/api-sections.md api §8.4), captured with ``torch.cond``.

    Args:
        condition: single-element boolean tensor.
        then_body / else_body: callables returning a tensor or a list of tensors; both
            must return the same number of tensors with the same shapes and dtypes.
        then_inps / else_inps: lists of tensors passed to the bodies (as copies).

    Returns:
        A list with the outputs of the selected body.

    Raises:
        ValueError: ``then_inps`` or ``else_inps`` is not a list.
        poptorch.Error: used in a training model ("poptorch.cond() is only supported in
            inference."); a branch torch.compile cannot capture (outputs differing
            between the branches, host ops such as ``ipu_print_tensor`` inside a branch).
    """
    if not isinstance(then_inps, list):
        raise ValueError("poptorch.cond: then_inps must be a list of tensors "
                         "(Object is not list)")
    if not isinstance(else_inps, list):
        raise ValueError("poptorch.cond: else_inps must be a list of tensors "
                         "(Object is not list)")
    if not isRunningOnIpu():
        if bool(condition):
            return _as_list(then_body(*then_inps))
        return _as_list(else_body(*else_inps))
    if capturing_training():
        raise py_error("poptorch.cond() is only supported in inference.")
    n_then = len(then_inps)

    # Inputs behave as copies; outputs are fresh tensors (torch.cond forbids branch
    # outputs aliasing its operands or the enclosing scope's tensors).
    def true_fn(*operands):
        outs = _as_list(then_body(*[o.clone() for o in operands[:n_then]]))
        return tuple(o.clone() for o in outs)

    def false_fn(*operands):
        outs = _as_list(else_body(*[o.clone() for o in operands[n_then:]]))
        return tuple(o.clone() for o in outs)

    try:
        return list(torch.cond(condition.reshape(()).bool(), true_fn, false_fn,
                               tuple(then_inps) + tuple(else_inps)))
    except torch._dynamo.exc.UncapturedHigherOrderOpError as exc:
        reason = next((line.strip() for line in str(exc).splitlines()[1:] if line.strip()),
                      type(exc).__name__)
        raise py_error(
            f"poptorch.cond: a branch could not be captured ({reason}). The branches are "
            "traced with torch.compile: both must return the same number of tensors with "
            "the same shapes and dtypes, and they may only use traceable tensor code; call "
            "host ops (ipu_print_tensor, CPU, custom_op) outside the branches, on cond's "
            "inputs or outputs.") from exc


def _check_tensor_list(name: str, values) -> None:
    if not isinstance(values, list):
        raise ValueError(f"poptorch.{name}: inputs must be a list of tensors "
                         "(Object is not list)")
    for i, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"poptorch.{name}: inputs must be a list of tensors (Object "
                             f"contained in list at index {i} is not torch.tensor)")


def for_loop(count: int, body: Callable, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    """Run ``body`` ``count`` times on the device, each iteration's outputs feeding the
    next iteration's inputs (docs/api-sections.md api §8.3).

    The loop is unrolled into the captured graph (``count`` is a compile-time
    constant). ``body`` may use tensors of the enclosing scope and module parameters.

    Args:
        count: number of iterations (>= 0).
        body: takes as many tensors as it returns (a single tensor counts as a list of
            one).
        inputs: list of tensors, passed by value (cloned).

    Returns:
        A list with the last iteration's outputs. Outside a wrapped model ``body`` runs
        once, as PopTorch does on the CPU (docs/semantics.md S-4).

    Raises:
        ValueError: ``inputs`` not a list, or holding a non-tensor.
        poptorch.Error: used in a training model ("poptorch.for_loop() is only supported
            in inference."); ``body`` returning a different number of tensors than it
            takes.
    """
    _check_tensor_list("for_loop", inputs)
    if not isRunningOnIpu():
        return _as_list(body(*inputs))
    if capturing_training():
        raise py_error("poptorch.for_loop() is only supported in inference.")
    values = [t.clone() for t in inputs]
    for _ in range(int(count)):
        values = _as_list(body(*values))
        if len(values) != len(inputs):
            raise py_error(f"poptorch.for_loop: the body takes {len(inputs)} tensors but "
                           f"returned {len(values)}; it must return as many as it takes")
    return values


def nop(tensor: torch.Tensor) -> torch.Tensor:
    """Identity that the compiler never removes (a debugging aid, docs/api-sections.md api §8.5).

    Returns:
        A tensor equal to ``tensor`` (``tensor`` itself outside a wrapped model).

    Raises:
        poptorch.Error: ``tensor`` is not a tensor.
    """
    if not isinstance(tensor, (torch.Tensor, torch.fx.Proxy)):
        raise py_error(f"poptorch.nop takes a tensor, got {type(tensor).__name__}")
    if not isRunningOnIpu() and not isinstance(tensor, torch.fx.Proxy):
        return tensor
    return library.NOP(tensor)
