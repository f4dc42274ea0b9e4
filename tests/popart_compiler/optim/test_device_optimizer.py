"""The device optimizer (optim/device_optimizer.py) on its own: accumulation and
reductions (docs/semantics.md S-41), the update rules against ``torch.optim``
(docs/semantics.md S-54), the ``foreach`` update, loss scaling (docs/semantics.md S-51, S-57),
replica-grouped weights (docs/semantics.md S-27), changes that need a recompilation, and the same
updates on CUDA. Nothing here imports ``poptorch``."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from popart_compiler import compiler
from popart_compiler.errors import Error
from popart_compiler.ir import Graph
from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.optim.device_optimizer import DeviceOptimizer, StepSettings
from popart_compiler.runtime.training import TrainingSession
from popart_compiler.session_options import ReplicaGrouping, SessionOptions


def description(kind="SGD", **hyper):
    return OptimizerDescription(kind, defaults=dict(hyper), groups=[], group_of={})


def run_updates(desc, settings, params, micro_grads, steps):
    """Feed ``steps`` updates of A × R micro-batch gradients (scaled by the loss
    scale) through the accumulate API."""
    opt = DeviceOptimizer(desc, [f"p{i}" for i in range(len(params))], params, settings)
    for step in range(steps):
        opt.begin_step()
        for a in range(settings.accumulation):
            for r in range(settings.replicas):
                opt.accumulate(r, a, [g[step][a][r] * opt.loss_scale for g in micro_grads])
        opt.finish_step(params)
    return opt


def random_grads(shapes, steps, a, r, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[[[torch.randn(s, generator=gen) for _ in range(r)] for _ in range(a)]
             for _ in range(steps)] for s in shapes]


@pytest.mark.parametrize("combined", [False, True])
@pytest.mark.parametrize("running", [False, True])
def test_sgd_variants_and_strategies_equal_torch(combined, running):
    """A=3, R=2, Mean, 10 updates, loss scaling 8, velocity scaling 4: both SGD variants
    and both mean strategies equal torch.optim.SGD on the mean gradient (rtol 1e-5)."""
    shapes = [(4, 3), (3,)]
    steps, a, r = 10, 3, 2
    grads = random_grads(shapes, steps, a, r)
    hyper = dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01, nesterov=False,
                 velocity_scaling=4.0)
    desc = description(**hyper)
    desc.use_combined_accum = combined
    desc.loss_scaling = 8.0
    params = [torch.ones(s) for s in shapes]
    ref = [p.clone().requires_grad_() for p in params]
    run_updates(desc, StepSettings(accumulation=a, replicas=r, global_replicas=r,
                                   running=running), params, grads, steps)
    hyper.pop("velocity_scaling")
    ref_opt = torch.optim.SGD(ref, **hyper)
    for step in range(steps):
        for p, g in zip(ref, grads):
            p.grad = sum(g[step][i][j] for i in range(a) for j in range(r)) / (a * r)
        ref_opt.step()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6)


def test_running_mean_formula_in_float16():
    """Running: acc ← acc·k/(k+1) + g/(k+1), evaluated in float32 and rounded to
    float16 once per micro-batch."""
    a = 5
    gen = torch.Generator().manual_seed(3)
    grads = [(torch.rand(6, generator=gen) * 1000).half() for _ in range(a)]
    desc = description(lr=1.0)
    desc.accum_type = torch.float16
    w = torch.zeros(6, dtype=torch.float16)
    opt = DeviceOptimizer(desc, ["w"], [w], StepSettings(accumulation=a, running=True))
    opt.begin_step()
    for k, g in enumerate(grads):
        opt.accumulate(0, k, [g])
    applied = opt.finish_step([w])[0]
    expected = torch.zeros(6, dtype=torch.float16)
    for k, g in enumerate(grads):
        expected = (expected.float() * (k / (k + 1.0)) + g.float() * (1.0 / (k + 1.0))).half()
    assert torch.equal(applied, expected.float())
    assert torch.equal(w, (-expected.float()).half())


def test_post_mean_overflows_float16_accumulators_where_running_does_not():
    grads = [torch.full((2,), 12000.0, dtype=torch.float16)] * 8
    results = {}
    for running in (False, True):
        desc = description(lr=1.0)
        desc.accum_type = torch.float16
        w = torch.zeros(2)
        opt = DeviceOptimizer(desc, ["w"], [w], StepSettings(accumulation=8, running=running))
        opt.begin_step()
        for k, g in enumerate(grads):
            opt.accumulate(0, k, [g])
        results[running] = opt.finish_step([w])[0]
    assert math.isinf(results[False][0])  # 96000 > 65504
    assert results[True].tolist() == [12000.0, 12000.0]


def test_sum_reduction_does_not_divide():
    desc = description(lr=1.0)
    w = torch.zeros(2)
    opt = DeviceOptimizer(desc, ["w"], [w], StepSettings(accumulation=2, replicas=2,
                                                         global_replicas=2, mean=False))
    opt.begin_step()
    for a in range(2):
        for r in range(2):
            opt.accumulate(r, a, [torch.ones(2)])
    assert opt.finish_step([w])[0].tolist() == [4.0, 4.0]


@pytest.mark.parametrize("running", [False, True])
def test_grouped_weights_reduce_within_groups_and_divide_by_a_times_r(running):
    """docs/semantics.md S-27/S-41: Orthogonal groups of 2 over R=4: W[g] gets the sum of its
    replicas' gradients / (A × R)."""
    r, a = 4, 2
    groups = [0, 1, 0, 1]
    w = torch.zeros(2, 3)
    desc = description(lr=1.0)
    opt = DeviceOptimizer(desc, ["w"], [w], StepSettings(
        accumulation=a, replicas=r, global_replicas=r, running=running,
        replica_groups={"w": groups}))
    opt.begin_step()
    for step in range(a):
        for rep in range(r):
            opt.accumulate(rep, step, [torch.full((3,), float(rep + 1))])
    applied = opt.finish_step([w])[0]
    expected = torch.stack([torch.full((3,), (1 + 3) * a / (a * r)),
                            torch.full((3,), (2 + 4) * a / (a * r))])
    torch.testing.assert_close(applied, expected)
    torch.testing.assert_close(w, -expected)


