"""Passes of the inductor backend on their own: the weight update with
``torch._foreach_*`` kernels (``StepSettings.foreach``) equals the per-weight update for
every optimizer kind using PyTorch's functional optimizers; the oneDNN linear rewrite."""
import pytest
import torch

from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.optim.device_optimizer import DeviceOptimizer, StepSettings


@pytest.mark.parametrize("kind,hyper", [
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False)),
    ("SGD", dict(lr=0.1)),
    ("Adam", dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)),
    ("AdamW", dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)),
    ("RMSprop", dict(lr=0.01, alpha=0.9, eps=1e-8, momentum=0.5, centered=True,
                     weight_decay=0.0)),
])
def test_foreach_update_equals_per_weight_update(kind, hyper):
    shapes = [(4, 3), (3,), (2, 2, 2)]
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    results = []
    for foreach in (False, True):
        desc = OptimizerDescription(kind, defaults=dict(hyper), groups=[], group_of={})
        params = [torch.ones(s) for s in shapes]
        opt = DeviceOptimizer(desc, [f"p{i}" for i in range(len(shapes))], params,
                              StepSettings(foreach=foreach))
        for step_grads in grads:
            opt.begin_step()
            opt.accumulate(0, 0, [g * opt.loss_scale for g in step_grads])
            opt.finish_step(params)
        results.append((params, opt.state_dict()))
    (p0, s0), (p1, s1) = results
    assert not torch.equal(p0[0], torch.ones(4, 3))
    for a, b in zip(p0, p1):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert s0.keys() == s1.keys()
    for k in s0:
        torch.testing.assert_close(s0[k], s1[k], rtol=1e-6, atol=1e-7)


