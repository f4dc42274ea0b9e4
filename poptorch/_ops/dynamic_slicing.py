"""Slices at run-time offsets (docs/api-sections.md api §8.6, §8.7, docs/semantics.md S-102).

``dynamic_slice`` / ``dynamic_update`` take their start from an integer tensor, so one
compiled graph serves every offset. They are built from ``index_select`` /
``index_copy`` with an index tensor ``(start + arange(size)) % dim_size``: static
shapes, differentiable, and the device's modular wrap-around for windows that run
past the end of the dimension (docs/semantics.md S-102).

:class:`OffsetTracker` makes ``t[x:x + n]`` with a runtime tensor ``x`` and a constant
``n`` work while capturing: it remembers, for integer tensors built as ``x ± c``, their
base tensor and offset, and turns a slice whose bounds share a base into a
``dynamic_slice``.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from popart_compiler.errors import py_error
from poptorch._impl import isRunningOnIpu

__all__ = ["dynamic_slice", "dynamic_update", "OffsetTracker"]


def _window(tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int,
            step: int = 1) -> torch.Tensor:
    """Indices ``(start + arange(0, size, step)) % tensor.shape[dim]`` (int64)."""
    length = tensor.shape[dim]
    offsets = torch.arange(0, size, step, device=tensor.device)
    return (start.reshape(()).to(offsets.dtype) + offsets).remainder(length)


def _device_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the IPU holds ``dtype`` as (64-bit types are 32-bit on the device)."""
    return {torch.int64: torch.int32, torch.float64: torch.float32}.get(dtype, dtype)


def _check_common(tensor, dim, start, size) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise py_error(f"dynamic_slice/dynamic_update: the input must be a tensor, got "
                       f"{type(tensor).__name__}")
    if not isinstance(dim, int):
        raise py_error("Dimension must be an integer.")
    if not -tensor.dim() <= dim < max(tensor.dim(), 1):
        raise py_error(f"dynamic_slice/dynamic_update: dim {dim} is out of range for a "
                       f"tensor of shape {list(tensor.shape)}: use a dimension in "
                       f"[{-tensor.dim()}, {tensor.dim() - 1}]")
    if not isinstance(start, torch.Tensor):
        raise py_error("dynamic_slice/dynamic_update: start must be a tensor holding the "
                       f"runtime offset, got {type(start).__name__}")
    if not isinstance(size, int):
        raise py_error("dynamic_slice/dynamic_update: size must be an integer.")
    if size == 0:
        raise py_error("The start and end of a slice must be different.")
    if size < 0:
        raise py_error("Taking a slice of a tensor with the end less than the start is not "
                       f"supported. (size {size})")
    if start.is_floating_point() or start.is_complex() or start.dtype == torch.bool:
        raise py_error(f"dynamic_slice/dynamic_update: start must have an integer dtype, "
                       f"got {start.dtype}")
    if start.numel() != 1:
        raise py_error("dynamic_slice/dynamic_update: start must hold a single value, got "
                       f"shape {list(start.shape)}")


def dynamic_slice(tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int,
                  step: int) -> torch.Tensor:
    """Slice of ``tensor`` along ``dim`` starting at the run-time index ``start``
    (docs/api-sections.md api §8.6).

    Args:
        tensor: any tensor.
        dim: the sliced dimension.
        start: integer tensor with one element: the first index.
        size: positions covered (compile-time constant, > 0).
        step: keep every ``step``-th of them (>= 1).

    Returns:
        ``ceil(size / step)`` positions along ``dim``. In a wrapped model a window
        running past the end wraps to the start of the dimension (docs/semantics.md S-102); outside
        one, the ordinary slice ``[start:start + size:step]`` (docs/semantics.md S-4).

    Raises:
        poptorch.Error: a non-tensor ``tensor`` or ``start``, ``dim``/``size``/``step``
            not int, ``dim`` out of range, ``size == 0`` ("start and end of a slice
            must be different"), ``size < 0``, ``step < 1`` ("Slicing step must be at
            least 1"), a ``start`` without an integer dtype.
    """
    _check_common(tensor, dim, start, size)
    if not isinstance(step, int):
        raise py_error("dynamic_slice: step must be an integer.")
    if step < 1:
        raise py_error("Slicing step must be at least 1")
    if not isRunningOnIpu():
        first = int(start.reshape(()))
        index = [slice(None)] * tensor.dim()
        index[dim] = slice(first, first + size, step)
        return tensor[tuple(index)]
    if tensor.shape[dim] % size:
        raise py_error(f"The size of the slice ({size}) must be a factor of the slicing "
                       f"dimension ({tensor.shape[dim]}).")
    return tensor.index_select(dim, _window(tensor, dim, start, size, step))


