"""``popart_compiler.backends.prepack``: convolutions whose weight is a graph input become
the prepacked oneDNN kernel, give eager's results, and follow in-place weight writes."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from popart_compiler.backends import prepack

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="oneDNN is not available")


def _conv(x, w, b):
    return torch.ops.aten.convolution.default(x, w, b, [1, 1], [1, 1], [1, 1], False,
                                              [0, 0], 1)


def _graph():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4)
    return make_fx(_conv, tracing_mode="fake")(x, w, b), (x, w, b)


def test_a_convolution_on_a_weight_input_is_prepacked_and_matches_eager():
    gm, (x, w, b) = _graph()
    prepack.prepack_inference(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.popart_compiler.onednn_conv2d.default in targets
    assert torch.ops.aten.convolution.default not in targets
    out = gm(x, w, b)
    assert out.shape == (2, 4, 8, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out, _conv(x, w, b), rtol=1e-5, atol=1e-5)


def test_an_in_place_write_to_the_weight_is_used_at_the_next_call():
    gm, (x, w, b) = _graph()
    prepack.prepack_inference(gm)
    gm(x, w, b)
    assert prepack.packed_weights() >= 1
    with torch.no_grad():
        w.mul_(-2.0)  # bumps the version counter: packed again
    torch.testing.assert_close(gm(x, w, b), _conv(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_computed_weight_is_not_rewritten():
    def conv_of_computed(x, w, b):
        return _conv(x, w * 2.0, b)
    _, (x, w, b) = _graph()
    gm = make_fx(conv_of_computed, tracing_mode="fake")(x, w, b)
    prepack.prepack_inference(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.convolution.default in targets
    torch.testing.assert_close(gm(x, w, b), conv_of_computed(x, w, b))


def test_the_packed_linear_asks_inductor_for_a_contiguous_input_and_matches_eager():
    """A CNN's flatten after channels-last convolutions: the op is tagged so that
    Inductor writes its input row-major (no copy per call inside the kernel); a
    channels-last input still gives eager's result."""
    op = torch.ops.popart_compiler.onednn_linear_packed.default
    assert torch.Tag.needs_contiguous_strides in op.tags
    torch.manual_seed(0)
    x = torch.randn(4, 8, 2, 2).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(5, 32), torch.randn(5)
    torch.testing.assert_close(op(x, w, b), x.reshape(4, 32) @ w.T + b,
                               rtol=1e-5, atol=1e-5)


def test_the_rule_picks_onednn_for_wide_layers_only():
    assert prepack.uses_onednn(256, 784, 512)
    assert prepack.uses_onednn(256, 512, 512)
    assert not prepack.uses_onednn(256, 512, 10)  # the MLP's last layer: addmm
    assert not prepack.uses_onednn(256, 64, 128)  # too few input features


@pytest.mark.parametrize("n", [10, 96], ids=["addmm", "onednn"])
@pytest.mark.parametrize("post", ["none", "relu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_packed_linear_with_its_post_op_matches_eager(n, post, with_bias, monkeypatch):
    """Both kernels of the rule give eager's values, ReLU fused or not; the wide layer
    really runs oneDNN's packed kernel with the post-op, the narrow one ``addmm``."""
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise

    def spy(rows, w, b, attr, scalars, algorithm):
        calls.append((w.layout, attr))
        return pointwise(rows, w, b, attr, scalars, algorithm)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    torch.manual_seed(0)
    x, w = torch.randn(6, 4, 40), torch.randn(n, 160)
    b = torch.randn(n) if with_bias else None
    out = torch.ops.popart_compiler.onednn_linear_packed(x, w, b, post)
    ref = torch.nn.functional.linear(x.reshape(6, 160), w, b)
    if post == "relu":
        ref = ref.relu()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert calls == ([(torch._mkldnn, post)] if n == 96 else [])


def test_an_unknown_post_op_is_refused():
    with pytest.raises(RuntimeError, match="unknown post-op 'gelu'"):
        torch.ops.popart_compiler.onednn_linear_packed(torch.randn(2, 3), torch.randn(4, 3),
                                                       None, "gelu")


def _mlp(x, w1, b1, w2, b2):
    h = torch.ops.aten.relu.default(torch.ops.aten.addmm.default(b1, x, w1.t()))
    y = torch.ops.aten.addmm.default(b2, h, w2.t())
    return torch.ops.aten.relu.default(y), y  # y used twice: its ReLU stays apart


def test_a_relu_of_a_packed_linear_becomes_its_post_op():
    from popart_compiler.backends import inductor  # pylint: disable=import-outside-toplevel
    torch.manual_seed(0)
    args = (torch.randn(8, 160), torch.randn(96, 160), torch.randn(96),
            torch.randn(64, 96), torch.randn(64))
    gm = make_fx(_mlp, tracing_mode="fake")(*args)
    prepack.prepack_inference(inductor.onednn_linear(gm))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    packed = [n for n in nodes
              if n.target is torch.ops.popart_compiler.onednn_linear_packed.default]
    assert [n.args[3:] for n in packed] == [("relu",), ()]
    assert [n.target for n in nodes].count(torch.ops.aten.relu.default) == 1
    for got, want in zip(gm(*args), _mlp(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
