"""Device placement inside ``forward`` while it is captured (docs/semantics.md S-3):
``device="ipu"`` / ``.to("ipu")`` / ``tensor.ipu()`` mean the execution device, values
read into Python are known only when computed from constants, and output shapes must
not depend on tensor values."""
from __future__ import annotations

import contextlib
import traceback
from typing import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.overrides import TorchFunctionMode

from popart_compiler.errors import Error
from poptorch._capture import data_dependence
from poptorch._capture.block_tags import tag_ops
from poptorch._capture.constants import VALUE_READS, constant_value, producing_op
from poptorch._logging import logger
from poptorch._ops import dynamic_slicing, opaque, static_counts

__all__ = ["IpuDeviceMode", "patch_tensor_ipu", "no_distribution_validation"]

_FACTORIES = {
    torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.linspace,
    torch.logspace, torch.rand, torch.randn, torch.randint, torch.randperm, torch.tensor,
    torch.full_like, torch.zeros_like, torch.ones_like, torch.empty_like, torch.rand_like,
    torch.randn_like, torch.randint_like, torch.normal, torch.eye,
}
_LIKE = {torch.full_like, torch.zeros_like, torch.ones_like, torch.empty_like,
         torch.rand_like, torch.randn_like, torch.randint_like}


def _is_ipu(device) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "ipu"
    return isinstance(device, torch.device) and device.type == "ipu"


class IpuDeviceMode(TorchFunctionMode):
    """Maps ``device="ipu"`` / ``.to("ipu")`` to the execution device and logs the
    "forcing to IPU" warning for factories called without a device (docs/semantics.md S-3).

    Args:
        device: the execution device (``"cpu"`` or ``"cuda"``) that ``"ipu"`` stands for.
    """

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)
        self.offsets = dynamic_slicing.OffsetTracker()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tag_ops()
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_ipu(kwargs["device"]):
            kwargs["device"] = self.device
        elif func in _FACTORIES and func not in _LIKE and "device" not in kwargs and not (
                func is torch.normal and any(isinstance(a, torch.Tensor) for a in args)):
            name = getattr(func, "__name__", str(func))
            logger.warning("No device set in torch.%s(): forcing to IPU", name)
        if func in (torch.Tensor.to, torch.Tensor.cuda) or getattr(func, "__name__", "") == "to":
            args = tuple(self.device if _is_ipu(a) else a for a in args)
        if getattr(func, "__name__", "") == "ipu":  # Tensor.ipu() does not exist in torch
            return args[0]
        # t[x:x + n] (docs/semantics.md S-102)
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            sliced = self.offsets.rewrite_getitem(*args)
            if sliced is not None:
                return sliced
        sliced = self.offsets.rewrite_slice(func, args)
        if sliced is not None:
            return sliced
        if func in VALUE_READS:
            result = _read_value(func, args, kwargs)
            self.offsets.record(func, args, result)
            return result
        static = static_counts.rewrite_for(func, args, kwargs)
        if static is not None:
            return static()
        func = opaque.redirect_for(func) or func
        try:
            result = func(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, Error) or not data_dependence.is_data_dependent(exc):
                raise
            raise data_dependence.op_error(func, exc) from None
        _check_static_shape(result, func)
        self.offsets.record(func, args, result)
        return result


def _read_value(func, args, kwargs):
    """A tensor's value handed to Python: known at capture if it is computed from
    constants only; otherwise a data-dependence error naming the read."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    values = [constant_value(t) for t in tensors]
    if tensors and all(v is not None for v in values):
        real = iter(values)
        args = tuple(next(real) if isinstance(a, torch.Tensor) else a for a in args)
        with unset_fake_temporarily(), disable_proxy_modes_tracing():
            return func(*args, **kwargs)
    try:
        return func(*args, **kwargs)
    except Exception as exc:
        # A fake tensor has no storage for .numpy() to share: its value is unknown too.
        if data_dependence.is_data_dependent(exc) or func is torch.Tensor.numpy:
            raise data_dependence.read_error(
                VALUE_READS[func], traceback.extract_stack()[:-1]) from None
        raise


def _check_static_shape(result, func) -> None:
    """The IPU's graphs are static: an op whose output shape depends on tensor values
    (boolean-mask indexing, ``nonzero``, ``unique``, ...) cannot be captured."""
    values = result if isinstance(result, (tuple, list)) else (result,)
    for value in values:
        if isinstance(value, torch.Tensor) and not all(isinstance(d, int)
                                                       for d in value.shape):
            name = data_dependence.function_name(func)
            aten = producing_op(value)
            raise data_dependence.shape_error(f"{name} ({aten})" if aten else name,
                                               traceback.extract_stack()[:-1])


def patch_tensor_ipu() -> Callable[[], None]:
    """Give tensors an ``.ipu()`` method during capture (PopTorch programs use it).
    Returns the undo function."""
    had = hasattr(torch.Tensor, "ipu")
    if not had:
        torch.Tensor.ipu = lambda self, *a, **k: self  # type: ignore[attr-defined]

    def undo():
        if not had:
            del torch.Tensor.ipu
    return undo


@contextlib.contextmanager
def no_distribution_validation() -> Iterator[None]:
    """``torch.distributions`` argument validation is off during capture (docs/semantics.md S-3)."""
    previous = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(previous)
