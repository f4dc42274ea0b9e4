"""Ops that do host work while the device runs: ``ipu_print_tensor``
(docs/api-sections.md api §8.2)
and ``CPU`` (docs/api-sections.md api §8.13).

Both are ``torch.library`` ops registered to run once per micro-batch and replica
(:func:`popart_compiler.ir.register_per_micro_batch_op`): their kernels execute when
the compiled graph runs, with the actual values, never at capture.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import weakref
from typing import Any, Callable, List, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from popart_compiler.errors import py_error
from poptorch._impl import isRunningOnIpu
from poptorch._ops import library
from poptorch._ops.print_format import PrintFormat, format_tensor, make_format

__all__ = ["ipu_print_tensor", "CPU"]


# -- ipu_print_tensor ----------------------------------------------------------------

def _print(x: torch.Tensor, title: str, print_gradient: bool, fmt: str) -> None:
    text = format_tensor(x, PrintFormat(**json.loads(fmt)))
    sys.stderr.write(f"{title}: {text}\n")
    sys.stderr.flush()


def _print_backward(ctx, grad):
    title, print_gradient, fmt = ctx.attributes
    if print_gradient:
        _print(grad, f"{title}_gradient", print_gradient, fmt)
    return grad, None, None, None


_PRINT = library.define_identity(
    "ipu_print_tensor(Tensor x, str title, bool print_gradient, str format) -> Tensor",
    side_effect=_print, backward=_print_backward, per_micro_batch=True)


def ipu_print_tensor(tensor: torch.Tensor, title: str = "", print_gradient: bool = True,
                     summarise_threshold: int = 1000, edge_items: int = 3,
                     max_line_width: int = 80, digits: int = 4, float_format: str = "auto",
                     separator: str = ", ", open_bracket: str = "(",
                     close_bracket: str = ")") -> torch.Tensor:
    """Print ``tensor`` to stderr as ``<title>: <formatted tensor>`` each time the
    device runs the op: once per micro-batch and replica (docs/api-sections.md api §8.2).

    In a training model with ``print_gradient`` the gradient flowing back through the op
    is printed too, titled ``<title>_gradient``. The returned tensor must be used
    downstream, or the op may be optimised away.

    Args:
        tensor: any tensor.
        title: printed before the value.
        print_gradient: also print the gradient in training.
        summarise_threshold: above this many elements show ``edge_items`` per edge of
            every dimension and an ellipsis (0 disables).
        edge_items: items per edge when summarising (0: the ellipsis alone).
        max_line_width: wrap longer rows, continuing two columns past the row's
            bracket (0 disables).
        digits: significant digits of a float, the exponent excluded (``digits=8``:
            ``1.4962566``); all values are right-aligned to one width. 0 disables the
            analysis: each value in ``%g`` format, unaligned.
        float_format: ``"auto"``, ``"fixed"``, ``"scientific"`` or ``"none"`` (each
            value formatted on its own), as Poplar's ``PrintTensorFmt``.
        separator / open_bracket / close_bracket: layout strings, used as given.

    Returns:
        A tensor equal to ``tensor``. Outside a wrapped model: ``tensor`` itself, and
        nothing is printed (docs/semantics.md S-4).

    Raises:
        poptorch.Error: ``tensor`` is not a tensor; a count (``summarise_threshold``,
            ``edge_items``, ``max_line_width``, ``digits``) that is not an int >= 0; a
            ``separator`` or bracket that is not a ``str``. Checked when the op is
            called (at capture), naming the argument and the allowed values.
        KeyError: unknown ``float_format`` (case-sensitive, as PopTorch); the error is
            also a ``poptorch.Error``.
    """
    if not isinstance(tensor, (torch.Tensor, torch.fx.Proxy)):
        raise py_error("ipu print tensor must take a torch.tensor argument, got "
                       f"{type(tensor).__name__}")
    fmt = make_format(summarise_threshold, edge_items, max_line_width, digits,
                      float_format, separator, open_bracket, close_bracket)
    if not isRunningOnIpu() and not isinstance(tensor, torch.fx.Proxy):
        return tensor
    return _PRINT(tensor, str(title), bool(print_gradient),
                  json.dumps(dataclasses.asdict(fmt)))


# -- output specs shared by host callbacks and custom ops ------------------------------

def encode_outputs(tensors: Sequence[torch.Tensor]) -> str:
    """JSON description (shape, dtype) of example outputs, stored on the graph node."""
    return json.dumps([[list(t.shape), str(t.dtype).replace("torch.", "")]
                       for t in tensors])


def decode_outputs(spec: str) -> List[Tuple[List[int], torch.dtype]]:
    return [(shape, getattr(torch, dtype)) for shape, dtype in json.loads(spec)]


def empty_outputs(spec: str, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Uninitialised tensors matching ``spec``, on the device of ``like``."""
    device = like[0].device if like else None
    return [torch.empty(shape, dtype=dtype, device=device)
            for shape, dtype in decode_outputs(spec)]


def as_tensor_list(what: str, values: Any) -> List[torch.Tensor]:
    """``values`` (a tensor or a list/tuple of tensors) as a list.

    Raises:
        poptorch.Error: anything else.
    """
    values = [values] if isinstance(values, torch.Tensor) else values
    if not isinstance(values, (list, tuple)) or \
            not all(isinstance(v, torch.Tensor) for v in values):
        raise py_error(f"{what} must return a tensor or a list/tuple of tensors, got "
                       f"{type(values).__name__}")
    return list(values)


