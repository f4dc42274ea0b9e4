"""popart_compiler on its own: graph in (a torch.export program), outputs out.

Nothing here imports ``poptorch``.
"""
import copy
import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from popart_compiler import compiler
from popart_compiler.enums import OutputMode
from popart_compiler.errors import Error, RecoverableError, UnrecoverableError
from popart_compiler.cost.ipu_model import TARGETS
from popart_compiler.runtime.device import acquire_device
from popart_compiler.ir import Graph
from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.optim.device_optimizer import DeviceOptimizer
from popart_compiler.runtime.session import InferenceSession, reduce_output
from popart_compiler.runtime.training import TrainingSession
from popart_compiler.session_options import Anchor, SessionOptions


def export(module, *args):
    return Graph(torch.export.export(module, args, strict=False))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class WithLoss(MLP):
    def forward(self, x, t):
        out = super().forward(x)
        return out, F.cross_entropy(out, t)


def sgd(lr=0.1, **group):
    return OptimizerDescription("SGD", defaults=dict(lr=lr, **group), groups=[],
                                group_of={})


def test_package_does_not_import_poptorch():
    code = ("import sys, popart_compiler, popart_compiler.runtime.session, popart_compiler.compiler;"
            "assert 'poptorch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_graph_analysis():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)
            self.register_buffer("count", torch.zeros(()))
            self.const = torch.ones(3)

        def forward(self, x, y):
            self.count += 1
            y.mul_(2)
            return F.dropout(self.bn(x), 0.5) + self.const, F.mse_loss(x, y)

    g = export(M().train(), torch.randn(2, 3), torch.randn(2, 3))
    assert g.parameters == ["bn.weight", "bn.bias"]
    assert sorted(g.buffers) == ["bn.num_batches_tracked", "bn.running_mean",
                                 "bn.running_var", "count"]
    assert g.constants == ["const"]
    assert g.mutated_buffers == {"bn.running_mean", "bn.running_var",
                                 "bn.num_batches_tracked", "count"}
    assert g.mutated_inputs == {1}
    assert g.random
    assert [n.name for n in g.final_losses()] == ["mse_loss"]
    assert g.num_user_inputs == 2 and g.num_user_outputs == 2
    names = g.activation_names()
    assert "bn/BatchNorm:0" in names and "Dropout:0" in names


def test_inference_session_output_modes():
    m = MLP()
    x = torch.randn(6 * 2, 4)  # D=6, B=2
    ref = m(x).detach().reshape(6, 2, 3)
    for mode, period, expected in [
        (2, 1, ref.reshape(12, 3)),
        (1, 3, ref[[2, 5]].reshape(4, 3)),
        (0, 1, ref[5]),
        (3, 1, ref.sum(0)),
    ]:
        g = export(m, x[:2])
        opts = SessionOptions(device_iterations=6, output_mode=mode, output_return_period=period)
        session = InferenceSession(compiler.compile(g, opts, training=False))
        (out,) = session.run([x])
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_replicas_and_input_groups():
    class Id(nn.Module):
        def forward(self, x):
            return x * 1

    x = torch.arange(4.).reshape(4, 1)  # D=2, G=2, B=1
    opts = SessionOptions(device_iterations=2, replication_factor=4, input_group_size=2,
                          input_group_type=1)
    session = InferenceSession(compiler.compile(export(Id(), x[:1]), opts, training=False))
    (out,) = session.run([x])
    assert out.flatten().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_reduce_output_scalar_rules():
    t = torch.arange(6.).reshape(3, 1, 2)  # D=3, A=1, R=2, scalar outputs
    assert reduce_output(t, OutputMode.All).tolist() == [0, 1, 2, 3, 4, 5]
    assert reduce_output(t, OutputMode.Final).tolist() == [4, 5]
    assert reduce_output(t[:, :, :1], OutputMode.Final).shape == ()
    assert reduce_output(t, OutputMode.Sum).tolist() == [6, 9]
    assert reduce_output(t.int(), OutputMode.Sum).dtype == torch.int32


def test_training_session_matches_manual_loop():
    m = WithLoss()
    ref = copy.deepcopy(m)
    d, a = 2, 3
    x, t = torch.randn(d * a * 2, 4), torch.randint(0, 3, (d * a * 2,))
    g = export(m, x[:2], t[:2])
    opts = SessionOptions(device_iterations=d, gradient_accumulation=a, output_mode=2)
    session = TrainingSession(compiler.compile(g, opts, training=True), None,
                              sgd(0.1, momentum=0.9))
    out, loss = session.run([x, t])
    assert out.shape == (12, 3) and loss.shape == (6,)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for i in range(d):
        opt.zero_grad()
        for s in range(a):
            row = (i * a + s) * 2
            l = ref(x[row:row + 2], t[row:row + 2])[1]
            (l / a).backward()
            losses.append(l.detach())
        opt.step()
    torch.testing.assert_close(loss, torch.stack(losses), rtol=1e-5, atol=1e-6)
    weights = session.readWeights()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6)
    # velocity and (A > 1) gradient accumulator of every weight (S-56)
    assert set(session.readOptimizerState()) == {
        f"{kind}___{n}" for n, _ in ref.named_parameters() for kind in ("Accl", "Accum")}


