"""``popart_compiler.backends.conv_chain``: chains of prepacked convolutions, ReLUs and
max-poolings become one oneDNN kernel (blocked layout), give eager's results, and
follow in-place weight writes."""
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from popart_compiler.backends import conv_chain, prepack

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="oneDNN is not available")

aten = torch.ops.aten
CHAIN = torch.ops.popart_compiler.onednn_conv_chain.default
CONV = torch.ops.popart_compiler.onednn_conv2d.default


def _features(x, w1, b1, w2, b2):
    """The benchmark CNN's feature extractor (bench/peer_models.py ``Cnn``)."""
    y = F.max_pool2d(torch.relu(F.conv2d(x, w1, b1, padding=1)), 2)
    return F.max_pool2d(torch.relu(F.conv2d(y, w2, b2, padding=1)), 2)


def _weights(c_in=3, c_mid=8, c_out=16):
    torch.manual_seed(0)
    return [torch.randn(c_mid, c_in, 3, 3) * 0.3, torch.randn(c_mid),
            torch.randn(c_out, c_mid, 3, 3) * 0.2, torch.randn(c_out)]


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _rewritten(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return prepack.prepack_inference(gm)


def test_the_benchmark_features_become_one_chain_and_match_eager():
    x = torch.randn(16, 3, 16, 16)
    args = (x, *_weights())
    gm = _rewritten(_features, *args)
    assert conv_chain.chain_count(gm) == 1
    targets = _targets(gm)
    for gone in (CONV, aten.relu.default, aten.max_pool2d_with_indices.default,
                 aten.convolution.default):
        assert gone not in targets
    chain = next(n for n in gm.graph.nodes if n.target is CHAIN)
    assert len(chain.args[1]) == 2  # both convolutions inside
    out = gm(*args)
    assert out.shape == (16, 16, 4, 4) and out.is_contiguous()
    torch.testing.assert_close(out, _features(*args), rtol=1e-5, atol=1e-5)


def test_an_in_place_weight_write_is_packed_again():
    x = torch.randn(16, 3, 16, 16)
    weights = _weights()
    gm = _rewritten(_features, x, *weights)
    before = gm(x, *weights)
    assert prepack.packed_weights() >= 2
    with torch.no_grad():
        weights[0].mul_(-1.5)  # what copyWeightsToDevice does: an in-place copy
        weights[2].add_(0.1)
    after = gm(x, *weights)
    torch.testing.assert_close(after, _features(x, *weights), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after, before)


def test_strides_padding_groups_ceil_mode_and_no_bias_match_eager():
    def fn(x, w1, w2):
        y = torch.relu(F.conv2d(x, w1, None, stride=2, padding=2, groups=2))
        y = F.max_pool2d(y, 3, stride=2, padding=1, ceil_mode=True)
        return torch.relu(F.conv2d(y, w2, None, padding=1, dilation=2))
    torch.manual_seed(1)
    x, w1, w2 = torch.randn(16, 4, 40, 36), torch.randn(6, 2, 5, 5), torch.randn(5, 6, 3, 3)
    gm = _rewritten(fn, x, w1, w2)
    assert conv_chain.chain_count(gm) == 1
    out = gm(x, w1, w2)
    ref = fn(x, w1, w2)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_the_chain_ends_where_a_result_has_another_user():
    """``relu(conv(x))`` is also an output: the chain stops at the convolution, which
    alone (no pooling, no second convolution) keeps the channels-last kernel."""
    def fn(x, w1, b1, w2, b2):
        y = torch.relu(F.conv2d(x, w1, b1, padding=1))
        return y, F.conv2d(y, w2, b2, padding=1)
    args = (torch.randn(16, 3, 8, 8), *_weights())
    gm = _rewritten(fn, *args)
    assert conv_chain.chain_count(gm) == 0
    assert _targets(gm).count(CONV) == 2
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_lone_convolution_and_relu_is_no_chain_but_a_pooled_one_is():
    w, b = _weights()[:2]
    x = torch.randn(16, 3, 8, 8)

    def lone(x, w, b):
        return torch.relu(F.conv2d(x, w, b, padding=1))

    def pooled(x, w, b):
        return F.max_pool2d(lone(x, w, b), 2)
    assert conv_chain.chain_count(_rewritten(lone, x, w, b)) == 0
    gm = _rewritten(pooled, x, w, b)
    assert conv_chain.chain_count(gm) == 1
    torch.testing.assert_close(gm(x, w, b), pooled(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_dilated_pooling_ends_the_chain():
    def fn(x, w1, b1, w2, b2):
        y = torch.relu(F.conv2d(x, w1, b1, padding=1))
        y = F.conv2d(y, w2, b2, padding=1)
        return F.max_pool2d(y, 2, dilation=2)
    args = (torch.randn(16, 3, 9, 9), *_weights())
    gm = _rewritten(fn, *args)
    assert conv_chain.chain_count(gm) == 1
    assert aten.max_pool2d_with_indices.default in _targets(gm)
    torch.testing.assert_close(gm(*args), fn(*args), rtol=1e-5, atol=1e-5)


def test_the_kernel_under_inference_mode_runs_on_plain_weights():
    """Inference tensors have no version counter: no packed copy, same values."""
    steps = [0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0, 0]
    with torch.inference_mode():
        x = torch.randn(2, 3, 8, 8)
        w, b = torch.randn(4, 3, 3, 3), torch.randn(4)
        out = CHAIN(x, [w], [b], steps)
    ref = F.max_pool2d(torch.relu(F.conv2d(x, w, b, padding=1)), 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_an_undecomposed_max_pool2d_joins_the_chain():
    """Captured graphs keep ``aten.max_pool2d`` (only vectorized ones decompose it)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def fn(x, w1, b1, w2, b2):
        y = aten.relu.default(aten.conv2d.default(x, w1, b1, [1, 1], [1, 1]))
        y = aten.max_pool2d.default(y, [2, 2], [2, 2])
        return aten.max_pool2d.default(aten.conv2d.default(y, w2, b2, [1, 1], [1, 1]),
                                       [3, 3], [], [1, 1])
    args = (torch.randn(32, 3, 12, 12), *_weights())
    gm = torch.fx.symbolic_trace(fn)
    FakeTensorProp(gm).propagate(*args)
    prepack.prepack_inference(gm)
    assert conv_chain.chain_count(gm) == 1
    assert aten.max_pool2d.default not in _targets(gm)
    torch.testing.assert_close(gm(*args), fn(*args), rtol=1e-5, atol=1e-5)


def test_big_weights_and_few_output_positions_keep_the_channels_last_kernel():
    """The blocked kernels reorder a packed weight again at every call (except the
    first convolution's): a convolution with a weight over 128 × 128 × 3 × 3 or under
    1024 output positions (N × H' × W') stays out of chains."""
    torch.manual_seed(0)
    small = _weights()
    few = torch.randn(8, 3, 16, 16)  # second convolution: 8 × 8 × 8 positions
    gm = _rewritten(_features, few, *small)
    assert conv_chain.chain_count(gm) == 1  # the first convolution and its pooling
    chain = next(n for n in gm.graph.nodes if n.target is CHAIN)
    assert len(chain.args[1]) == 1 and _targets(gm).count(CONV) == 1
    torch.testing.assert_close(gm(few, *small), _features(few, *small),
                               rtol=1e-5, atol=1e-5)
    wide = [torch.randn(160, 3, 3, 3), torch.randn(160), torch.randn(160, 160, 3, 3) * 0.05,
            torch.randn(160)]
    x = torch.randn(16, 3, 16, 16)
    gm = _rewritten(_features, x, *wide)
    assert _targets(gm).count(CONV) == 1  # the 160 × 160 × 3 × 3 weight: left out
    torch.testing.assert_close(gm(x, *wide), _features(x, *wide), rtol=1e-4, atol=1e-4)