def test_lamb_trust_ratio_is_per_group_for_grouped_weights():
    w = torch.tensor([[3.0, 4.0], [6.0, 8.0]])
    desc = description("LAMB", lr=0.1, betas=(0.9, 0.999), eps=0.0, weight_decay=0.0,
                       max_weight_norm=65500.0)
    opt = DeviceOptimizer(desc, ["w"], [w], StepSettings(replicas=2, global_replicas=2,
                                                         replica_groups={"w": [0, 1]}))
    g = torch.tensor([[1.0, -2.0], [1.0, -2.0]])
    opt.step([w], [g])
    u = torch.sign(g[0])  # first step with bias correction: u = sign(g)
    torch.testing.assert_close(w[0], torch.tensor([3.0, 4.0]) - 0.1 * (5 / math.sqrt(2)) * u)
    torch.testing.assert_close(w[1], torch.tensor([6.0, 8.0]) - 0.1 * (10 / math.sqrt(2)) * u)


def test_rmsprop_tensorflow_variant():
    """docs/semantics.md S-54: square average starts at 1, eps inside the sqrt, lr in the
    momentum."""
    w = torch.tensor([1.0, 2.0])
    desc = description("RMSprop", lr=0.1, alpha=0.9, eps=1e-3, weight_decay=0.0,
                       momentum=0.5, centered=False)
    desc.use_tf_variant = True
    opt = DeviceOptimizer(desc, ["w"], [w])
    assert opt.state["Accl1___w"].tolist() == [1.0, 1.0]
    g = torch.tensor([0.5, -1.0])
    ms, mom, ref = torch.ones(2), torch.zeros(2), torch.tensor([1.0, 2.0])
    for _ in range(3):
        opt.step([w], [g])
        ms = 0.9 * ms + 0.1 * g * g
        mom = 0.5 * mom + 0.1 * g / torch.sqrt(ms + 1e-3)
        ref = ref - mom
    torch.testing.assert_close(w, ref)


def test_automatic_loss_scaling_rule():
    desc = description(lr=0.0)
    desc.loss_scaling = 128.0
    w = torch.zeros(3, dtype=torch.float16)
    f32 = torch.zeros(3)
    opt = DeviceOptimizer(desc, ["w", "f"], [w, f32], StepSettings(
        auto_loss_scaling=True, als_update_period=2))

    def update(value16, value32=1e30):
        opt.begin_step()
        opt.accumulate(0, 0, [torch.full((3,), value16, dtype=torch.float16),
                              torch.full((3,), value32)])
        opt.finish_step([w, f32])
        return opt.state["lossScaleUpdateFactor"].item()

    assert opt.loss_scale == 128.0
    assert update(1.0) == 1.0      # period 2: no change after the first update
    assert update(9000.0) == 0.5   # top bin (≥ 8188) in the period → halve
    assert update(1.0) == 0.5
    assert update(float("inf")) == 0.25  # overflow → halve
    assert update(1.0) == 0.25
    assert update(1.0) == 0.5      # quiet period; huge float32 gradients never count
    assert opt.loss_scale == 64.0
    assert "lossScaleUpdateFactor" in opt.state_dict()