def test_compile_errors():
    class NoLoss(MLP):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(Error, match="Couldn't find a loss in graph!") as info:
        compiler.compile(export(NoLoss(), torch.randn(2, 4)), SessionOptions(), training=True)
    assert info.value.type == "poptorch_cpp_error"
    # rendered as PopTorch users read it: no file of the simulator in the text
    assert str(info.value).startswith("'poptorch_cpp_error': Couldn't find a loss")
    assert ".py" not in str(info.value) and type(info.value).__module__ == "poptorch"
    with pytest.raises(Error, match="Return period must be <= to the number of batches"):
        compiler.compile(export(MLP(), torch.randn(2, 4)),
                         SessionOptions(device_iterations=2, output_mode=1,
                                        output_return_period=4), training=False)
    with pytest.raises(Error, match="must be a factor of the number of batches"):
        compiler.compile(export(MLP(), torch.randn(2, 4)),
                         SessionOptions(device_iterations=6, output_mode=1,
                                        output_return_period=4), training=False)
    with pytest.raises(Error, match="Gradient accumulation must be 1"):
        compiler.compile(export(MLP(), torch.randn(2, 4)),
                         SessionOptions(gradient_accumulation=2), training=False)
    with pytest.raises(Error, match="Invalid distributed process 2 of 2"):
        compiler.compile(export(WithLoss(), torch.randn(2, 4), torch.zeros(2).long()),
                         SessionOptions(num_processes=2, process_id=2), training=True)
    with pytest.raises(Error, match="Anchored tensor nope not found"):
        compiler.compile(export(MLP(), torch.randn(2, 4)),
                         SessionOptions(anchors=[Anchor("nope", 2)]), training=False)


def test_session_options_validation():
    opts = SessionOptions.from_dict({"device_iterations": 4, "output_mode": 2,
                                     "enableStochasticRounding": True,
                                     "engineOptions": {"a": "b"}})
    assert opts.device_iterations == 4 and opts.batch_factor == 4
    with pytest.raises(Error, match="Unknown bool option notAnOption"):
        SessionOptions.from_dict({"notAnOption": True})
    with pytest.raises(Error, match="Unknown uint64 option enableStableNorm"):
        SessionOptions.from_dict({"enableStableNorm": 3})
    with pytest.raises(Error, match="Unknown value type <class 'torch.Tensor'> for option x"):
        SessionOptions.from_dict({"x": torch.ones(1)})
    with pytest.raises(Error, match="Value for VirtualGraphMode out of range"):
        SessionOptions.from_dict({"virtualGraphMode": 9})


def test_ipu_model_device_selection(monkeypatch):
    device = acquire_device(2, "ipu21")
    assert device.num_ipus == 2 and device.target.clock_hz == 1.85e9
    assert TARGETS["ipu2"].memory_bytes == 1472 * 624 * 1024
    assert acquire_device(1, small=True).memory_per_ipu == 4 * 624 * 1024
    with pytest.raises(Error, match=r"Too many IPUs requested \(128\)"):
        acquire_device(128)
    with pytest.raises(Error, match=r"Failed to acquire 1 IPU\(s\)"):
        acquire_device(1, use_ipu_model=False)
    with pytest.raises(Error, match="not supported for the IPU model"):
        acquire_device(1, offline=True, explicit_model_request=True)
    assert acquire_device(1, offline=True) is None
    monkeypatch.setenv("POPTORCH_IPU_MODEL_VERSION", "ipu9")
    with pytest.raises(Error, match="Invalid IPU model version. Valid versions: ipu1, ipu2, "
                                    "ipu21."):
        SessionOptions.from_dict({})


def test_rng_state_roundtrip_and_seed():
    class Drop(nn.Module):  # dropout is the identity in inference sessions (S-34)
        def forward(self, x):
            return x * (torch.rand_like(x) > 0.5)

    g = export(Drop(), torch.ones(100))
    session = InferenceSession(compiler.compile(g, SessionOptions(random_seed=7), False))
    state = session.getRngState()
    assert state[0] == 7
    a = session.run([torch.ones(100)])[0]
    session.setRngState(state)
    b = session.run([torch.ones(100)])[0]
    c = session.run([torch.ones(100)])[0]
    assert torch.equal(a, b) and not torch.equal(b, c)
    host = torch.get_rng_state()
    session.run([torch.ones(100)])
    assert torch.equal(host, torch.get_rng_state())  # the host RNG is not touched
    plain = InferenceSession(compiler.compile(export(MLP(), torch.ones(1, 4)),
                                              SessionOptions(), False))
    assert plain.getRngState() == [0]


