"""Errors for what cannot be captured into a static graph: ops whose output shape
depends on tensor values, and tensor values read by Python control flow (docs/semantics.md S-1).

Each message names the real cause (the op or the value read, and the PyTorch code that
did it when it is PyTorch's own), the user's source line, and what to use instead.
"""
from __future__ import annotations

import os
import re
import traceback
from typing import List, Optional

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

import popart_compiler
from popart_compiler.errors import Error, py_error

__all__ = ["is_data_dependent", "data_dependent_error", "shape_error", "read_error",
           "user_frame", "function_name", "op_error"]

_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OURS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
              for m in (popart_compiler,)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # poptorch/
#: torch's tracing machinery (never the cause of a data dependence, only its messenger).
_MACHINERY = tuple(_TORCH + p for p in (
    "_subclasses", "fx", "_export", "export", "_dynamo", "_library", "_functorch",
    "_higher_order_ops", "_prims", "_refs", "_decomp", "utils", "_ops.py", "overrides.py",
    "_compile.py", "__init__.py", "_meta_registrations.py", "_guards.py", "_logging",
    "_jit_internal.py", "_C"))

_CONTROL_FLOW = (
    "Express the choice on the device instead: use poptorch.cond(condition, then_body, "
    "then_inputs, else_body, else_inputs) for if/else, or tensor ops such as "
    "torch.where; a value that is the same on every run can be passed to forward as a "
    "Python number.")
_WHERE = ("Keep the shape fixed instead: torch.where(mask, x, 0) (or x * mask) keeps "
          "x's shape where x[mask] or torch.masked_select would drop elements.")
#: What to do when PyTorch's own Python code reads a tensor value, by function name.
_LIBRARY_READS = {
    "_detect_is_causal_mask": (
        "PyTorch inspects the attention mask's values to detect a causal mask: pass "
        "is_causal / tgt_is_causal / src_is_causal explicitly (True only if the mask is "
        "causal), or build the mask inside forward from constants, e.g. with "
        "nn.Transformer.generate_square_subsequent_mask(n)."),
}
#: What to use instead of each op with a data-dependent output shape (by ATen name or
#: the Python name it is called by).
_ALTERNATIVES = {
    "nonzero": "Use torch.where(condition, x, y) to keep shapes fixed, or "
               "torch.nonzero_static(x, size=n) for a fixed number n of indices.",
    "argwhere": "Use torch.where(condition, x, y) to keep shapes fixed, or "
                "torch.nonzero_static(x, size=n) for a fixed number n of indices.",
    "masked_select": _WHERE,
    "index": _WHERE,
    "getitem": _WHERE,
    "unique": "Compute unique values on the host (outside the model), or count values "
              "with F.one_hot(x, num_classes).sum(0) when their range is known.",
    "bincount": "torch.bincount needs minlength on the IPU: pass minlength=<number of "
                "bins> (torch.bincount(x, minlength=n) counts into exactly n bins on the "
                "IPU; values outside [0, n) are not counted).",
    "one_hot": "OneHot num classes must be specified and must be constant: pass "
               "num_classes explicitly, F.one_hot(x, num_classes).",
    "repeat_interleave": "Pass output_size=<sum of repeats> to torch.repeat_interleave, "
                         "or repeat by a Python int.",
    "pack_padded_sequence": "Packed sequences have data-dependent sizes (the sum of the "
                            "lengths): run the recurrent layer on the padded batch and "
                            "mask the padded steps (torch.where), or pick each sequence's "
                            "last output with torch.gather.",
    "linalg_lstsq": "Use torch.linalg.pinv(A) @ B, or torch.linalg.solve(A, B) for "
                    "square A: their shapes do not depend on the rank of A.",
}


#: Advice for data-dependent code of libraries built on PyTorch, by the name of the
#: library function on the stack.
_PYG_SELF_LOOPS = (
    "PyTorch Geometric inserts self-loops (add_self_loops / add_remaining_self_loops "
    "drop the existing ones by a mask), so the number of edges depends on the graph's "
    "values. As PopTorch Geometric advised: construct the layer with "
    "add_self_loops=False (e.g. GCNConv(in, out, add_self_loops=False)) and add the "
    "self-loops to edge_index on the host, in the data pipeline (for example with "
    "torch_geometric.transforms.AddSelfLoops()).")
_LIBRARY_ADVICE = {"add_remaining_self_loops": _PYG_SELF_LOOPS,
                   "add_self_loops": _PYG_SELF_LOOPS}


def _library_advice(frames: List[traceback.FrameSummary]) -> Optional[str]:
    for frame in reversed(frames):
        if frame.name in _LIBRARY_ADVICE and "torch_geometric" in frame.filename:
            return _LIBRARY_ADVICE[frame.name]
    return None


def _alternative(op: str) -> str:
    """What to use instead of ``op`` (``aten::nonzero``, ``Tensor.__getitem__``, ...)."""
    for token in re.split(r"\W+", op):
        token = token.strip("_")
        if token in _ALTERNATIVES:
            return _ALTERNATIVES[token]
        if "unique" in token:
            return _ALTERNATIVES["unique"]
    return _WHERE


def is_data_dependent(exc: BaseException) -> bool:
    if isinstance(exc, (GuardOnDataDependentSymNode, DataDependentOutputException,
                        DynamicOutputShapeException)):
        return True
    text = str(exc)
    return "data-dependent" in text or "data dependent" in text


