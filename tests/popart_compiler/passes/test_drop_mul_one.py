"""``drop_mul_one`` (passes/simplify.py): ``x * 1`` becomes ``x`` when it keeps the
dtype and shape (vmap's decompositions leave such products behind)."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from popart_compiler.passes.simplify import drop_mul_one, simplify

aten = torch.ops.aten


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_times_one_is_dropped():
    def fn(x, y):
        return aten.mul.Tensor(x, 1) + aten.mul.Scalar(y, 1)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(3), torch.randn(3))
    assert targets(gm) == [aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor]
    assert drop_mul_one(gm) is True
    assert targets(gm) == [aten.add.Tensor]
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    assert [a.op for a in add.args] == ["placeholder", "placeholder"]
    gm.recompile()
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(gm(x, y), x + y)
    assert drop_mul_one(gm) is False


def test_products_that_change_something_stay():
    def fn(i, x, s):
        # int * 1.0 is a float; 1 broadcast to a larger shape; * 2; * a tensor
        return (aten.mul.Tensor(i, 1.0), aten.mul.Tensor(s, torch.ones(3)),
                aten.mul.Tensor(x, 2), aten.mul.Tensor(x, x))

    gm = make_fx(fn, tracing_mode="fake")(torch.ones(3, dtype=torch.int32), torch.randn(3),
                                          torch.randn(()))
    before = targets(gm)
    assert drop_mul_one(gm) is False and targets(gm) == before


def test_simplify_applies_it_and_eliminates_dead_code():
    gm = make_fx(lambda x: aten.mul.Tensor(x, 1).relu(), tracing_mode="fake")(torch.randn(2))
    assert simplify(gm) is gm
    assert targets(gm) == [aten.relu.default]
    torch.testing.assert_close(gm(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))
