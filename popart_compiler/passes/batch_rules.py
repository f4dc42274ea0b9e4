"""Batching rules that :mod:`popart_compiler.passes.vectorize` uses in place of vmap's own,
where those are wrong or slow for the graphs a session runs.

The per-micro-batch graph is run by :class:`VectorizableGraph` under ``torch.func.vmap``;
it evaluates two kinds of nodes differently, every other node as the graph does:

* ``torch.cond``: both branches and a ``torch.where`` on the predicate (what
  ``torch.cond``'s own rule does for a predicate that differs between micro-batches,
  written out because that rule fails for branches with several outputs, torch 2.13);
* batch normalization in inference (``aten.batch_norm`` with ``training=False`` and its
  statistics, weight and bias graph inputs, shared by the micro-batches): vmap's rule
  moves the micro-batch dimension into the channels, which costs two transposing copies
  of the activations around every normalization and leaves a graph in which no
  compiler sees a convolution followed by a normalization (ResNet-50, one thread: 38 %
  of a call's time in those copies). Here the micro-batches are folded into the batch
  dimension instead (``view``, no copy), through the op
  ``popart_compiler::batch_norm_inference``, which :func:`restore_batch_norms` turns back
  into ``aten.batch_norm`` once traced: the vectorized graph holds the same
  ``conv → batch_norm → relu`` as the per-micro-batch one, over the folded batch.
  Statistics (or weight, bias) that differ between micro-batches, graph inputs the user
  passes, are applied per micro-batch instead, written out as pointwise ops.

The results are the per-micro-batch graph's: a normalization in inference is per
sample.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

__all__ = ["VectorizableGraph", "needs_rules", "restore_batch_norms"]

_BATCH_NORM = torch.ops.aten.batch_norm.default


@torch.library.custom_op("popart_compiler::batch_norm_inference", mutates_args=())
def _batch_norm_inference(x: torch.Tensor, weight: Optional[torch.Tensor],
                          bias: Optional[torch.Tensor], mean: torch.Tensor,
                          var: torch.Tensor, eps: float) -> torch.Tensor:
    """``aten.batch_norm(x, weight, bias, mean, var, training=False, eps=eps)``: ``x`` of
    shape ``(N, C, ...)``, the other tensors of shape ``(C,)``."""
    return torch.ops.aten.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, True)


@_batch_norm_inference.register_fake
def _(x, weight, bias, mean, var, eps):  # pylint: disable=unused-argument
    return torch.empty_like(x)


@_batch_norm_inference.register_vmap
def _(info, in_dims, x, weight, bias, mean, var, eps):
    """Micro-batches folded into the batch dimension where only ``x`` is batched (shared
    weights and statistics); else the normalization written out per micro-batch, each
    operand with its own (or the shared) per-channel values."""
    if all(d is None for d in in_dims[1:5]):
        x = x.movedim(in_dims[0], 0)
        folded = x.reshape((-1,) + tuple(x.shape[2:]))
        out = _batch_norm_inference(folded, weight, bias, mean, var, eps)
        return out.reshape(x.shape), 0
    x = x.movedim(in_dims[0], 0) if in_dims[0] is not None else \
        x.expand((info.batch_size,) + tuple(x.shape))
    shape = (x.shape[0], 1, x.shape[2]) + (1,) * (x.dim() - 3)  # [D, 1, C, 1, ...]

    def per_channel(t, dim):
        t = t.movedim(dim, 0) if dim is not None else t.unsqueeze(0)
        return t.expand(x.shape[0], -1).reshape(shape)
    out = (x - per_channel(mean, in_dims[3])) * \
        torch.rsqrt(per_channel(var, in_dims[4]) + eps)
    if weight is not None:
        out = out * per_channel(weight, in_dims[1])
    if bias is not None:
        out = out + per_channel(bias, in_dims[2])
    return out, 0


def _is_shared_batch_norm(node: fx.Node) -> bool:
    """An inference ``aten.batch_norm`` whose weight, bias and statistics are graph inputs
    (placeholders: state, shared by the micro-batches) or absent."""
    if node.op != "call_function" or node.target is not _BATCH_NORM or node.kwargs:
        return False
    _, weight, bias, mean, var, training = node.args[:6]
    return not training and all(
        t is None or (isinstance(t, fx.Node) and t.op == "placeholder")
        for t in (weight, bias, mean, var)) and mean is not None and var is not None


def needs_rules(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` has a node :class:`VectorizableGraph` evaluates differently."""
    return any(n.op == "call_function" and n.target is torch.ops.higher_order.cond
               or _is_shared_batch_norm(n) for n in gm.graph.nodes)


class VectorizableGraph(fx.Interpreter):
    """Runs a graph with the rules of this module (see the module docstring) for
    ``torch.cond`` and shared inference batch normalizations; every other node as
    ``gm`` does. Use ``VectorizableGraph(gm).run`` as the function to vmap."""

    def run_node(self, n: fx.Node):
        if _is_shared_batch_norm(n):
            x, weight, bias, mean, var = (self.env[a] if isinstance(a, fx.Node) else a
                                          for a in n.args[:5])
            return _batch_norm_inference(x, weight, bias, mean, var, float(n.args[7]))
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        if target is not torch.ops.higher_order.cond:
            return super().call_function(target, args, kwargs)
        pred, then_gm, else_gm, operands = args[:4]
        then_out, else_out = then_gm(*operands), else_gm(*operands)
        return tuple(torch.where(pred, a, b) for a, b in zip(then_out, else_out))


def restore_batch_norms(gm: fx.GraphModule) -> fx.GraphModule:
    """``popart_compiler::batch_norm_inference`` nodes of a traced ``gm`` back into
    ``aten.batch_norm(..., training=False, ...)`` (in place; returns ``gm``): the op
    every backend knows (Inductor fuses it into its neighbours, the CPU inference
    lowering folds it into the convolution before it)."""
    op = torch.ops.popart_compiler.batch_norm_inference.default
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is op:
            x, weight, bias, mean, var, eps = node.args
            node.target = _BATCH_NORM
            node.args = (x, weight, bias, mean, var, False, 0.0, eps, True)
            changed = True
    if changed:
        gm.recompile()
    return gm