def dynamic_update(input: torch.Tensor, src: torch.Tensor, dim: int,  # noqa: A002
                   start: torch.Tensor, size: int) -> torch.Tensor:
    """Copy of ``input`` whose ``size``-long window along ``dim`` starting at the
    run-time index ``start`` is replaced by ``src`` (docs/api-sections.md api §8.7). Not in place.

    Args:
        input: any tensor.
        src: the new window: ``input``'s shape with ``size`` along ``dim``, same dtype.
        dim: the updated dimension.
        start: integer tensor with one element.
        size: window length (compile-time constant, > 0).

    Returns:
        The updated copy. In a wrapped model the window wraps around the dimension
        (docs/semantics.md S-102); outside one, a slice-scatter.

    Raises:
        poptorch.Error: non-tensor ``input``/``src``/``start``; ``dim``/``size`` not int;
            ``dim`` out of range; "input and src tensors must have same
            dimensionality"; different dtypes; ``size <= 0``; in a wrapped model, a
            ``src`` whose shape is not the window's.
    """
    _check_common(input, dim, start, size)
    if not isinstance(src, torch.Tensor):
        raise py_error(f"dynamic_update: src must be a tensor, got {type(src).__name__}")
    if src.dim() != input.dim():
        raise py_error("input and src tensors must have same dimensionality. "
                       f"({input.dim()}) vs ({src.dim()})")
    if src.dtype != input.dtype:
        raise py_error("input and src tensor must have same dtype. "
                       f"({_device_dtype(input.dtype)} vs {_device_dtype(src.dtype)})")
    if not isRunningOnIpu():
        first = int(start.reshape(()))
        return input.slice_scatter(src, dim, first, first + size)
    window = list(input.shape)
    window[dim] = size
    if list(src.shape) != window:
        raise py_error(f"dynamic_update: src has shape {list(src.shape)}, but a window of "
                       f"size {size} along dim {dim} of an input of shape "
                       f"{list(input.shape)} has shape {window}: pass a src of that shape")
    return input.index_copy(dim, _window(input, dim, start, size), src)


