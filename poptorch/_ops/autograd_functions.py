"""Custom ``torch.autograd.Function`` backward formulas, honoured in training.

``torch.export`` traces *through* ``MyFunction.apply``: the graph keeps the ops of
``forward`` and autograd later differentiates those, so a hand-written ``backward``
(surrogate gradients of spiking networks, straight-through estimators) would be
silently replaced by the gradient of ``forward`` — zero for a step function. PopTorch's
own autodiff did the same. Here, while a *training* model is captured, every call of
an ``autograd.Function`` subclass that defines its own ``backward`` (outside PyTorch's
own package) is recorded as ONE op, ``poptorch::autograd_function``:

* forward: the Function's ``forward`` runs with the actual values when the graph runs;
* backward: the Function's ``backward`` runs with the context its ``forward`` filled
  (``ctx.save_for_backward``, attributes), so gradients are exactly PyTorch's.

What cannot be honoured is refused with a ``poptorch.Error`` naming the Function: a
``forward`` that modifies an input in place (``ctx.mark_dirty``), returns something
other than tensors, or takes tensors inside containers / keyword arguments; a
``backward`` whose gradient cannot be shaped like its input (PyTorch's check: a
broadcast gradient is summed to the input's shape).
Inference captures still trace through ``forward`` (no backward is needed).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.autograd.function import _is_setup_context_defined
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from popart_compiler.errors import Error, py_error
from poptorch import _impl
from poptorch._ops import library
from poptorch._ops.host import empty_outputs, encode_outputs

__all__ = ["honoured_backwards", "take_captured"]

_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]  # the classmethod object
_BASE_BACKWARD = torch.autograd.function._SingleLevelFunction.backward


class _FunctionContext:
    """The ``ctx`` a Function's ``forward`` fills and its ``backward`` reads."""

    def __init__(self, needs_input_grad: Tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: Tuple[Any, ...] = ()
        self.materialize_grads = True
        self.non_differentiable: List[torch.Tensor] = []
        self.dirty = False

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tuple(tensors)

    def save_for_forward(self, *tensors) -> None:
        """Forward-mode AD is not used by training; accepted and ignored."""

    def mark_non_differentiable(self, *tensors) -> None:
        self.non_differentiable.extend(tensors)

    def mark_dirty(self, *tensors) -> None:
        self.dirty = True

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = bool(value)

    @property
    def saved_variables(self):
        return self.saved_tensors


class _Call:
    """One recorded call: the Function class and its non-tensor arguments."""

    def __init__(self, cls: type, template: List[Tuple[bool, Any]]):
        self.cls = cls
        self.template = template  # (is_tensor, constant) per positional argument

    @property
    def name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def arguments(self, tensors: Sequence[torch.Tensor]) -> List[Any]:
        it = iter(tensors)
        return [next(it) if is_tensor else value for is_tensor, value in self.template]

    def run_forward(self, tensors: Sequence[torch.Tensor]) -> Tuple[_FunctionContext, Any]:
        args = self.arguments(tensors)
        ctx = _FunctionContext(tuple(is_t and t.requires_grad for (is_t, _), t in
                                     zip(self.template, args)))
        with torch.no_grad():
            if _is_setup_context_defined(self.cls.setup_context):
                out = self.cls.forward(*args)
                self.cls.setup_context(ctx, tuple(args), out)
            else:
                out = self.cls.forward(ctx, *args)
        if ctx.dirty:
            raise py_error(f"The torch.autograd.Function {self.name} modifies its input in "
                           "place (ctx.mark_dirty): a training model cannot honour its "
                           "backward. Return a new tensor from forward instead.")
        return ctx, out


#: key -> _Call, weakly: an entry lives as long as the captured graph holding it.
_CALLS: "weakref.WeakValueDictionary[str, _Call]" = weakref.WeakValueDictionary()
_next_key = itertools.count()
_captured: List[_Call] = []
#: per thread: the context of the last forward run, picked up by setup_context
_last = threading.local()


def take_captured() -> List[_Call]:
    """Return and forget the calls recorded since the last call (one capture)."""
    taken = list(_captured)
    _captured.clear()
    return taken


def _outputs(call: _Call, out: Any) -> List[torch.Tensor]:
    values = list(out) if isinstance(out, (tuple, list)) else [out]
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        raise py_error(f"The torch.autograd.Function {call.name} returns "
                       f"{type(out).__name__}: a training model honours a custom backward "
                       "only for a forward that returns a tensor or a tuple of tensors.")
    return values


def _kernel(inputs: List[torch.Tensor], key: str, outputs: str) -> List[torch.Tensor]:
    call = _CALLS.get(key)
    if call is None:
        raise py_error(f"The torch.autograd.Function of op {key} no longer exists")
    ctx, out = call.run_forward(inputs)
    values = _outputs(call, out)
    # the op's outputs never alias its inputs (a forward may return an input as is)
    values = [v.clone() if any(v is i for i in inputs) else v for v in values]
    _last.entry = (key, ctx)
    return values


def _setup(ctx, inputs, output) -> None:
    tensors, key, _ = inputs
    call = _CALLS[key]
    last = getattr(_last, "entry", None)
    _last.entry = None
    if last is not None and last[0] == key:
        user_ctx = last[1]
    else:  # the kernel did not run here (fake tensors of a traced backward)
        user_ctx, _ = call.run_forward(tensors)
    user_ctx.needs_input_grad = tuple(
        is_t and t.requires_grad for (is_t, _), t in zip(call.template,
                                                         call.arguments(tensors)))
    ctx.user, ctx.call, ctx.outputs = user_ctx, call, [o.detach() for o in output]
    ctx.count = len(tensors)
    ctx.input_shapes = [t.shape for t in tensors]


def _backward(ctx, grads):
    call, user_ctx = ctx.call, ctx.user
    grads = list(grads)
    if user_ctx.materialize_grads:
        grads = [torch.zeros_like(o) if g is None else g for g, o in zip(grads, ctx.outputs)]
    result = call.cls.backward(user_ctx, *grads)
    result = list(result) if isinstance(result, (tuple, list)) else [result]
    per_tensor: List[Optional[torch.Tensor]] = []
    shapes = iter(ctx.input_shapes)
    for index, ((is_tensor, _), grad) in enumerate(
            itertools.zip_longest(call.template, result)):
        if is_tensor:
            per_tensor.append(_checked_grad(call, index, grad, next(shapes)))
    return per_tensor, None, None


def _checked_grad(call: _Call, index: int, grad: Optional[torch.Tensor],
                  shape: torch.Size) -> Optional[torch.Tensor]:
    """``grad`` for the input of ``shape`` at ``index`` of ``apply()``, as PyTorch
    checks a Function's gradients: a broadcast gradient is summed to ``shape``; one
    that ``shape`` cannot be expanded to is refused, naming the Function."""
    if grad is None or grad.shape == shape:
        return grad
    try:
        expandable = torch.broadcast_shapes(shape, grad.shape) == grad.shape
    except RuntimeError:
        expandable = False
    if expandable:
        return grad.sum_to_size(shape)
    raise py_error(f"The torch.autograd.Function {call.name} returned an invalid gradient "
                   f"at index {index} - got {list(grad.shape)} but expected shape "
                   f"compatible with {list(shape)}: its backward must return one "
                   "gradient per forward input, shaped like that input.")


_AUTOGRAD_FUNCTION = library.define(
    "autograd_function(Tensor[] inputs, str key, str outputs) -> Tensor[]", _kernel,
    lambda inputs, key, outputs: empty_outputs(outputs, inputs),
    backward=_backward, setup_context=_setup, per_micro_batch=True)


def _has_own_backward(cls: type) -> bool:
    return (cls.backward is not _BASE_BACKWARD
            and not cls.__module__.split(".")[0] == "torch")


def _example_outputs(call: _Call, tensors: Sequence[torch.Tensor]) -> Any:
    """The Function's outputs on the capture's tensors (shapes and dtypes only),
    without recording its ops in the graph."""
    with disable_proxy_modes_tracing():
        try:
            return call.run_forward(tensors)[1]
        except Error:  # a refusal (ctx.mark_dirty): final
            raise
        except Exception:  # noqa: BLE001 - a forward that reads values: run it on zeros
            with unset_fake_temporarily():
                # device given: the capture's device mode warns about factories without one
                zeros = [torch.zeros(tuple(t.shape), dtype=t.dtype, device=t.device)
                         for t in tensors]
                return call.run_forward(zeros)[1]


def _record(cls: type, args: Tuple[Any, ...], kwargs: dict):
    name = f"{cls.__module__}.{cls.__qualname__}"
    if kwargs or any(isinstance(a, (list, tuple, dict)) and any(
            isinstance(v, torch.Tensor) for v in (a.values() if isinstance(a, dict) else a))
            for a in args):
        raise py_error(f"The torch.autograd.Function {name} takes tensors inside a "
                       "container or as keyword arguments: a training model honours a "
                       "custom backward only when every tensor is a positional argument "
                       "of apply().")
    template = [(isinstance(a, torch.Tensor), None if isinstance(a, torch.Tensor) else a)
                for a in args]
    call = _Call(cls, template)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    raw = _example_outputs(call, tensors)
    example = _outputs(call, raw)
    key = f"{name}#{next(_next_key)}"
    _CALLS[key] = call
    _captured.append(call)
    outs = _AUTOGRAD_FUNCTION(tensors, key, encode_outputs(example))
    if isinstance(raw, torch.Tensor):
        return outs[0]
    return type(raw)(outs) if isinstance(raw, tuple) else list(outs)


def _apply(cls, *args, **kwargs):
    if _impl.capturing_training() and _has_own_backward(cls):
        return _record(cls, args, kwargs)
    return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)


@contextlib.contextmanager
def honoured_backwards() -> Iterator[None]:
    """While inside (a capture), route ``autograd.Function.apply`` through
    :func:`_apply`: in the capturing thread of a training model, Functions with their
    own ``backward`` become ``poptorch::autograd_function`` ops; every other call
    (other threads, inference captures) runs PyTorch's ``apply`` unchanged."""
    torch.autograd.Function.apply = classmethod(_apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = _ORIGINAL_APPLY