@pytest.mark.parametrize("kind,torch_cls,hyper", [
    ("SGD", torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01,
                                  nesterov=False)),
    ("Adam", torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6,
                                    weight_decay=0.01)),
    ("AdamW", torch.optim.AdamW, dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8,
                                      weight_decay=0.05)),
    ("RMSprop", torch.optim.RMSprop, dict(lr=0.01, alpha=0.9, eps=1e-8, weight_decay=0.0,
                                          momentum=0.5, centered=True)),
])
def test_device_optimizers_equal_torch_optim(kind, torch_cls, hyper):
    torch.manual_seed(1)
    params = [torch.randn(5, 3), torch.randn(3)]
    ref = [p.clone().requires_grad_() for p in params]
    desc = OptimizerDescription(kind, defaults=dict(hyper), groups=[], group_of={})
    opt = DeviceOptimizer(desc, ["w", "b"], params)
    ref_opt = torch_cls(ref, **hyper)
    for _ in range(10):
        grads = [torch.randn_like(p) for p in params]
        opt.step(params, grads)
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        ref_opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)


def test_sgd_dampening_without_momentum_scales_the_step():
    p = [torch.ones(2)]
    opt = DeviceOptimizer(sgd(0.5, momentum=0.0, dampening=0.5), ["w"], p)
    opt.step(p, [torch.ones(2)])
    assert p[0].tolist() == [0.75, 0.75]  # lr * (1 - dampening) (S-54 quirk)


def test_lamb_follows_the_formula():
    w = torch.tensor([3.0, 4.0])
    desc = OptimizerDescription("LAMB", defaults=dict(lr=0.1, betas=(0.9, 0.999), eps=0.0,
                                                      weight_decay=0.0,
                                                      max_weight_norm=65500.0),
                                groups=[], group_of={})
    opt = DeviceOptimizer(desc, ["w"], [w])
    g = torch.tensor([1.0, -2.0])
    opt.step([w], [g])
    # step 1 with bias correction: m̂ = g, v̂ = g², u = sign(g); trust = ‖w‖ / ‖u‖
    u = torch.sign(g)
    expected = torch.tensor([3.0, 4.0]) - 0.1 * (5.0 / math.sqrt(2.0)) * u
    torch.testing.assert_close(w, expected)


def test_optimizer_changes_needing_recompilation():
    p = [torch.ones(2)]
    desc = sgd(0.1)
    desc.constant = {"momentum"}
    opt = DeviceOptimizer(desc, ["w"], p)
    variable = copy.deepcopy(desc)
    variable.defaults["lr"] = 0.2
    opt.update(variable)
    changed = copy.deepcopy(desc)
    changed.defaults["momentum"] = 0.5
    with pytest.raises(Error, match="compiled optimizer cannot be changed"):
        opt.update(changed)
    with pytest.raises(Error, match="Maximum norm of gradients cannot be NaN"):
        bad = copy.deepcopy(desc)
        bad.max_grad_norm = float("nan")
        DeviceOptimizer(bad, ["w"], p).step(p, [torch.ones(2)])


def test_error_classes():
    e = Error("boom", "popart_exception", "frame 1\nframe 2")
    assert e.message == "boom" and e.location == "frame 1\nframe 2"
    assert "Error raised in:\nframe 1" in str(e)
    assert isinstance(RecoverableError("x"), Error)
    assert isinstance(UnrecoverableError("x"), Error)
    with pytest.raises(ValueError):
        RecoverableError("x", recovery_action="REBOOT")
    import pickle
    again = pickle.loads(pickle.dumps(e))
    assert again.message == "boom" and str(again) == str(e)


def test_long_messages_spill_to_a_log_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    e = Error("\n".join(str(i) for i in range(100)))
    assert e.message == "See poptorch_error.log for details"
    assert (tmp_path / "poptorch_error.log").read_text().startswith("0\n1\n")


def test_vectorized_inference_runs_in_cache_sized_chunks(monkeypatch):
    """Stateless inference runs several micro-batches per call; the chunk is the largest
    divisor of D × R keeping the largest intermediate within the budget."""
    from popart_compiler.passes import vectorize
    m = MLP()
    x = torch.randn(6 * 2, 4)  # D=6, B=2; largest intermediate: [2, 8] float32 = 64 bytes
    monkeypatch.setattr(vectorize, "VECTORIZE_BUDGET", 64 * 3)
    exe = compiler.compile(export(m, x[:2]), SessionOptions(device_iterations=6), False)
    assert exe.vectorized is not None and exe.vectorized_slots == 3
    (out,) = InferenceSession(exe).run([x])
    torch.testing.assert_close(out, m(x).detach(), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(vectorize, "VECTORIZE_BUDGET", 10)
    exe = compiler.compile(export(m, x[:2]), SessionOptions(device_iterations=6), False)
    assert exe.vectorized is None  # one micro-batch at a time
    torch.testing.assert_close(InferenceSession(exe).run([x])[0], m(x).detach(),
                               rtol=1e-5, atol=1e-6)