class OffsetTracker:
    """Capture-time bookkeeping for ``t[x:x + n]`` (docs/semantics.md S-102).

    :meth:`record` is called with every op result: for ``x + c`` / ``x - c`` / ``c + x``
    on a 0-d or one-element integer tensor ``x`` with a Python int ``c`` it remembers
    ``(base of x, offset of x ± c)``, and which tensor each ``.item()`` value was read
    from. :meth:`rewrite_getitem` (``t[a:b]`` seen as such) and :meth:`rewrite_slice`
    (``aten.slice(t, dim, a.item(), b.item())``, what non-strict ``torch.export`` makes
    of ``t[a:b]``) turn a slice whose two bounds are tensors with the same base into a
    :func:`dynamic_slice` of size ``offset(b) - offset(a)``.
    """

    _ADD = {"__add__", "add", "__radd__", "__iadd__"}
    _SUB = {"__sub__", "sub", "__isub__"}

    def __init__(self) -> None:
        # id(tensor) -> (tensor, base, offset); the tensor is held so that its id is not
        # reused while the capture runs (one tracker per capture).
        self._affine: Dict[int, Tuple[torch.Tensor, torch.Tensor, int]] = {}
        # id(SymInt) -> (SymInt, tensor): values read with .item() from index tensors
        # (torch.export turns t[x:y] into x.item(), y.item() and aten.slice).
        self._items: Dict[int, Tuple[torch.SymInt, torch.Tensor]] = {}

    def _tensor_of(self, value):
        found = self._items.get(id(value))
        return found[1] if found is not None and found[0] is value else value

    def rewrite_slice(self, func, args) -> Optional[torch.Tensor]:
        """``aten.slice(t, dim, start, end, step)`` whose bounds were read from tracked
        index tensors, as a :func:`dynamic_slice`; ``None`` otherwise."""
        if func not in (torch.ops.aten.slice, torch.ops.aten.slice.Tensor) or len(args) < 4:
            return None
        start, stop = self._tensor_of(args[2]), self._tensor_of(args[3])
        if not (isinstance(start, torch.Tensor) and isinstance(stop, torch.Tensor)):
            return None  # not a run-time window: the capture's own checks apply
        step = args[4] if len(args) > 4 else 1
        return self._dynamic(args[0], args[1], slice(start, stop, step))

    def _base(self, t: torch.Tensor) -> Tuple[torch.Tensor, int]:
        found = self._affine.get(id(t))
        if found is None or found[0] is not t:
            return t, 0
        return found[1], found[2]

    def record(self, func, args, result) -> None:
        name = getattr(func, "__name__", "")
        if name == "item" and len(args) == 1 and _is_index_tensor(args[0]) and \
                isinstance(result, torch.SymInt):
            self._items[id(result)] = (result, args[0])
            return
        if name not in self._ADD and name not in self._SUB:
            return
        if len(args) != 2 or not isinstance(result, torch.Tensor):
            return
        a, b = args
        if isinstance(a, int) and isinstance(b, torch.Tensor):
            a, b = b, a
        if not (_is_index_tensor(a) and isinstance(b, int) and not isinstance(b, bool)):
            return
        base, offset = self._base(a)
        self._affine[id(result)] = (result, base,
                                    offset + (b if name in self._ADD else -b))

    def rewrite_getitem(self, tensor: torch.Tensor, index) -> Optional[torch.Tensor]:
        """``tensor[index]`` as dynamic slices, or ``None`` when ``index`` holds no
        slice with tensor bounds."""
        items = index if isinstance(index, tuple) else (index,)
        if not any(isinstance(i, slice) and _tensor_bound(i) for i in items) or any(
                isinstance(i, slice) and _tensor_bound(i) and not _tensor_bounds(i)
                for i in items):
            return None  # not a run-time window: the capture's own checks apply
        if any(i is Ellipsis for i in items):
            return None
        out, rest, dim = tensor, [], 0
        for item in items:
            if isinstance(item, slice) and _tensor_bound(item):
                out = self._dynamic(out, dim, item)
                rest.append(slice(None))
            else:
                rest.append(item)
            if item is not None:
                dim += 1
        return out[tuple(rest)]

    def _dynamic(self, tensor: torch.Tensor, dim: int, item: slice) -> torch.Tensor:
        start, stop, step = item.start, item.stop, item.step
        step = 1 if step is None else step
        (base_a, off_a), (base_b, off_b) = self._base(start), self._base(stop)
        if base_a is not base_b:
            raise py_error(
                "The size of the sliced tensor must be a constant for each execution of "
                "the model when running on the IPU. The bounds of a slice with run-time "
                "values must differ by a compile-time constant, as in t[x:x + 4] (S-102). Use "
                "poptorch.dynamic_slice(t, dim, start, size, step) with a constant size.")
        return dynamic_slice(tensor, dim, start, off_b - off_a, int(step))


def _is_index_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() == 1 and not t.is_floating_point() \
        and not t.is_complex() and t.dtype != torch.bool


def _tensor_bound(item: slice) -> bool:
    return isinstance(item.start, torch.Tensor) or isinstance(item.stop, torch.Tensor)


def _tensor_bounds(item: slice) -> bool:
    return isinstance(item.start, torch.Tensor) and isinstance(item.stop, torch.Tensor)
