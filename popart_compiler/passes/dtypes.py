"""Rewrites of the dtypes and devices written into a graph's op arguments.

The IPU has no 64-bit floating point type: ``torch.float64`` in an op's arguments
becomes ``torch.float32`` (PopTorch's ``[DISPATCHER] Type coerced from Double to
Float``, docs/semantics.md S-44). A program compiled for another torch device than the CPU it was
captured on gets that device in its arguments (``torch.zeros(..., device="cpu")``).
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from popart_compiler.ir import Graph
from popart_compiler.logging import logger
from popart_compiler.passes.base import Compilation, PassResult, unchanged

__all__ = ["rewrite_args", "demote_float64", "retarget_device"]


def _replace_in(value: Any, mapping: Dict[Any, Any]) -> Any:
    if isinstance(value, (torch.dtype, torch.device)):
        return mapping.get(value, value)
    if isinstance(value, (list, tuple)):
        return type(value)(_replace_in(v, mapping) for v in value)
    return value


def rewrite_args(gm: fx.GraphModule, mapping: Dict[Any, Any]) -> bool:
    """Replace the dtypes / devices of ``mapping`` in the arguments of every op of
    ``gm`` and of its sub-graphs, in place; whether anything changed."""
    changed = False
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        sub_changed = False
        for node in sub.graph.nodes:
            if node.op != "call_function":
                continue
            args = _replace_in(node.args, mapping)
            kwargs = {k: _replace_in(v, mapping) for k, v in node.kwargs.items()}
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = args, kwargs
                sub_changed = True
        if sub_changed:
            sub.recompile()
            changed = True
    return changed


def _as_float32(value: Any) -> Any:
    """``value`` (a node's ``meta["val"]``) with float64 fake tensors described as
    float32."""
    if isinstance(value, (list, tuple)):
        return type(value)(_as_float32(v) for v in value)
    if isinstance(value, FakeTensor) and value.dtype == torch.float64:
        with value.fake_mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=torch.float32,
                                       device=value.device)
    return value


def demote_float64(graph: Graph, c: Compilation) -> PassResult:
    """``torch.float64`` → ``torch.float32`` in op arguments (docs/semantics.md S-44), with
    PopTorch's warning; the values the ops compute are then described as float32 too
    (``meta["val"]``, which the IPU Model's estimate and the user outputs read)."""
    changed = rewrite_args(graph.module, {torch.float64: torch.float32})
    if changed:
        logger.warning("[DISPATCHER] Type coerced from Double to Float in the graph: "
                       "the IPU has no 64-bit floating point type")
        for sub in graph.module.modules():
            if isinstance(sub, fx.GraphModule):
                for node in sub.graph.nodes:
                    if node.op != "placeholder" and "val" in node.meta:
                        node.meta["val"] = _as_float32(node.meta["val"])
    return PassResult(graph, changed)


def retarget_device(graph: Graph, c: Compilation) -> PassResult:
    """The CPU device in op arguments → the session's torch device (``cuda``)."""
    if c.options.device == "cpu":
        return unchanged(graph)
    target = torch.device(c.options.device)
    return PassResult(graph, rewrite_args(graph.module, {torch.device("cpu"): target}))
