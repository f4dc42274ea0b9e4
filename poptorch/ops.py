"""Device-side ops usable inside a wrapped model's ``forward`` (spec api §8)."""
from __future__ import annotations

from typing import Callable, List

import torch

from popart_compiler.errors import py_error

from ._impl import capturing_training, isRunningOnIpu

__all__ = ["identity_loss", "cond"]

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
    """Mark ``x`` as (part of) the loss to back-propagate from (S-40, S-42).

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
    """On-device if/else (spec api §8.4), captured with ``torch.cond``.

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
            inference.").
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

    def true_fn(*operands):
        return tuple(_as_list(then_body(*[o.clone() for o in operands[:n_then]])))

    def false_fn(*operands):
        return tuple(_as_list(else_body(*[o.clone() for o in operands[n_then:]])))

    return list(torch.cond(condition.reshape(()).bool(), true_fn, false_fn,
                           tuple(then_inps) + tuple(else_inps)))
