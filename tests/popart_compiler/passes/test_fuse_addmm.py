"""``fuse_addmm`` (passes/simplify.py): ``add(bias, view(mm(a, b)))`` becomes
``view(addmm(bias, a, b))`` when the bias broadcasts over rows."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from popart_compiler.passes.simplify import fuse_addmm

aten = torch.ops.aten


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def folded_linear(a, b, bias):
    return aten._unsafe_view.default(aten.mm.default(a, b), [2, 3, 4]) + bias


ARGS = (torch.randn(6, 5), torch.randn(5, 4), torch.randn(4))


def test_mm_view_and_bias_become_addmm():
    gm = make_fx(folded_linear, tracing_mode="fake")(*ARGS)
    assert targets(gm) == [aten.mm.default, aten._unsafe_view.default, aten.add.Tensor]
    assert fuse_addmm(gm) is True
    assert targets(gm) == [aten.addmm.default, aten._unsafe_view.default]
    addmm, view = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [a.name for a in addmm.args] == ["bias_1", "a_1", "b_1"]  # bias, a, b
    assert tuple(addmm.meta["val"].shape) == (6, 4)
    assert tuple(view.meta["val"].shape) == (2, 3, 4) and view.args[0] is addmm
    gm.graph.lint()
    gm.recompile()
    torch.testing.assert_close(gm(*ARGS), folded_linear(*ARGS))
    assert fuse_addmm(gm) is False


def test_bias_on_the_left_is_fused_too():
    gm = make_fx(lambda a, b, bias: bias + aten._unsafe_view.default(
        aten.mm.default(a, b), [2, 3, 4]), tracing_mode="fake")(*ARGS)
    assert fuse_addmm(gm) is True
    assert aten.addmm.default in targets(gm) and aten.mm.default not in targets(gm)


def shared_product(a, b, bias):
    product = aten.mm.default(a, b)
    return aten._unsafe_view.default(product, [2, 3, 4]) + bias, product


@pytest.mark.parametrize("fn", [
    lambda a, b, bias: folded_linear(a, b, bias.expand(3, 4)),
    shared_product,
    lambda a, b, bias: folded_linear(a, b, bias.double()),
], ids=["bias_2d", "product_used_twice", "bias_float64"])
def test_unfusable_adds_stay(fn):
    gm = make_fx(fn, tracing_mode="fake")(*ARGS)
    before = targets(gm)
    assert fuse_addmm(gm) is False
    assert targets(gm) == before
