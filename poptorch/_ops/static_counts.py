"""``torch.bincount`` with ``minlength`` as a static-shape op on the IPU.

PyTorch's ``bincount`` returns ``max(minlength, x.max() + 1)`` bins: a size that depends
on the values, which a static graph cannot have. As PopTorch does, a model on the IPU
counts into exactly ``minlength`` bins (a scatter-add); values outside
``[0, minlength)`` are not counted. Without ``minlength`` the capture refuses the op
(:mod:`poptorch._capture.data_dependence` says to pass it).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["rewrite_for"]


def _bincount(x: torch.Tensor, weights: Optional[torch.Tensor] = None,
              minlength: int = 0) -> torch.Tensor:
    if weights is None:
        dtype = torch.int64
        weights = torch.ones_like(x, dtype=dtype)
    else:  # PyTorch's result dtype: float32 weights stay float32, others are double
        dtype = weights.dtype if weights.dtype == torch.float32 else torch.float64
        weights = weights.to(dtype)
    inside = (x >= 0) & (x < minlength)
    index = torch.where(inside, x, torch.zeros_like(x)).long()
    counted = torch.where(inside, weights, torch.zeros_like(weights))
    return torch.zeros(minlength, dtype=dtype, device=x.device).scatter_add(0, index, counted)


def _bincount_call(args, kwargs) -> Optional[Callable[[], Any]]:
    bound = dict(zip(("x", "weights", "minlength"), args))
    bound.update(kwargs)
    minlength = bound.get("minlength", 0)
    if not isinstance(minlength, int) or minlength <= 0:
        return None  # PyTorch's op: its data-dependent size is then reported
    return lambda: _bincount(bound["x"], bound.get("weights"), minlength)


_REWRITES = {torch.bincount: _bincount_call, torch.Tensor.bincount: _bincount_call}


def rewrite_for(func, args, kwargs) -> Optional[Callable[[], Any]]:
    """A thunk computing ``func(*args, **kwargs)`` with a static shape, or ``None``."""
    try:
        rewrite = _REWRITES.get(func)
    except TypeError:  # unhashable callable
        return None
    return rewrite(args, kwargs) if rewrite is not None else None
