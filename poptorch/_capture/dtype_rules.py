"""PopTorch's operand dtype rules where PyTorch's differ, applied while ``forward`` is
captured (docs/semantics.md S-45, S-47).

* **Master-weight mixed precision** (docs/semantics.md S-45): ``linear``, the ``matmul`` family and
  convolutions whose activation and weight have different floating-point dtypes
  compute in the activation's dtype. The weight (and bias) are cast inside the captured
  graph, so the output has the activation's dtype and autograd brings the gradients
  back to the weights in their own dtype ("float32 master weights, float16 compute").
  Element-wise ops keep PyTorch's type promotion.
* **Legacy ``torch.uint8`` masks**: ``masked_fill``, ``masked_scatter``, ``index_put``
  and indexing take a ``uint8`` mask as a boolean mask, as PopTorch did, with a
  one-time deprecation warning.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Tuple

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["DtypeRulesMode", "WEIGHTED_OPS"]

_MIXED = (torch.float16, torch.float32)

#: Weighted op → (its argument names in order, the activation's name). The other
#: tensor arguments are cast to the activation's dtype when the dtypes differ.
WEIGHTED_OPS: Dict[Any, Tuple[Tuple[str, ...], str]] = {}
for _fn in (torch.nn.functional.linear,):
    WEIGHTED_OPS[_fn] = (("input", "weight", "bias"), "input")
for _fn in (torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d,
            torch.conv_transpose2d, torch.conv_transpose3d):
    WEIGHTED_OPS[_fn] = (("input", "weight", "bias"), "input")
for _fn in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
            torch.Tensor.mm, torch.bmm, torch.Tensor.bmm):
    WEIGHTED_OPS[_fn] = (("input", "other"), "input")
for _fn in (torch.addmm, torch.Tensor.addmm):
    WEIGHTED_OPS[_fn] = (("input", "mat1", "mat2"), "mat1")
for _fn in (torch.baddbmm, torch.Tensor.baddbmm):
    WEIGHTED_OPS[_fn] = (("input", "batch1", "batch2"), "batch1")

#: Ops taking a mask or indices (argument position) that may be a legacy uint8 mask.
_MASK_ARGS = {
    torch.masked_fill: 1, torch.Tensor.masked_fill: 1, torch.Tensor.masked_fill_: 1,
    torch.masked_scatter: 1, torch.Tensor.masked_scatter: 1,
    torch.Tensor.masked_scatter_: 1, torch.index_put: 1, torch.Tensor.index_put: 1,
    torch.Tensor.index_put_: 1, torch.Tensor.__getitem__: 1, torch.Tensor.__setitem__: 1,
}

_warned_uint8 = [False]


def _cast_weights(func, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    names, activation_name = WEIGHTED_OPS[func]
    values = dict(zip(names, args))
    values.update((k, v) for k, v in kwargs.items() if k in names)
    activation = values.get(activation_name)
    if not isinstance(activation, torch.Tensor) or activation.dtype not in _MIXED:
        return args, kwargs

    def cast(value):
        if isinstance(value, torch.Tensor) and value.dtype in _MIXED \
                and value.dtype != activation.dtype:
            return value.to(activation.dtype)
        return value
    args = tuple(cast(a) for a in args)
    kwargs = {k: cast(v) if k in names else v for k, v in kwargs.items()}
    return args, kwargs


def _as_bool_mask(value):
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
        if not _warned_uint8[0]:
            _warned_uint8[0] = True
            warnings.warn(
                "A torch.uint8 mask is deprecated: PopTorch treats it as a torch.bool mask. "
                "Convert it with mask.bool() (or compare, e.g. mask != 0).", UserWarning)
        return value.bool()
    if isinstance(value, (tuple, list)):
        return type(value)(_as_bool_mask(v) for v in value)
    return value


class DtypeRulesMode(TorchFunctionMode):
    """Applies the rules of this module to the torch functions called inside it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in WEIGHTED_OPS:
            args, kwargs = _cast_weights(func, tuple(args), kwargs)
        position = _MASK_ARGS.get(func)
        if position is not None and len(args) > position:
            args = tuple(args[:position]) + (_as_bool_mask(args[position]),) + \
                tuple(args[position + 1:])
        for key in ("mask", "indices"):
            if key in kwargs and position is not None:
                kwargs = {**kwargs, key: _as_bool_mask(kwargs[key])}
        return func(*args, **kwargs)