def _is_user(frame: traceback.FrameSummary) -> bool:
    path = os.path.abspath(frame.filename)
    return not (path.startswith(_TORCH) or path.startswith(_OURS)
                or frame.filename.startswith("<") or "contextlib" in path)


def user_frame(frames: List[traceback.FrameSummary]) -> Optional[traceback.FrameSummary]:
    """The innermost of ``frames`` in user code (not torch, poptorch, the compiler)."""
    user = [f for f in frames if _is_user(f)]
    return user[-1] if user else None


def _describe(frame: Optional[traceback.FrameSummary]) -> str:
    if frame is None:
        return "the model's forward"
    return f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`"


def _library_cause(frames: List[traceback.FrameSummary]) -> Optional[traceback.FrameSummary]:
    """The innermost frame of PyTorch's own (non-tracing) code below the user's."""
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if _is_user(frame):
            return None
        if path.startswith(_TORCH) and not path.startswith(_MACHINERY):
            return frame
    return None


def _location(frames: List[traceback.FrameSummary], library: bool = True) -> str:
    """"<user line>" or "<user line>, inside PyTorch's <file:line> (`code`)"."""
    where = _describe(user_frame(frames))
    cause = _library_cause(frames) if library else None
    if cause is not None:
        rel = os.path.relpath(os.path.abspath(cause.filename), os.path.dirname(_TORCH))
        where += (f", inside PyTorch's {cause.name} at {rel}:{cause.lineno}: "
                  f"`{(cause.line or '').strip()}`")
    return where


def function_name(func) -> str:
    """``torch.nonzero``, ``Tensor.__getitem__``, ``torch.nn.functional.one_hot``, ..."""
    name = getattr(func, "__name__", None) or str(func)
    owners = (("torch", torch), ("torch.nn.functional", torch.nn.functional),
              ("torch.linalg", torch.linalg), ("torch.fft", torch.fft),
              ("torch.special", torch.special), ("Tensor", torch.Tensor))
    for prefix, owner in owners:
        short = name.removeprefix(prefix.rpartition(".")[2] + "_")
        if getattr(owner, short, None) is func:
            return f"{prefix}.{short}"
    return getattr(func, "__qualname__", name)


def op_error(func, exc: BaseException) -> Error:
    """The PyTorch function ``func`` (called by the model) needed tensor values."""
    frames = traceback.extract_stack()[:-2] + traceback.extract_tb(exc.__traceback__)
    name = function_name(func)
    aten = getattr(exc, "func", None)
    if isinstance(aten, torch._ops.OpOverload):
        name += f" ({aten._schema.name})"
    if isinstance(aten, torch._ops.OpOverload) and \
            torch.Tag.dynamic_output_shape in aten.tags:
        return shape_error(name, frames)
    return py_error(
        f"The model's forward calls {name} at {_location(frames)}, which needs the value "
        "of a tensor at compile time: its output shape or the code PyTorch runs for it "
        "depends on tensor values. PopTorch captures forward once into a static graph, "
        f"so this cannot be captured. {_alternative(name)}")


def shape_error(op: str, frames: List[traceback.FrameSummary]) -> Error:
    """``op`` produced a tensor whose shape depends on tensor values."""
    return py_error(
        f"The model's forward computes a tensor whose shape depends on tensor values "
        f"({op} at {_location(frames, library=False)}). PopTorch captures forward once "
        "into a static graph, so every shape must be known at compile time. "
        f"{_library_advice(frames) or _alternative(op)}")


#: Reads that turn a tensor into a Python number (``int(t)``, ``float(t)``,
#: ``range(t)``): unlike ``t.item()`` the number cannot stay symbolic.
_NUMBER_READS = ("int(tensor)", "float(tensor)", "a tensor used as a Python int")


def read_error(read: str, frames: List[traceback.FrameSummary]) -> Error:
    """Python code read the value of a tensor that is only known at run time."""
    if read in _NUMBER_READS:
        error = py_error(
            f"The model's forward converts a tensor to a Python number ({read} at "
            f"{_location(frames)}), but its value is known only at run time. PopTorch "
            "captures forward once into a static graph, and Python's int() and float() "
            "must return a number at capture. Spell it tensor.item() instead (or keep the "
            "tensor, e.g. x * t[0]): the graph then computes the value at run time, and "
            "arithmetic with it works as long as Python does not branch on it (for "
            "if/else use poptorch.cond or torch.where). A value that is the same on every "
            "run can be passed to forward as a Python number.")
        error.number_read = True  # capture() tries again reading it as t.item()
        return error
    cause = _library_cause(frames)
    advice = _LIBRARY_READS.get(cause.name, _CONTROL_FLOW) if cause else _CONTROL_FLOW
    return py_error(
        f"The model's forward uses the value of a tensor in Python control flow "
        f"({read} at {_location(frames)}). PopTorch captures forward once into a static "
        "graph, so a value known only at run time cannot choose what Python does "
        "(if/while on a tensor, .item(), .tolist(), bool(tensor)). " + advice)


def data_dependent_error(exc: BaseException) -> Error:
    """The :func:`poptorch.Error` for a data-dependence ``exc`` raised while capturing."""
    frames = traceback.extract_tb(exc.__traceback__)
    func = getattr(exc, "func", None)
    if isinstance(func, torch._ops.OpOverload):
        name = func._schema.name.split("::")[-1]
        if torch.Tag.dynamic_output_shape in func.tags:
            return shape_error(f"{func._schema.name}", frames)
        return read_error(f"{name} (an op whose result is a Python value)", frames)
    return read_error("a Python value read from a tensor with .item(), .tolist(), int() "
                      "or float()", frames)
