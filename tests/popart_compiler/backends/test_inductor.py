"""The inductor backend (backends/inductor.py) on its own: the oneDNN linear rewrite
(values, gradients, biases oneDNN cannot read) and the background probe of the CPU."""
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from popart_compiler.backends import inductor as inductor_backend
from popart_compiler.backends.inductor import onednn_linear


def test_onednn_linear_pass_keeps_values():
    """The inductor backend's CPU inference pass: ``addmm`` / ``mm`` with a transposed
    weight become oneDNN linears with the same values; weights stay graph inputs."""
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


def test_cpu_probe_runs_once_in_the_background_and_compilation_waits(monkeypatch):
    """Inductor's per-process CPU probe (``pick_vec_isa``, ~0.9 s of child processes)
    starts in a background thread when a CPU inductor compilation begins, once per
    process; compiling waits for it, so the probe never runs twice at once."""
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


def _linears(w, b_wide, shift, x):
    """A strided bias, an expanded bias and a broadcast (shape (1,)) bias."""
    return (F.linear(x, w, b_wide[::2]) + F.linear(x, w, b_wide[:1].expand(4))
            + F.linear(x, w, shift))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_onednn_linear_with_a_strided_expanded_or_broadcast_bias():
    """oneDNN reads only a dense bias: a strided (``b[::2]``) or expanded one gave wrong
    sums (2.45 and 0.94 off) and a broadcast one of shape (1,) raised "could not create
    a primitive descriptor". The first two are rewritten (the op makes the bias dense),
    the broadcast one is left to ``aten.linear``; values and gradients equal
    ``F.linear``'s."""
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(4, 8, generator=gen), torch.randn(8, generator=gen),
            torch.randn(1, generator=gen), torch.randn(6, 8, generator=gen)]
    gm = inductor_backend.onednn_linear(make_fx(_linears, pre_dispatch=True)(*args))
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.popart_compiler.onednn_linear.default) == 2
    assert ops.count(torch.ops.aten.linear.default) == 1  # the broadcast bias
    grads = []
    for fn in (_linears, gm):
        leaves = [a.clone().requires_grad_() for a in args]
        out = fn(*leaves)
        out.sum().backward()
        grads.append((out.detach(), [leaf.grad for leaf in leaves]))
    (ref, ref_grads), (got, got_grads) = grads
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