def test_check_update_names_what_changed_and_keeps_the_description():
    desc = description(lr=0.1, momentum=0.0)
    desc.constant = {"momentum"}
    opt = DeviceOptimizer(desc, ["w"], [torch.zeros(1)])
    changed = copy.deepcopy(desc)
    changed.defaults["momentum"] = 0.5
    changed.accum_type = torch.float16
    with pytest.raises(Error, match="constant momentum") as info:
        opt.update(changed)
    assert "accum_type" in info.value.message
    assert opt.description is desc
    bad = copy.deepcopy(desc)
    bad.accum_type = torch.int32
    with pytest.raises(Error, match="accum_type must be torch.float32 or torch.float16"):
        opt.check_update(bad)


def test_state_checks_write_nothing_on_error(caplog):
    w = torch.zeros(2, 2)
    opt = DeviceOptimizer(description(lr=0.1, momentum=0.9), ["w"], [w])
    opt.step([w], [torch.ones(2, 2)])
    before = opt.state_dict()
    for bad, phrase in [({"Accl___w": torch.zeros(3)}, "has shape"),
                        ({"Accl___w": [[0.0]]}, "must be a torch.Tensor"),
                        ({"Accl___w": torch.zeros(2, 2, dtype=torch.complex64)}, "dtype"),
                        ([("Accl___w", torch.zeros(2, 2))], "must be a dict")]:
        with pytest.raises(Error, match=phrase):
            opt.load_state_dict(bad)
        assert torch.equal(opt.state["Accl___w"], before["Accl___w"])
    snap = opt.snapshot()
    opt.step([w], [torch.ones(2, 2)])
    opt.restore(snap)
    assert torch.equal(opt.state["Accl___w"], before["Accl___w"])


# -- the update rules against torch.optim ----------------------------------------

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
    opt = DeviceOptimizer(description("SGD", lr=0.5, momentum=0.0, dampening=0.5), ["w"], p)
    opt.step(p, [torch.ones(2)])
    assert p[0].tolist() == [0.75, 0.75]  # lr * (1 - dampening) (docs/semantics.md S-54 quirk)


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
    desc = description(lr=0.1)
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


# -- the IPU Model on CUDA ----------------------------------------------------------------

class _Tanh(nn.Module):
    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(3, 4))
        self.fc = nn.Linear(4, 1)

    def forward(self, x, t):
        return F.mse_loss(self.fc(torch.tanh(x @ self.W)), t)


def _train_on(device, kind, hyper, extra):
    """3 runs of D=2, A=2, R=4 with a replica-grouped W, the running mean, FP checks and
    automatic loss scaling; returns weights and optimizer state (on the CPU)."""
    torch.manual_seed(0)
    g = Graph(torch.export.export(_Tanh(), (torch.randn(2, 3), torch.randn(2, 1)),
                                  strict=False))
    opts = SessionOptions(device_iterations=2, gradient_accumulation=2, replication_factor=4,
                          output_mode=2, device=device, fp_exceptions=True,
                          auto_loss_scaling=True, mean_reduction_strategy=0,
                          replica_groupings={"W": ReplicaGrouping(2, 2)})
    desc = OptimizerDescription(kind, dict(hyper), [], {}, **extra)
    session = TrainingSession(compiler.compile(g, opts, training=True), None, desc)
    assert session.weights.params[0].device.type == torch.device(device).type
    gen = torch.Generator().manual_seed(1)
    session.writeWeights({"W": torch.randn(2, 3, 4, generator=gen)})
    x, t = torch.randn(32, 3, generator=gen), torch.randn(32, 1, generator=gen)
    for _ in range(3):
        session.run([x, t])
    return {**session.readWeights(), **session.readOptimizerState()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind,hyper,extra", [
    ("SGD", dict(lr=.1, momentum=.9, dampening=.1, nesterov=False, weight_decay=.01,
                 velocity_scaling=2.), dict(use_combined_accum=True, loss_scaling=8.)),
    ("SGD", dict(lr=.1, momentum=.9, dampening=0., nesterov=True, weight_decay=0.),
     dict(max_grad_norm=.5, velocity_accum_type=torch.float16)),
    ("Adam", dict(lr=.01, betas=(.9, .99), eps=1e-8, weight_decay=.01),
     dict(first_order_type=torch.float16)),
    ("LAMB", dict(lr=.01, betas=(.9, .99), eps=1e-6, weight_decay=.01,
                  max_weight_norm=65500.), {}),
    ("RMSprop", dict(lr=.01, alpha=.9, eps=1e-8, weight_decay=0., momentum=.5,
                     centered=True), dict(use_tf_variant=True)),
], ids=["sgd-combined", "sgd-nesterov-clip", "adam", "lamb", "rmsprop-tf"])
def test_optimizers_on_cuda_match_cpu(kind, hyper, extra):
    """The IPU Model executing on CUDA gives the CPU's weights and state (atol 1e-4)."""
    cpu = _train_on("cpu", kind, hyper, extra)
    cuda = _train_on("cuda", kind, hyper, extra)
    for name in cpu:
        torch.testing.assert_close(cuda[name].cpu().float(), cpu[name].float(),
                                   rtol=1e-4, atol=1e-4, msg=name)