def check_outputs(what: str, values: Any, spec: str, device) -> List[torch.Tensor]:
    """Normalise a host function's result to a list and check it against ``spec``.

    Raises:
        poptorch.Error: not tensors, or a count, shape or dtype other than declared.
    """
    values = as_tensor_list(what, values)
    expected = decode_outputs(spec)
    if len(values) != len(expected):
        raise py_error(f"{what} returned {len(values)} tensor(s) but {len(expected)} "
                       "were declared when the model was compiled")
    out = []
    for i, (value, (shape, dtype)) in enumerate(zip(values, expected)):
        if list(value.shape) != shape or value.dtype != dtype:
            raise py_error(
                f"{what} output {i} has shape {list(value.shape)} and dtype "
                f"{value.dtype}, but shape {shape} and dtype {dtype} were fixed when the "
                "model was compiled: return the same shapes and dtypes on every call")
        out.append(value.detach().to(device))
    return out


def run_on_examples(fn: Callable, inputs: Sequence[torch.Tensor]) -> Any:
    """Call ``fn`` on zero host tensors shaped like ``inputs`` (fake tensors during a
    capture), outside the capture's tracing, to learn its output shapes."""
    with unset_fake_temporarily(), disable_proxy_modes_tracing(), torch.no_grad():
        examples = [torch.zeros(tuple(t.shape), dtype=t.dtype, device="cpu")
                    for t in inputs]
        return fn(*examples)


# -- CPU ------------------------------------------------------------------------------

#: key -> CPU object, weakly: an entry lives as long as the model holding the CPU op.
_HOST_FUNCTIONS: "weakref.WeakValueDictionary[str, CPU]" = weakref.WeakValueDictionary()
_next_key = itertools.count()
_active: List["CPU"] = []
#: CPU ops called during the capture in progress; the captured graph keeps them alive
#: (a CPU op created inside ``forward`` has no other owner, as in PopTorch).
_captured: List["CPU"] = []


def take_captured() -> List["CPU"]:
    """Return and forget the CPU ops called since the last call (one capture)."""
    taken = list(_captured)
    _captured.clear()
    return taken


def _host_call(inputs: List[torch.Tensor], key: str, outputs: str) -> List[torch.Tensor]:
    cpu = _HOST_FUNCTIONS.get(key)
    if cpu is None:
        raise py_error(f"The host function of poptorch.CPU op {key} no longer exists")
    device = inputs[0].device if inputs else torch.device("cpu")
    with torch.no_grad():
        result = cpu._layer(*[t.detach().cpu() for t in inputs])
    return check_outputs(f"poptorch.CPU op {cpu.ID!r}", result, outputs, device)


def _host_call_setup(ctx, inputs, output):
    ctx.count = len(inputs[0])


def _host_call_backward(ctx, grads):
    return [None] * ctx.count, None, None


_HOST_CALL = library.define(
    "host_call(Tensor[] inputs, str key, str outputs) -> Tensor[]", _host_call,
    lambda inputs, key, outputs: empty_outputs(outputs, inputs),
    backward=_host_call_backward, setup_context=_host_call_setup, per_micro_batch=True)


class CPU:
    """Run host Python code in the middle of a device graph (docs/api-sections.md api §8.13).

    Store it on the module (``self.cpu = poptorch.CPU(self.fn, "MyOp")``) and call it
    with tensors. At run time ``layer_to_call`` executes on the host once per
    micro-batch per replica, with the actual values (in inference and in training; in
    training its outputs are constants for the backward pass: no gradient flows through
    host code). Output shapes and dtypes are fixed by the call made while compiling.

    Args:
        layer_to_call: callable taking host tensors and returning a tensor or a
            list/tuple of tensors. A module's parameters get ``requires_grad_(False)``.
        ID: name of the op (in error messages and ``_debugGetPopartIR()``).

    Raises:
        poptorch.Error: (when called) a non-tensor argument; a CPU op called inside
            another one ("CPU ops must not overlap"); at run time, outputs whose number,
            shape or dtype differ from the compile-time ones.
    """

    def __init__(self, layer_to_call: Callable, ID: str):  # noqa: N803 - PopTorch name
        if not callable(layer_to_call):
            raise py_error("poptorch.CPU needs a callable layer_to_call")
        if isinstance(layer_to_call, torch.nn.Module):
            for p in layer_to_call.parameters():
                p.requires_grad_(False)
        self._layer = layer_to_call
        self.ID = str(ID)
        self._key = f"{self.ID}#{next(_next_key)}"
        _HOST_FUNCTIONS[self._key] = self

    def __call__(self, *inputs: torch.Tensor):
        if not isRunningOnIpu():
            return self._layer(*inputs)
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise py_error(f"poptorch.CPU op {self.ID!r}: argument {i} is a "
                               f"{type(t).__name__}; CPU ops take tensors only")
        if _active:
            raise py_error(f"CPU ops must not overlap: poptorch.CPU op {self.ID!r} was "
                           f"called inside CPU op {_active[-1].ID!r}")
        _active.append(self)
        try:
            example = run_on_examples(self._layer, inputs)
        finally:
            _active.pop()
        single = isinstance(example, torch.Tensor)
        spec = encode_outputs(as_tensor_list(f"poptorch.CPU op {self.ID!r}", example))
        _captured.append(self)
        outs = _HOST_CALL(list(inputs), self._key, spec)
        if single:
            return outs[0]
        return type(example)(outs) if isinstance(example, tuple) else list(outs)

    def execute(self, *inputs: torch.Tensor):
        """Run ``layer_to_call`` on host tensors (internal, as in PopTorch)."""
        return self._layer(*inputs)

    def registerPersistentData(self) -> None:
        """Kept for PopTorch compatibility: host buffers need no registration here."""
        return None
