"""``vectorize`` (passes/vectorize.py): stateless inference over the micro-batches of a
run as one graph (``torch.func.vmap`` traced by ``make_fx``), in chunks that keep the
largest intermediate within ``VECTORIZE_BUDGET``; the per-micro-batch graph is
unchanged, and nothing is vectorized where a loop is needed."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from models import MLP, BNClassifier, export
from popart_compiler import compiler
from popart_compiler.ir import register_per_micro_batch_op
from popart_compiler.passes import vectorize as vectorize_module
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.vectorize import chunk_size, vectorize, vectorize_graph
from popart_compiler.runtime.session import InferenceSession
from popart_compiler.session_options import SessionOptions


def test_stateless_inference_gets_a_vectorized_graph(run_pass):
    model = MLP()
    g = export(model, torch.randn(2, 4))
    before = g.module.code
    c = Compilation(SessionOptions(device_iterations=3, replication_factor=2), False)
    result = run_pass(vectorize, g, c)
    assert result.graph is g and result.changed is False and g.module.code == before
    c = result.compilation
    assert isinstance(c.vectorized, fx.GraphModule) and c.vectorized_slots == 6
    x = torch.randn(6, 2, 4)
    state = [p.detach() for p in model.parameters()]
    out = c.vectorized(*state, x)
    out = out[0] if isinstance(out, (list, tuple)) else out
    assert out.shape == (6, 2, 3)
    torch.testing.assert_close(out, model(x).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options,training,module", [
    (SessionOptions(device_iterations=4), True, MLP()),
    (SessionOptions(), False, MLP()),  # one micro-batch
    (SessionOptions(device_iterations=4, synthetic_data=True), False, MLP()),
    (SessionOptions(device_iterations=4, fp_exceptions=True), False, MLP()),
    (SessionOptions(device_iterations=4), False, BNClassifier().train()),  # writes state
], ids=["training", "one_micro_batch", "synthetic", "fp_exceptions", "mutated_buffers"])
def test_nothing_is_vectorized_where_the_session_loops(run_pass, options, training, module):
    args = (torch.randn(4, 4), torch.tensor([0, 1, 2, 0])) \
        if isinstance(module, BNClassifier) else (torch.randn(2, 4),)
    c = Compilation(options, training)
    result = run_pass(vectorize, export(module, *args), c)
    c = result.compilation
    assert result.changed is False
    assert c.vectorized is None and c.vectorized_slots == 1


def test_several_stages_are_not_vectorized(run_pass):
    # split_stages ran and found several stages
    c = Compilation(SessionOptions(device_iterations=4), False, stages=object())
    c = run_pass(vectorize, export(MLP(), torch.randn(2, 4)), c).compilation
    assert c.vectorized is None


def test_chunk_size_is_the_largest_divisor_within_the_budget(monkeypatch):
    g = export(MLP(), torch.randn(2, 4))  # largest tensor: [2, 8] float32 = 64 bytes
    assert chunk_size(g, 6) == 6
    monkeypatch.setattr(vectorize_module, "VECTORIZE_BUDGET", 64 * 4)
    assert chunk_size(g, 6) == 3 and chunk_size(g, 8) == 4 and chunk_size(g, 7) == 1
    monkeypatch.setattr(vectorize_module, "VECTORIZE_BUDGET", 10)
    assert chunk_size(g, 6) == 1


def test_vectorized_inference_runs_in_cache_sized_chunks(monkeypatch):
    """Stateless inference runs several micro-batches per call; the chunk is the largest
    divisor of D × R keeping the largest intermediate within the budget."""
    m = MLP()
    x = torch.randn(6 * 2, 4)  # D=6, B=2; largest intermediate: [2, 8] float32 = 64 bytes
    monkeypatch.setattr(vectorize_module, "VECTORIZE_BUDGET", 64 * 3)
    exe = compiler.compile(export(m, x[:2]), SessionOptions(device_iterations=6), False)
    assert exe.vectorized is not None and exe.vectorized_slots == 3
    (out,) = InferenceSession(exe).run([x])
    torch.testing.assert_close(out, m(x).detach(), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(vectorize_module, "VECTORIZE_BUDGET", 10)
    exe = compiler.compile(export(m, x[:2]), SessionOptions(device_iterations=6), False)
    assert exe.vectorized is None  # one micro-batch at a time
    torch.testing.assert_close(InferenceSession(exe).run([x])[0], m(x).detach(),
                               rtol=1e-5, atol=1e-6)


def test_per_micro_batch_ops_are_never_vectorised():
    class Model(nn.Module):
        def forward(self, x):
            return torch.ops.test_steering.side_effect(x) + 1

    lib = torch.library.Library("test_steering", "FRAGMENT")
    lib.define("side_effect(Tensor x) -> Tensor")
    lib.impl("side_effect", lambda x: x.clone(), "CompositeExplicitAutograd")
    torch.library.register_fake("test_steering::side_effect", torch.empty_like, lib=lib)
    # a batching rule, so that vmap (which never falls back to a per-slice loop) can
    # vectorise the op until it is registered as per-micro-batch
    torch.library.register_vmap("test_steering::side_effect",
                                lambda info, in_dims, x: (x.clone(), in_dims[0]), lib=lib)
    options = SessionOptions(device_iterations=4)
    assert compiler.compile(export(Model(), torch.randn(3)), options,
                            training=False).vectorized is not None
    register_per_micro_batch_op("test_steering::side_effect")
    graph = export(Model(), torch.randn(3))
    assert graph.runs_per_micro_batch()
    assert compiler.compile(graph, options, training=False).vectorized is None


def _conv_pool_linear(w1, b1, w2, b2, x):
    """Per micro-batch: conv, relu, pool, flatten, linear, and a GELU on a view."""
    F = torch.nn.functional
    h = F.max_pool2d(torch.relu(F.conv2d(x, w1, b1, padding=1)), 2)
    return F.gelu(F.linear(h.flatten(1), w2, b2)).reshape(-1, 2, 5)


def test_vectorized_graph_has_no_view_round_trips():
    """vmap folds the micro-batch dimension into the batch around each op and unfolds
    it after; ``simplify`` drops those round trips (identity permutes, a view undone by
    the next one, a unary op between them), so the vectorized CNN graph is the graph
    over the combined batch: the first view is of the input, the next view the
    flatten. Values equal the per-micro-batch loop."""
    gen = torch.Generator().manual_seed(0)
    state = [torch.randn(4, 3, 3, 3, generator=gen), torch.randn(4, generator=gen),
             torch.randn(10, 4 * 4 * 4, generator=gen), torch.randn(10, generator=gen)]
    xs = torch.randn(6, 2, 3, 8, 8, generator=gen)
    gm = vectorize_graph(_conv_pool_linear, state, [xs[0]], 6)
    aten = torch.ops.aten
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert not any(n.target is aten.permute.default for n in nodes)
    views = [n for n in nodes if n.target in (aten.view.default, aten._unsafe_view.default)]
    shapes = [tuple(n.meta["val"].shape) for n in views]
    assert shapes[:2] == [(12, 3, 8, 8), (12, 64)]  # the fold of the input, the flatten
    # relu and gelu moved onto the folded tensors: no view feeds a pointwise op
    for n in nodes:
        if n.target in (aten.relu.default, aten.gelu.default):
            assert n.args[0].target not in (aten.view.default, aten._unsafe_view.default)
            assert n.meta["val"].shape[0] == 12
    out = gm(*state, xs)
    out = out[0] if isinstance(out, (list, tuple)) else out
    expected = torch.stack([_conv_pool_linear(*state, x) for x in xs])
    assert out.shape == (6, 2, 2, 5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


class _ConvBN(nn.Module):
    """conv → BatchNorm2d → relu → flatten → BatchNorm1d (affine off) → linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.bn1d = nn.BatchNorm1d(64, affine=False)
        self.fc = nn.Linear(64, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(self.bn1d(h.flatten(1)))


def test_inference_batch_norms_fold_the_micro_batches_into_the_batch():
    """vmap's own batch-norm rule moves the micro-batch dimension into the channels
    (a transposing copy of the activations on each side); the vectorized graph instead
    runs ``aten.batch_norm`` on the folded batch, as the per-micro-batch graph does, and
    gives the per-micro-batch results."""
    torch.manual_seed(0)
    model = _ConvBN().eval()
    with torch.no_grad():
        for bn in (model.bn, model.bn1d):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    g = export(model, torch.randn(2, 3, 4, 4))
    state = [g.state_values()[n].detach() for n in g.parameters + g.buffers + g.constants]
    xs = torch.randn(3, 2, 3, 4, 4)
    gm = vectorize_graph(g.module, state, [xs[0]], 3)
    aten = torch.ops.aten
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(aten.batch_norm.default) == 2
    for gone in (aten.transpose.int, aten.permute.default, aten.clone.default,
                 aten.native_batch_norm.default):
        assert gone not in targets
    bns = [n for n in gm.graph.nodes if n.target is aten.batch_norm.default]
    assert [tuple(n.meta["val"].shape) for n in bns] == [(6, 4, 4, 4), (6, 64)]
    out = gm(*state, xs)
    out = out[0] if isinstance(out, (list, tuple)) else out
    with torch.no_grad():
        expected = torch.stack([model(x) for x in xs])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


class _InputStatistics(nn.Module):
    def forward(self, x, mean, var):
        return nn.functional.batch_norm(x, mean, var, training=False)


def test_batch_norm_statistics_from_the_inputs_stay_per_micro_batch():
    """Statistics that are user inputs differ between micro-batches: the rule writes the
    normalization out with each micro-batch's statistics (no folding), and the
    vectorized graph gives the per-micro-batch results."""
    g = export(_InputStatistics(), torch.randn(2, 3, 2, 2), torch.randn(3), torch.ones(3))
    xs, means, vars_ = torch.randn(4, 2, 3, 2, 2), torch.randn(4, 3), torch.rand(4, 3) + 0.5
    gm = vectorize_graph(g.module, [], [xs[0], means[0], vars_[0]], 4)
    assert gm is not None
    out = gm(xs, means, vars_)
    out = out[0] if isinstance(out, (list, tuple)) else out
    expected = torch.stack([nn.functional.batch_norm(x, m, v)
                            for x, m, v in zip(xs, means, vars_)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    exe = compiler.compile(g, SessionOptions(device_iterations=4), False)
    assert exe.vectorized is not None
    (got,) = InferenceSession(exe).run([xs.flatten(0, 1), means.flatten(), vars_.flatten()])
    torch.testing.assert_close(got, expected.flatten(0, 1), rtol=1e-5, atol=1e-5)
