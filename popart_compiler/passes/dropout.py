"""Dropout in inference sessions (docs/semantics.md S-34).

PopART replaces dropout by an identity whenever the session is an inference session,
whatever mode the PyTorch module was in when it was captured. :func:`remove_dropout`
is that rewrite on a captured ATen graph: one rule for every dropout variant, read from
the ops' schemas rather than from a list of modules.

* Ops whose name contains ``dropout`` and that return one tensor (``dropout``,
  ``feature_dropout`` — ``Dropout1d/2d/3d`` —, ``alpha_dropout``,
  ``feature_alpha_dropout`` and their in-place forms) are replaced by their input.
* Other ops that take a dropout probability (arguments named ``dropout`` or
  ``dropout_p``: ``scaled_dot_product_attention`` and its kernels, ``lstm`` / ``gru`` /
  ``rnn_*`` between layers) get probability ``0.0``; dropout ops returning more than
  one tensor (``native_dropout``) get ``train=False``.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation, PassResult

__all__ = ["remove_dropout", "remove_inference_dropout"]

#: Schema argument names that hold a dropout probability.
_PROBABILITY_ARGS = ("dropout", "dropout_p")


def _schema(node: fx.Node):
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    return target._schema


def _set_arg(node: fx.Node, index: int, name: str, value) -> bool:
    """Set argument ``index`` / ``name`` of ``node`` to ``value``; True if it changed."""
    if index < len(node.args):
        if node.args[index] == value:
            return False
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
        return True
    if name in node.kwargs and node.kwargs[name] != value:
        node.kwargs = {**node.kwargs, name: value}
        return True
    return False


def _rewrite(graph: fx.Graph) -> bool:
    changed = False
    for node in list(graph.nodes):
        schema = _schema(node)
        if schema is None:
            continue
        name = schema.name.split("::")[-1]
        is_dropout = "dropout" in name and "backward" not in name
        first = node.args[0] if node.args else None
        if is_dropout and len(schema.returns) == 1 and isinstance(first, fx.Node):
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            changed = True
            continue
        for index, arg in enumerate(schema.arguments):
            if arg.name in _PROBABILITY_ARGS:
                changed |= _set_arg(node, index, arg.name, 0.0)
            elif is_dropout and arg.name == "train":
                changed |= _set_arg(node, index, arg.name, False)
    return changed


def remove_dropout(gm: fx.GraphModule) -> bool:
    """Make every dropout of ``gm`` (and of its sub-graphs, e.g. ``torch.cond``
    branches) the identity, in place.

    Args:
        gm: a captured ATen graph (training IR).

    Returns:
        Whether anything changed (the module is recompiled if so).
    """
    changed = False
    for sub in gm.modules():
        if isinstance(sub, fx.GraphModule) and _rewrite(sub.graph):
            sub.graph.lint()
            sub.recompile()
            changed = True
    return changed


def remove_inference_dropout(graph: Graph, c: Compilation) -> PassResult:
    """Inference sessions: :func:`remove_dropout` (PopART's rule, docs/semantics.md S-34)."""
    return PassResult(graph, not c.training and remove_dropout(graph.module))
