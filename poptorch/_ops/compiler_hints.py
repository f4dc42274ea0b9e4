"""Ops that steer the IPU compiler (docs/api-sections.md api §8.8–§8.11): identities on values,
recorded as ``poptorch::*`` nodes of the captured graph for the IPU Model and visible in
``_debugGetPopartIR()``. Outside a wrapped model they return their input (docs/semantics.md S-4).
"""
from __future__ import annotations

from typing import Any

import torch

from popart_compiler.errors import backend_error, py_error
from poptorch import enums
from poptorch._impl import isRunningOnIpu
from poptorch._ops import library

__all__ = ["recomputationCheckpoint", "serializedMatMul", "set_available_memory",
           "set_overlap_for_input", "set_overlap_for_output"]

_TENSOR_TYPES = (torch.Tensor, torch.fx.Proxy)


def _on_device(x: Any) -> bool:
    """Insert a device op: while capturing, or while ``torch.fx`` traces (a Proxy)."""
    return isRunningOnIpu() or isinstance(x, torch.fx.Proxy)


def recomputationCheckpoint(*tensors):
    """Mark tensors whose values are stored, not recomputed, between forward and
    backward when recomputation is enabled (docs/api-sections.md api §8.8). No numerical effect.

    Args:
        *tensors: one or more tensors, or a single list/tuple of tensors.

    Returns:
        The tensor for one argument, a tuple for several, a container of the same type
        for a single list/tuple.

    Raises:
        ValueError: "All inputs must be tensors".
    """
    container = None
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        container = type(tensors[0])
        tensors = tuple(tensors[0])
    if not all(isinstance(t, _TENSOR_TYPES) for t in tensors):
        raise ValueError("All inputs must be tensors")
    out = tuple(library.RECOMPUTATION_CHECKPOINT(t) if _on_device(t) else t
                for t in tensors)
    if container is not None:
        return container(out)
    return out[0] if len(out) == 1 else out


_MODE_DIM = {"InputChannels": ("rows of lhs", -2, 0), "ReducingDim": (
    "the reduced dimension", -1, 0), "OutputChannels": ("columns of rhs", -1, 1)}


def serializedMatMul(lhs: torch.Tensor, rhs: torch.Tensor,
                     mode: enums.MatMulSerializationMode, factor: int = 0,
                     keep_precision: bool = False) -> torch.Tensor:
    """``lhs @ rhs`` split into ``factor`` sequential pieces (docs/api-sections.md api §8.9).

    Args:
        lhs: ``[..., m, n]``; rhs: ``[..., n, p]`` (at least 2-D each).
        mode: ``MatMulSerializationMode``: ``InputChannels`` splits m,
            ``ReducingDim`` splits n (partial sums added), ``OutputChannels`` splits p,
            ``Disabled`` does not split.
        factor: number of pieces; must divide the split dimension.
        keep_precision: for float16 operands, add the partial sums in float32.

    Returns:
        ``[..., m, p]``, equal to ``torch.matmul(lhs, rhs)`` within float tolerance.

    Raises:
        AssertionError: ``keep_precision`` not a bool, ``factor`` not an int, ``mode`` not
            a ``MatMulSerializationMode``.
        poptorch.Error: (in a wrapped model) ``factor`` does not divide the dimension
            (a backend error, as in PopTorch), operands of fewer than 2 dimensions.
    """
    assert isinstance(keep_precision, bool), "keep_precision must be a bool"
    assert isinstance(factor, int), "factor must be an int"
    assert isinstance(mode, enums.MatMulSerializationMode), \
        "mode must be a MatMulSerializationMode"
    if not _on_device(lhs):
        return torch.matmul(lhs, rhs)
    if lhs.dim() < 2 or rhs.dim() < 2:
        raise py_error("serializedMatMul needs operands of at least 2 dimensions, got "
                       f"{list(lhs.shape)} and {list(rhs.shape)}")
    if mode.name in _MODE_DIM and factor > 1:
        what, dim, which = _MODE_DIM[mode.name]
        size = (lhs, rhs)[which].shape[dim]
        if size % factor:
            raise backend_error(f"serializedMatMul: factor {factor} does not divide {what} "
                                f"({size}) for mode {mode.name}")
    if keep_precision and lhs.dtype == torch.half:
        return library.SERIALIZED_MATMUL(lhs.float(), rhs.float(), mode.name,
                                              factor).half()
    return library.SERIALIZED_MATMUL(lhs, rhs, mode.name, factor)


def set_available_memory(tensor: torch.Tensor,
                         available_memory_proportion: float) -> torch.Tensor:
    """Give the op that produced ``tensor`` a temporary-memory budget
    (docs/api-sections.md api §8.10).

    Args:
        tensor: output of a convolution, matmul, embedding, gather or scatter.
        available_memory_proportion: fraction of tile memory in [0, 1] (device default
            0.6).

    Returns:
        A tensor equal to ``tensor``; the proportion is recorded on the graph node (the
        IPU Model's planner reads it). Outside a wrapped model: ``tensor`` itself.

    Raises:
        poptorch.Error: ``tensor`` not a tensor; (in a wrapped model) a proportion outside
            [0, 1].
    """
    if not isinstance(tensor, _TENSOR_TYPES):
        raise py_error("You may only set available memory for torch.tensor values, got "
                       f"{type(tensor).__name__}")
    if not _on_device(tensor):
        return tensor
    proportion = float(available_memory_proportion)
    if not 0.0 <= proportion <= 1.0:
        raise py_error(f"Available memory proportion must be in [0, 1], got {proportion}")
    return library.SET_AVAILABLE_MEMORY(tensor, proportion)


def _map_tensors(value, fn):
    if isinstance(value, _TENSOR_TYPES):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*[_map_tensors(v, fn) for v in value])
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _overlap(what: str, marker, tensors, mode):
    if not isinstance(mode, enums.OverlapMode):
        raise py_error(f"{what}: mode must be a poptorch.OverlapMode, got {mode!r}")
    return _map_tensors(tensors, lambda t: marker(t, mode.name) if _on_device(t) else t)


def set_overlap_for_input(input_tensors, mode: enums.OverlapMode):
    """Mark model inputs for host-I/O / compute overlap (docs/api-sections.md api §8.11,
    docs/semantics.md S-66).

    Apply it at the start of ``forward``, directly to the inputs. With a mode other
    than ``NoOverlap`` the compiler requires a non-pipelined strategy, IO tiles
    (``Options.TensorLocations.numIOTiles``), output mode ``All`` or ``Sum``, and the
    marker as the input's only consumer.

    Args:
        input_tensors: a tensor or any nesting of tuples/lists/dicts (non-tensor leaves
            are kept).
        mode: ``poptorch.OverlapMode``.

    Returns:
        The same structure (identities on values).

    Raises:
        poptorch.Error: ``mode`` not an ``OverlapMode``; at compile, the docs/semantics.md S-66
            rules.
    """
    return _overlap("set_overlap_for_input", library.OVERLAP_INPUT, input_tensors,
                    mode)


def set_overlap_for_output(output_tensors, mode: enums.OverlapMode):
    """Mark model outputs for host-I/O / compute overlap (docs/api-sections.md api §8.11,
    docs/semantics.md S-66).

    Apply it just before returning; each marked tensor must be returned exactly once.
    Same arguments, result and errors as :func:`set_overlap_for_input`.
    """
    return _overlap("set_overlap_for_output", library.OVERLAP_OUTPUT, output_tensors,
                    mode)
