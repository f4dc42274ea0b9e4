"""Inference on the CPU with prepacked oneDNN weights and channels-last convolutions
(issue 30, ``popart_compiler/backends/prepack.py``): same results as eager PyTorch, and
weights uploaded with ``copyWeightsToDevice`` are used at the next call without a
recompilation.

Most tests replace TorchInductor's compilation by the graph itself (the rewritten
graph then runs the prepacking kernels uncompiled); one compiles for real (slow).
"""
import pytest
import torch
import torch.nn as nn

import poptorch
from models import assert_uploads_used_without_recompiling, upload_new_weights
from popart_compiler.backends import inductor as inductor_backend
from popart_compiler.backends import prepack


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2, bias=False), nn.ReLU(),
            nn.Conv2d(8, 4, 1))
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))



def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _model(iterations=2):
    torch.manual_seed(0)
    m = _Net().eval()
    with torch.no_grad():  # BatchNorm statistics that do something
        m.features[1].running_mean.uniform_(-0.5, 0.5)
        m.features[1].running_var.uniform_(0.5, 2.0)
    opts = poptorch.Options().deviceIterations(iterations)
    opts.Backend.compiler("inductor")
    return m, poptorch.inferenceModel(m, opts)


def test_inference_graphs_run_prepacked_kernels_and_match_eager(stand_in):
    m, model = _model()
    x = torch.randn(6, 3, 8, 8)
    torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    targets = [t for gm in stand_in for t in _targets(gm)]
    # the first convolution with its batch normalization and ReLU folded in
    # (popart_compiler/backends/conv_fusion.py), in the vectorized graph too: vmap's
    # batch-norm rule (a transposing copy each side) is not used
    # (popart_compiler/passes/batch_rules.py)
    assert targets.count("popart_compiler.onednn_conv2d_bn.default") >= 1
    assert targets.count("popart_compiler.onednn_conv2d.default") >= 2
    for gone in ("aten.batch_norm.default", "aten._native_batch_norm_legit_no_training."
                 "default", "aten.native_batch_norm.default", "aten.transpose.int",
                 "aten.clone.default"):
        assert gone not in targets
    assert "popart_compiler.onednn_linear_packed.default" in targets
    assert "aten.convolution.default" not in targets
    assert "aten.conv2d.default" not in targets
    # the three convolutions' weights; the 64 → 5 linear is too small for oneDNN
    # (prepack.uses_onednn): it runs addmm on the plain weight
    assert prepack.packed_weights() >= 3


def test_uploaded_weights_are_repacked_without_recompiling(stand_in):
    m, model = _model()
    x = torch.randn(6, 3, 8, 8)
    before = model(x)
    compiled = len(stand_in)
    upload_new_weights(m, model, -1.5, 0.25)
    after = model(x)
    torch.testing.assert_close(after, m(x).detach(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after, before)
    assert len(stand_in) == compiled  # no new compilation
    model.copyWeightsToDevice()  # the same values again: still the right results
    torch.testing.assert_close(model(x), after, rtol=0, atol=0)


def test_training_graphs_keep_plain_convolutions(stand_in):
    torch.manual_seed(0)

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _Net()

        def forward(self, x, t):
            out = self.net(x)
            return out, nn.functional.cross_entropy(out, t)
    m = WithLoss()
    opts = poptorch.Options()
    opts.Backend.compiler("inductor")
    model = poptorch.trainingModel(m, opts, poptorch.optim.SGD(m.parameters(), lr=0.1))
    model(torch.randn(3, 3, 8, 8), torch.randint(0, 5, (3,)))
    targets = [t for gm in stand_in for t in _targets(gm)]
    assert "aten.conv2d.default" in targets or "aten.convolution.default" in targets
    assert not [t for t in targets if "onednn_conv2d" in t or "linear_packed" in t]


def test_prepacked_conv_kernel_matches_conv2d_and_follows_in_place_writes():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 9, 9)
    w, b = torch.randn(4, 3, 3, 3), torch.randn(4)
    conv = torch.ops.popart_compiler.onednn_conv2d
    out = conv(x, w, b, [2, 2], [1, 1], [1, 1], 2)
    ref = nn.functional.conv2d(x, w, b, 2, 1, 1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last)
    w.mul_(2.0)  # an in-place write: packed again
    torch.testing.assert_close(conv(x, w, b, [2, 2], [1, 1], [1, 1], 2),
                               nn.functional.conv2d(x, w, b, 2, 1, 1, 2),
                               rtol=1e-5, atol=1e-5)


def test_a_convolution_as_the_output_keeps_its_values(stand_in):
    """The prepacked convolution returns channels-last results; as a user output they
    are the same values as eager PyTorch's."""
    torch.manual_seed(0)
    m = nn.Conv2d(3, 4, 3, padding=1).eval()
    opts = poptorch.Options().deviceIterations(2)
    opts.Backend.compiler("inductor")
    model = poptorch.inferenceModel(m, opts)
    x = torch.randn(4, 3, 5, 5)
    out = model(x)
    assert out.shape == (4, 4, 5, 5)
    torch.testing.assert_close(out, m(x).detach(), rtol=1e-5, atol=1e-5)
    assert any("onednn_conv2d" in t for gm in stand_in for t in _targets(gm))