def test_onednn_linear_pass_keeps_values():
    """The inductor backend's CPU inference pass: ``addmm`` / ``mm`` with a transposed
    weight become oneDNN linears with the same values; weights stay graph inputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from popart_compiler.backends.inductor import onednn_linear

    def fn(w1, b1, w2, x):
        return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1, b1)),
                                          w2)
    args = [torch.randn(16, 8), torch.randn(16), torch.randn(4, 16), torch.randn(5, 8)]
    gm = make_fx(fn)(*args)
    expected = fn(*args)
    gm = onednn_linear(gm)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    if torch.backends.mkldnn.is_available():
        assert "popart_compiler.onednn_linear.default" in targets
        assert not targets & {"aten.addmm.default", "aten.mm.default"}
    torch.testing.assert_close(gm(*args), expected, rtol=1e-5, atol=1e-5)
    args[0] = args[0] * 2  # a new weight value is used as is (not frozen)
    torch.testing.assert_close(gm(*args), fn(*args), rtol=1e-5, atol=1e-5)


def test_onednn_linear_takes_the_input_before_its_flattening():
    """A linear layer after a flatten (a CNN's classifier) gets the unflattened tensor:
    the op flattens it itself, so Inductor keeps the producing kernel vectorized in its
    own layout (issue 11: a flattened output made the pooling kernel scalar, 2 × slower
    than ``torch.compile``). Values equal the unrewritten graph, also for an input whose
    layout is not contiguous."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from popart_compiler.backends.inductor import onednn_linear

    def fn(w, b, x):
        return torch.nn.functional.linear(torch.relu(x).flatten(1), w, b)
    args = [torch.randn(10, 24), torch.randn(10), torch.randn(5, 2, 3, 4)]
    gm = make_fx(fn)(*args)
    gm = onednn_linear(gm)
    if torch.backends.mkldnn.is_available():
        (op,) = [n for n in gm.graph.nodes
                 if n.target is torch.ops.popart_compiler.onednn_linear.default]
        assert op.args[0].target is torch.ops.aten.relu.default
    torch.testing.assert_close(gm(*args), fn(*args), rtol=1e-5, atol=1e-5)
    channels_last = args[2].to(memory_format=torch.channels_last)
    torch.testing.assert_close(gm(args[0], args[1], channels_last), fn(*args),
                               rtol=1e-5, atol=1e-5)
    out = torch.ops.popart_compiler.onednn_linear(channels_last, args[0], args[1])
    assert out.shape == (5, 10)


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
    from popart_compiler.passes.vectorize import vectorize_graph as vectorize

    gen = torch.Generator().manual_seed(0)
    state = [torch.randn(4, 3, 3, 3, generator=gen), torch.randn(4, generator=gen),
             torch.randn(10, 4 * 4 * 4, generator=gen), torch.randn(10, generator=gen)]
    xs = torch.randn(6, 2, 3, 8, 8, generator=gen)
    gm = vectorize(_conv_pool_linear, state, [xs[0]], 6)
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


def test_view_collapse_keeps_a_view_with_other_users():
    """A pointwise op on a view that something else also reads stays after the view;
    a view that does not restore its source's shape stays."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from popart_compiler.passes.simplify import simplify

    def fn(x):
        v = x.view(3, 4)
        return torch.relu(v), v.sum(0), v.view(2, 6)
    x = torch.randn(12)
    gm = simplify(make_fx(fn, tracing_mode="fake")(x))
    aten = torch.ops.aten
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    assert relu.args[0].target is aten.view.default
    last = [n for n in gm.graph.nodes if n.target is aten.view.default][-1]
    assert last.args[0].op == "placeholder" and list(last.args[1]) == [2, 6]
    for a, b in zip(gm(x), fn(x)):
        torch.testing.assert_close(a, b)


def test_cpu_probe_runs_once_in_the_background_and_compilation_waits(monkeypatch):
    """Inductor's per-process CPU probe (``pick_vec_isa``, ~0.9 s of child processes)
    starts in a background thread when a CPU inductor compilation begins, once per
    process; compiling waits for it, so the probe never runs twice at once."""
    import threading

    from popart_compiler.backends import inductor as inductor_backend

    calls, release, waited = [], threading.Event(), threading.Event()

    def probe_cpu():  # stands for Inductor's probe (patching torch's own function
        # would leak into modules that import it by name)
        calls.append(threading.current_thread().name)
        release.wait(30)

    monkeypatch.setattr(inductor_backend, "_probe_cpu", probe_cpu)
    monkeypatch.setattr(inductor_backend, "_probe", None)
    inductor_backend.start_probing_cpu()
    inductor_backend.start_probing_cpu()  # a second compile: no second probe
    probe = inductor_backend._probe
    assert probe is not None and probe.daemon

    def compile_():
        inductor_backend._wait_for_probe()
        waited.set()
    waiter = threading.Thread(target=compile_)
    waiter.start()
    waiter.join(0.2)
    assert not waited.is_set()  # blocked by the probe
    release.set()
    waiter.join(30)
    probe.join(30)
    assert waited.is_set()
    assert calls == ["poptorch-inductor-isa-probe"]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("x_requires_grad", [False, True])
def test_onednn_linear_gradients_equal_autograd_of_linear(x_requires_grad):
    """Training graphs use the oneDNN linear too (``aten.linear``, here on a 3-D
    input): its gradients (oneDNN linears on transposed views) equal those of
    ``F.linear`` for the input, the weight and the bias."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from popart_compiler.backends.inductor import onednn_linear

    def fn(w, b, w2, x):
        return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w, b)),
                                          w2).sum(-1)
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(16, 8, generator=gen), torch.randn(16, generator=gen),
            torch.randn(4, 16, generator=gen), torch.randn(3, 5, 8, generator=gen)]
    gm = make_fx(fn, pre_dispatch=True)(*args)
    assert any(n.target is torch.ops.aten.linear.default for n in gm.graph.nodes)
    gm = onednn_linear(gm)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.popart_compiler.onednn_linear.default) == 2
    assert torch.ops.aten.linear.default not in ops
    grads = []
    for f in (fn, gm):
        leaves = [a.clone().requires_grad_(i < 3 or x_requires_grad)
                  for i, a in enumerate(args)]
        out = f(*leaves)
        assert out.shape == (3, 5)
        out.backward(torch.randn(3, 5, generator=torch.Generator().manual_seed(1)))
        grads.append([leaf.grad for leaf in leaves])
    for a, b in zip(*grads):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
