"""``popart_compiler.backends.conv_fusion``: a convolution, the inference batch
normalization after it, a residual sum and a ReLU become one oneDNN convolution with
eager's results, folded again after in-place writes to any of their tensors."""
import pytest
import torch
import torch.nn as nn

from popart_compiler.backends import conv_fusion

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="oneDNN is not available")

FUSED = torch.ops.popart_compiler.onednn_conv2d_bn.default


class Block(nn.Module):
    """A ResNet basic block: conv-bn-relu, conv-bn, + input, relu."""

    def __init__(self, c=8, bias=False, affine=True):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=bias)
        self.bn1 = nn.BatchNorm2d(c, affine=affine)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=bias)
        self.bn2 = nn.BatchNorm2d(c, affine=affine)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


def _block(**kwargs):
    torch.manual_seed(0)
    block = Block(**kwargs).eval()
    for bn in (block.bn1, block.bn2):  # statistics that are not the identity
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        if bn.affine:
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-0.5, 0.5)
    return block


def _fused(block, x):
    """The exported graph, weights and statistics as graph inputs, after
    ``fold_batch_norms``, and its args."""
    ep = torch.export.export(block, (x,))
    sig = ep.graph_signature
    state = {**ep.state_dict, **dict(ep.named_buffers())}
    args = [state[n] for n in sig.parameters + sig.buffers] + [x]
    gm = ep.graph_module
    conv_fusion.fold_batch_norms(gm)
    return gm, args


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("bias,affine", [(False, True), (True, True), (False, False)])
def test_a_residual_block_becomes_two_fused_convolutions_and_matches_eager(bias, affine):
    block = _block(bias=bias, affine=affine)
    x = torch.randn(4, 8, 10, 10)
    gm, args = _fused(block, x)
    assert conv_fusion.folded_count(gm) == 2
    targets = _targets(gm)
    for gone in (torch.ops.aten.batch_norm.default, torch.ops.aten.relu.default,
                 torch.ops.aten.add.Tensor):
        assert gone not in targets
    fused = [n for n in gm.graph.nodes if n.target is FUSED]
    assert [n.args[8] is not None for n in fused] == [False, True]  # the residual sum
    assert [n.args[-1] for n in fused] == [True, True]  # both ReLUs
    with torch.no_grad():
        expected = block(x)
        torch.testing.assert_close(gm(*args)[0], expected, rtol=1e-5, atol=1e-5)


def test_in_place_writes_to_the_statistics_or_weights_fold_again():
    block = _block()
    x = torch.randn(2, 8, 6, 6)
    gm, args = _fused(block, x)
    with torch.no_grad():
        before = gm(*args)[0]
        block.bn2.running_var.mul_(3.0)  # as copyWeightsToDevice writes: in place
        block.conv1.weight.mul_(-1.0)
        after = gm(*args)[0]
        torch.testing.assert_close(after, block(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_a_normalization_in_training_mode_or_a_shared_result_is_left_alone():
    block = _block().train()
    gm, _ = _fused(block, torch.randn(2, 8, 6, 6))
    assert conv_fusion.folded_count(gm) == 0

    class TwoUsers(nn.Module):  # the convolution's result is read twice
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + y
    gm, _ = _fused(TwoUsers().eval(), torch.randn(2, 3, 4, 4))
    assert conv_fusion.folded_count(gm) == 0


def test_inference_tensors_run_the_plain_kernels():
    block = _block()
    x = torch.randn(2, 8, 6, 6)
    gm, _ = _fused(block, x)
    with torch.inference_mode():
        state = {k: v.clone() for k, v in block.state_dict().items()}
        ep_args = [state[k] for k in ("conv1.weight", "bn1.weight", "bn1.bias",
                                      "conv2.weight", "bn2.weight", "bn2.bias",
                                      "bn1.running_mean", "bn1.running_var",
                                      "bn1.num_batches_tracked", "bn2.running_mean",
                                      "bn2.running_var", "bn2.num_batches_tracked")]
        out = gm(*ep_args, x.clone())[0]
    with torch.no_grad():
        torch.testing.assert_close(out, block(x), rtol=1e-5, atol=1e-5)


class Bottleneck(nn.Module):
    """A down-sampling block then an identity block (1×1 convolutions): the residuals
    are the down-sampling's result, then the first block's result."""

    def __init__(self, c=8):
        super().__init__()
        self.down = nn.Conv2d(4, c, 1, bias=False)
        self.down_bn = nn.BatchNorm2d(c)
        self.convs = nn.ModuleList([nn.Conv2d(4, c, 1), nn.Conv2d(c, c, 3, padding=1)])
        self.bns = nn.ModuleList([nn.BatchNorm2d(c), nn.BatchNorm2d(c)])

    def forward(self, x):
        y = torch.relu(self.bns[0](self.convs[0](x)) + self.down_bn(self.down(x)))
        return torch.relu(self.bns[1](self.convs[1](y)) + y), y


def test_a_residual_from_a_fused_convolution_is_summed_into_in_place():
    torch.manual_seed(0)
    model = Bottleneck().eval()
    for bn in (model.down_bn, *model.bns):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 4, 6, 6)
    gm, args = _fused(model, x)
    targets = _targets(gm)
    # the first sum writes into the down-sampling's result; the second reads the
    # first block's result, also a graph output, after it: out of place
    assert targets.count(torch.ops.popart_compiler.onednn_conv2d_bn_sum_.default) == 1
    assert targets.count(FUSED) == 2
    with torch.no_grad():
        expected = model(x)
        for _ in range(2):  # the second call: packed weights reused
            out = gm(*args)
            for got, want in zip(out, expected):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