def test_calls_under_inference_mode_run(stand_in):
    """Under ``torch.inference_mode`` (tensors without a version counter) the kernels
    run on the plain weights: same values."""
    m, model = _model()
    x = torch.randn(6, 3, 8, 8)
    with torch.inference_mode():
        out = model(x)
        again = model(x)
    torch.testing.assert_close(out, m(x).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    x_inf = torch.randn(2, 3, 8, 8)
    with torch.inference_mode():
        w = torch.randn(4, 3, 3, 3)
        out = torch.ops.popart_compiler.onednn_conv2d(x_inf, w, None, [1, 1], [1, 1],
                                                      [1, 1], 1)
        lin = torch.ops.popart_compiler.onednn_linear_packed(x_inf.flatten(1),
                                                             torch.randn(5, 192), None)
    torch.testing.assert_close(out, nn.functional.conv2d(x_inf, w, None, 1, 1),
                               rtol=1e-5, atol=1e-5)
    assert lin.shape == (2, 5)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 5)).eval()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_real_inductor_compilation_of_a_conv_chain_matches_eager():
    m = _cnn()
    opts = poptorch.Options().deviceIterations(2)
    opts.Backend.compiler("inductor")
    model = poptorch.inferenceModel(m, opts)
    x = torch.randn(32, 3, 16, 16)
    torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        m[3].weight.mul_(-2.0)
    model.copyWeightsToDevice()
    torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-5)


def test_a_cnn_runs_its_features_as_one_onednn_chain_and_follows_uploads(stand_in):
    """conv → relu → max_pool2d → conv → relu → max_pool2d (the benchmark's CNN):
    one ``onednn_conv_chain`` in the per-micro-batch graph (``aten.max_pool2d``) and
    in the vectorized one (``max_pool2d_with_indices``); uploaded weights are used at
    the next call without a recompilation."""
    m = _cnn()
    opts = poptorch.Options().deviceIterations(2)
    opts.Backend.compiler("inductor")
    model = poptorch.inferenceModel(m, opts)
    x = torch.randn(32, 3, 16, 16)  # 16 × 8 × 8 positions at the second convolution
    torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    chains = [n for gm in stand_in for n in gm.graph.nodes
              if str(n.target) == "popart_compiler.onednn_conv_chain.default"]
    assert len(chains) == len(stand_in) >= 1
    assert all(len(n.args[1]) == 2 for n in chains)  # both convolutions
    compiled = len(stand_in)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(-0.5).add_(0.05)
    model.copyWeightsToDevice()
    torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    assert len(stand_in) == compiled


class _Residual(nn.Module):
    """Two bottleneck-like blocks: a down-sampled one, then an identity one."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                                  nn.ReLU())
        self.a = nn.Sequential(nn.Conv2d(8, 16, 1), nn.BatchNorm2d(16))
        self.down = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2), nn.BatchNorm2d(16))
        self.b = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.c = nn.Sequential(nn.Conv2d(16, 16, 1), nn.BatchNorm2d(16), nn.ReLU(),
                               nn.Conv2d(16, 16, 1), nn.BatchNorm2d(16))
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = self.stem(x)
        y = torch.relu(self.a(x[:, :, ::2, ::2]) + self.down(x))
        y = torch.relu(self.b(y) + y)  # reads the residual: out of place
        y = torch.relu(self.c(y) + y)
        return self.fc(y.mean((2, 3)))


def _residual():
    torch.manual_seed(0)
    m = _Residual().eval()
    with torch.no_grad():
        for bn in (mod for mod in m.modules() if isinstance(mod, nn.BatchNorm2d)):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    opts = poptorch.Options().deviceIterations(2)
    opts.Backend.compiler("inductor")
    return m, poptorch.inferenceModel(m, opts)


def test_residual_sums_run_in_place_and_follow_uploads(stand_in):
    """The first and last residual sums accumulate into their residual in place
    (``onednn_conv2d_bn_sum_``); the middle one, whose convolution reads the residual
    too, runs out of place: eager's results, before and after an upload, without a
    recompilation."""
    m, model = _residual()
    x = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    targets = [t for gm in stand_in for t in _targets(gm)]
    assert targets.count("popart_compiler.onednn_conv2d_bn_sum_.default") == \
        2 * len(stand_in)
    compiled = len(stand_in)
    upload_new_weights(m, model, -1.5, 0.25)
    torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    assert len(stand_in) == compiled


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("make, batch", [(_model, 6), (_residual, 4)])
def test_real_inductor_compilation_uses_uploaded_weights(make, batch):
    """Real compilations (the prepacked convolutions; the in-place residual sums) match
    eager, before and after an upload, without recompiling."""
    m, model = make()
    assert_uploads_used_without_recompiling(m, model, torch.randn(batch, 3, 8, 8),
                                            inductor_backend.compile_count)
