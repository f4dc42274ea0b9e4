"""Simplifications of the graphs that vectorizing leaves behind, one function per rule.

vmap's decompositions and its fold / unfold of the micro-batch dimension leave
identities behind: ``x * 1``, identity permutes, views undone by the next view, an
``mm`` whose bias is added afterwards. Each rule rewrites an ``fx.GraphModule`` in place
and returns whether it changed it; :func:`simplify` applies all of them.
"""
from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["simplify", "drop_mul_one", "fuse_addmm", "collapse_views"]


def simplify(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove identities that vmap's decompositions leave behind (``x * 1``, identity
    permutes, a view undone by the next one) and fuse ``mm`` + bias into ``addmm``."""
    changed = [drop_mul_one(gm), fuse_addmm(gm), collapse_views(gm)]
    if any(changed):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def drop_mul_one(gm: fx.GraphModule) -> bool:
    """``x * 1`` → ``x`` (same dtype and shape); whether ``gm`` changed."""
    changed = False
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in (aten.mul.Scalar, aten.mul.Tensor) and len(node.args) == 2 \
                and not isinstance(node.args[1], fx.Node) and node.args[1] == 1 \
                and isinstance(node.args[0], fx.Node):
            src = node.args[0]
            src_val, val = src.meta.get("val"), node.meta.get("val")
            if isinstance(src_val, torch.Tensor) and isinstance(val, torch.Tensor) \
                    and src_val.dtype == val.dtype and src_val.shape == val.shape:
                node.replace_all_uses_with(src)
                gm.graph.erase_node(node)
                changed = True
    return changed


def fuse_addmm(gm: fx.GraphModule) -> bool:
    """``add(bias, view(mm(a, b)))`` → ``view(addmm(bias, a, b))`` when ``bias``
    broadcasts over rows; whether ``gm`` changed."""
    changed = False
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.add.Tensor:
            continue
        lhs, rhs = node.args[0], node.args[1]
        if not (isinstance(lhs, fx.Node) and isinstance(rhs, fx.Node)):
            continue
        if rhs.target is not aten._unsafe_view.default:
            lhs, rhs = rhs, lhs
        if rhs.target is not aten._unsafe_view.default or len(rhs.users) != 1:
            continue
        mm = rhs.args[0]
        if not isinstance(mm, fx.Node) or mm.target is not aten.mm.default or len(mm.users) != 1:
            continue
        bias_val = lhs.meta.get("val")
        mm_val = mm.meta.get("val")
        out_val = node.meta.get("val")
        if not (isinstance(bias_val, torch.Tensor) and isinstance(mm_val, torch.Tensor)
                and isinstance(out_val, torch.Tensor)):
            continue
        if bias_val.dim() != 1 or bias_val.shape[0] != mm_val.shape[1] \
                or bias_val.dtype != mm_val.dtype or out_val.shape != rhs.meta["val"].shape:
            continue
        with gm.graph.inserting_before(node):
            addmm = gm.graph.call_function(aten.addmm.default, (lhs, mm.args[0], mm.args[1]))
            addmm.meta["val"] = mm_val
            view = gm.graph.call_function(aten._unsafe_view.default, (addmm, rhs.args[1]))
            view.meta["val"] = out_val
        node.replace_all_uses_with(view)
        gm.graph.erase_node(node)
        gm.graph.erase_node(rhs)
        gm.graph.erase_node(mm)
        changed = True
    return changed


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def collapse_views(gm: fx.GraphModule) -> bool:
    """vmap folds the micro-batch dimension into the batch dimension around every op
    and unfolds it after: ``view(relu(view(conv(x), [8, 16, ...])), [128, ...])``.
    Rewrite, until nothing changes: an identity ``permute`` is dropped; a view of a view
    becomes one view, and none if it restores the original shape; a pointwise op whose
    tensor operands are all views of one shape (each read by it only: a ReLU, a residual
    sum) moves before the views. What is left is the graph over
    the folded batch, whose layouts a compiler can choose freely (Inductor gave the
    CNN's pooling output an extra transposing copy before this). Returns whether
    ``gm`` changed (the caller eliminates dead code and recompiles)."""
    changed = True
    rounds = 0
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and len(node.users) > 0:
                changed = _collapse_view(gm, node) or changed
        if changed:
            rounds += 1
            gm.graph.eliminate_dead_code()
    return rounds > 0


def _collapse_view(gm: fx.GraphModule, node: fx.Node) -> bool:
    """One rewrite of :func:`collapse_views` at ``node``; whether one applied."""
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node):
        return False
    if node.target is torch.ops.aten.permute.default:
        if list(node.args[1]) != list(range(len(node.args[1]))):
            return False
        node.replace_all_uses_with(src)
        return True
    if node.target in _VIEWS:
        if src.target in _VIEWS:
            node.args = (src.args[0],) + tuple(node.args[1:])
            return True
        val, src_val = node.meta.get("val"), src.meta.get("val")
        if isinstance(val, torch.Tensor) and isinstance(src_val, torch.Tensor) \
                and val.shape == src_val.shape:
            node.replace_all_uses_with(src)
            return True
        return False
    return _move_before_views(gm, node)


def _move_before_views(gm: fx.GraphModule, node: fx.Node) -> bool:
    """``f(view(x, s), view(y, s), c)`` → ``view(f(x, y, c), s)`` for a pointwise ``f``
    whose tensor operands are all views (each read by ``f`` only) of tensors of one
    shape, to one shape (no broadcasting); whether it applied."""
    if node.kwargs or not isinstance(node.target, torch._ops.OpOverload) \
            or torch.Tag.pointwise not in node.target.tags \
            or node.target._schema.is_mutable:
        return False
    views = [a for a in node.args if isinstance(a, fx.Node)]
    if not views or any(v.target not in _VIEWS or len(v.users) != 1 for v in views):
        return False
    sources = [v.args[0] for v in views]
    vals = [x.meta.get("val") for x in sources]
    shapes = {tuple(v.meta["val"].shape) for v in views if "val" in v.meta}
    if not all(isinstance(v, torch._subclasses.FakeTensor) for v in vals) or \
            len({tuple(v.shape) for v in vals}) != 1 or len(shapes) != 1 or \
            len({v.fake_mode for v in vals}) != 1:
        return False
    source_of = dict(zip(views, sources))
    args = tuple(source_of.get(a, a) if isinstance(a, fx.Node) else a for a in node.args)
    with vals[0].fake_mode:
        val = node.target(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args))
    with gm.graph.inserting_before(node):
        moved = gm.graph.call_function(node.target, args)
        moved.meta["val"] = val
        view = gm.graph.call_function(views[0].target, (moved,) + tuple(views[0].args[1:]))
        view.meta["val"] = node.meta.get("val")
    node.replace_all_uses_with(view)
    return True
