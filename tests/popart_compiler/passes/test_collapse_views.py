"""``collapse_views`` (passes/simplify.py): identity permutes are dropped, a view of a
view becomes one view (none if it restores the shape), and a unary pointwise op on a
view (its only user) moves before the view."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from popart_compiler.passes.simplify import collapse_views, simplify

aten = torch.ops.aten
VIEWS = (aten.view.default, aten._unsafe_view.default)


def ops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def finish(gm):
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def test_identity_permute_is_dropped():
    gm = make_fx(lambda x: x.permute(0, 1).relu(), tracing_mode="fake")(torch.randn(2, 3))
    assert aten.permute.default in [n.target for n in ops(gm)]
    assert collapse_views(gm) is True
    finish(gm)
    assert [n.target for n in ops(gm)] == [aten.relu.default]
    x = torch.randn(2, 3)
    torch.testing.assert_close(gm(x), x.relu())


def test_view_of_a_view_is_one_view_or_none():
    def fn(x):
        return x.view(3, 4).view(2, 6), x.view(3, 4).view(12) + 1

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(12))
    assert collapse_views(gm) is True
    finish(gm)
    views = [n for n in ops(gm) if n.target in VIEWS]
    assert len(views) == 1 and views[0].args[0].op == "placeholder"
    assert list(views[0].args[1]) == [2, 6]
    add = next(n for n in ops(gm) if n.target is aten.add.Tensor)
    assert add.args[0].op == "placeholder"  # the round trip is gone
    x = torch.randn(12)
    for a, b in zip(gm(x), fn(x)):
        torch.testing.assert_close(a, b)


def test_unary_pointwise_op_moves_before_the_view():
    gm = make_fx(lambda x: torch.relu(x.view(3, 4)), tracing_mode="fake")(torch.randn(12))
    assert collapse_views(gm) is True
    finish(gm)
    relu, view = ops(gm)
    assert relu.target is aten.relu.default and relu.args[0].op == "placeholder"
    assert view.target in VIEWS and view.args[0] is relu
    assert tuple(relu.meta["val"].shape) == (12,) and tuple(view.meta["val"].shape) == (3, 4)
    x = torch.randn(12)
    torch.testing.assert_close(gm(x), torch.relu(x).view(3, 4))


def test_graph_without_views_is_unchanged():
    gm = make_fx(lambda x: (x * 2).relu(), tracing_mode="fake")(torch.randn(3))
    before = gm.code
    assert collapse_views(gm) is False and gm.code == before


def test_view_collapse_keeps_a_view_with_other_users():
    """A pointwise op on a view that something else also reads stays after the view;
    a view that does not restore its source's shape stays."""
    def fn(x):
        v = x.view(3, 4)
        return torch.relu(v), v.sum(0), v.view(2, 6)
    x = torch.randn(12)
    gm = simplify(make_fx(fn, tracing_mode="fake")(x))
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    assert relu.args[0].target is aten.view.default
    last = [n for n in gm.graph.nodes if n.target is aten.view.default][-1]
    assert last.args[0].op == "placeholder" and list(last.args[1]) == [2, 6]
    for a, b in zip(gm(x), fn(x)):
        torch.testing.assert_close(a, b)


def test_binary_pointwise_op_on_views_of_one_shape_moves_before_them():
    """A residual sum of two unfolded results (vmap's ``add(view(a), view(b))``) runs on
    the folded tensors; a sum that broadcasts, or with an operand that is not a view,
    stays."""
    def fn(a, b, c):
        s = torch.relu(a.view(2, 3, 4) + b.view(2, 3, 4) * 2.0)
        return s.view(6, 4), c.view(2, 3, 4) + c.view(2, 3, 4)[0], a.view(2, 12) + c
    args = (torch.randn(6, 4), torch.randn(6, 4), torch.randn(2, 12))
    gm = simplify(make_fx(fn, tracing_mode="fake")(*args))
    nodes = ops(gm)
    first_add = next(n for n in nodes if n.target is aten.add.Tensor)
    assert [a.op for a in first_add.args] == ["placeholder", "call_function"]
    assert first_add.args[1].target is aten.mul.Tensor  # b * 2 moved too
    assert first_add.args[1].args[0].op == "placeholder"
    relu = next(n for n in nodes if n.target is aten.relu.default)
    assert relu.args[0] is first_add and tuple(relu.meta["val"].shape) == (6, 4)
    assert relu.users and all(u.op == "output" for u in relu.users)  # no view left
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want)
