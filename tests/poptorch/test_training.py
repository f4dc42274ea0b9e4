"""trainingModel: losses, accumulation, replication, optimizers, weight sync
(docs/api-sections.md api §2.1, §6; docs/semantics.md S-10…S-13, S-31…S-36, S-40…S-43). Wrapping,
detaching, destroying and ``setOptimizer``: ``test_executor.py``."""
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from models import Classifier, assert_same_weights, reference_training


@pytest.mark.parametrize("d,a,r", [(1, 1, 1), (3, 1, 1), (2, 3, 1), (2, 2, 2), (1, 4, 2)])
def test_sgd_momentum_matches_plain_pytorch(d, a, r):
    model = Classifier()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(d).replicationFactor(r)
    opts.Training.gradientAccumulation(a)
    training = poptorch.trainingModel(
        model, opts, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    n = d * a * r * 3
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        x, t = torch.randn(n, 6), torch.randint(0, 4, (n,))
        out, loss = training(x, t)
        ref_outs, ref_losses = reference_training(ref, ref_opt, x, t, d, a, r)
        # Final: the last micro-batch of each replica (docs/semantics.md S-12)
        assert out.shape == (r * 3, 4)
        assert loss.shape == ((r,) if r > 1 else ())
        torch.testing.assert_close(loss.reshape(-1), torch.stack(ref_losses[-r:]),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, torch.cat(ref_outs[-r:]), rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, weight_decay=0.01, nesterov=True),
    lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
    lambda p: torch.optim.AdamW(p, lr=0.01),
    lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    lambda p: poptorch.optim.SGD(p, lr=0.05, momentum=0.9),
    lambda p: poptorch.optim.Adam(p, lr=0.01),
    lambda p: poptorch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    lambda p: poptorch.optim.RMSprop(p, lr=0.01, alpha=0.9),
    lambda p: poptorch.optim.LAMB(p, lr=0.01),
], ids=["sgd", "adam", "adamw", "rmsprop", "pt-sgd", "pt-adam", "pt-adamw", "pt-rmsprop",
        "pt-lamb"])
def test_optimizers_match_their_host_update_over_10_steps(make):
    """Each optimizer's device update equals the host optimizer's ``step()`` (rtol 1e-4
    over 10 steps of 2 accumulated micro-batches)."""
    model = Classifier()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(10)
    opts.Training.gradientAccumulation(2)
    training = poptorch.trainingModel(model, opts, make(model.parameters()))
    x, t = torch.randn(10 * 2 * 4, 6), torch.randint(0, 4, (80,))
    training(x, t)
    reference_training(ref, make(ref.parameters()), x, t, 10, 2, 1)
    assert_same_weights(model, ref, rtol=1e-4, atol=1e-5)


def test_default_optimizer_is_sgd_lr_001():
    model = Classifier()
    ref = copy.deepcopy(model)
    training = poptorch.trainingModel(model)
    x, t = torch.randn(4, 6), torch.randint(0, 4, (4,))
    training(x, t)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.01), x, t, 1, 1, 1)
    assert_same_weights(model, ref)


def test_sum_reduction_matches_larger_learning_rate():
    """docs/semantics.md S-41: with Sum, A=2 and lr=0.01 equals A=1 with lr=0.02 on the same
    samples."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, x, t):
            out = self.fc(x)
            return out, F.l1_loss(out, t)

    base = M()
    x, t = torch.randn(4, 3), torch.randn(4, 1)
    summed = copy.deepcopy(base)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
    poptorch.trainingModel(summed, opts, torch.optim.SGD(summed.parameters(), lr=0.01))(x, t)
    single = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(single.parameters(), lr=0.02)
    ref_opt.zero_grad()
    loss = (F.l1_loss(single.fc(x[:2]), t[:2]) + F.l1_loss(single.fc(x[2:]), t[2:])) / 2
    loss.backward()
    ref_opt.step()
    assert_same_weights(summed, single, rtol=1e-5, atol=1e-6)
    mean = copy.deepcopy(base)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    poptorch.trainingModel(mean, opts, torch.optim.SGD(mean.parameters(), lr=0.01))(x, t)
    whole = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(whole.parameters(), lr=0.01)
    F.l1_loss(whole.fc(x), t).backward()
    ref_opt.step()
    assert_same_weights(mean, whole, rtol=1e-5, atol=1e-6)  # A=1 x4 == A=2 x2 with Mean


def test_training_output_modes():
    """docs/semantics.md S-12: training D=1000-style shapes, scaled down to D=8."""
    def run(mode=None, period=None, d=8, r=1):
        opts = poptorch.Options().deviceIterations(d).replicationFactor(r)
        if mode is not None:
            opts.outputMode(mode, period)
        model = poptorch.trainingModel(Classifier(), opts)
        n = d * r
        return model(torch.randn(n, 6), torch.randint(0, 4, (n,)))

    out, loss = run()
    assert out.shape == (1, 4) and loss.shape == ()
    out, loss = run(poptorch.OutputMode.All)
    assert out.shape == (8, 4) and loss.shape == (8,)
    out, loss = run(poptorch.OutputMode.EveryN, 4)
    assert out.shape == (2, 4) and loss.shape == (2,)
    out, loss = run(poptorch.OutputMode.Sum)
    assert loss.shape == ()
    out, loss = run(r=2)
    assert loss.shape == (2,)


def test_sum_output_equals_sum_of_losses():
    model = Classifier()
    opts = poptorch.Options().deviceIterations(5).outputMode(poptorch.OutputMode.Sum)
    ref = copy.deepcopy(model)
    x, t = torch.randn(10, 6), torch.randint(0, 4, (10,))
    _, loss = poptorch.trainingModel(model, opts)(x, t)
    _, losses = reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.01),
                                   x, t, 5, 1, 1)
    torch.testing.assert_close(loss, torch.stack(losses).sum(), rtol=1e-5, atol=1e-6)


def test_forward_values_use_weights_before_the_update():
    """docs/semantics.md S-43: the first call returns the loss of the initial weights."""
    model = Classifier()
    x, t = torch.randn(4, 6), torch.randint(0, 4, (4,))
    with torch.no_grad():
        expected = model(x, t)[1]
    training = poptorch.trainingModel(model)
    first = training(x, t)[1]
    second = training(x, t)[1]
    torch.testing.assert_close(first, expected)
    assert second < first


# -- losses (docs/semantics.md S-40, S-42)
# -----------------------------------------------------------------

class Linear2(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)


def test_no_loss_raises_and_model_stays_usable():
    class M(Linear2):
        def forward(self, x):
            return self.fc(x) * 12

    m = M()
    before = copy.deepcopy(m.state_dict())
    training = poptorch.trainingModel(m)
    with pytest.raises(poptorch.Error, match="Couldn't find a loss in graph!"):
        training(torch.ones(1, 2))
    assert not training.isCompiled()
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])


def test_two_independent_losses_raise():
    class M(Linear2):
        def forward(self, x, t):
            o = F.log_softmax(self.fc(x), 1)
            return F.nll_loss(o, t) + 5 * F.nll_loss(o, t)

    with pytest.raises(poptorch.Error, match="Multiple independent losses found in graph"):
        poptorch.trainingModel(M())(torch.ones(1, 2), torch.tensor([1]))


def test_identity_loss_combines_losses():
    class M(Linear2):
        def forward(self, x, t):
            o = F.log_softmax(self.fc(x), 1)
            return poptorch.identity_loss(F.nll_loss(o, t) + 5 * F.nll_loss(o, t), "mean")

    m = M()
    ref = copy.deepcopy(m)
    x, t = torch.randn(3, 2), torch.tensor([1, 0, 1])
    loss = poptorch.trainingModel(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))(x, t)
    o = F.log_softmax(ref.fc(x), 1)
    expected = 6 * F.nll_loss(o, t)
    torch.testing.assert_close(loss, expected.detach())
    expected.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    assert_same_weights(m, ref)


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_identity_loss_reductions(reduction):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            partial = poptorch.identity_loss(x * self.w, reduction=reduction)
            return poptorch.identity_loss(partial * partial, reduction="sum"), partial

    m = M()
    x = torch.tensor([1., 2., 3.])
    loss, partial = poptorch.trainingModel(
        m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))(x)
    expected_partial = {"sum": x.sum(), "mean": x.mean(), "none": x}[reduction]
    torch.testing.assert_close(partial, expected_partial)
    w = torch.ones(3, requires_grad=True)
    p = {"sum": (x * w).sum(), "mean": (x * w).mean(), "none": x * w}[reduction]
    (p * p).sum().backward()
    torch.testing.assert_close(m.w.detach(), (1 - 0.1 * w.grad))
    with pytest.raises(AssertionError, match="Unsupported reduction type!"):
        poptorch.identity_loss(x, "max")


def test_loss_must_be_returned():
    class M(Linear2):
        def forward(self, x, t):
            out = self.fc(x)
            F.mse_loss(out, t)
            return out

    with pytest.raises(poptorch.Error, match="final loss must be returned"):
        poptorch.trainingModel(M())(torch.ones(1, 2), torch.ones(1, 2))


def test_frozen_parameters_are_not_updated():
    m = Classifier()
    m.fc1.weight.requires_grad_(False)
    frozen = m.fc1.weight.detach().clone()
    trainable = m.fc2.weight.detach().clone()
    poptorch.trainingModel(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.5))(
        torch.randn(4, 6), torch.randint(0, 4, (4,)))
    assert torch.equal(m.fc1.weight, frozen)
    assert not torch.equal(m.fc2.weight, trainable)


def test_parameters_outside_param_groups_use_defaults():
    """docs/semantics.md S-55: fc2 is not in the optimizer, still trained with the defaults."""
    m = Classifier()
    before = m.fc2.weight.detach().clone()
    opt = poptorch.optim.SGD(m.fc1.parameters(), lr=0.1)
    poptorch.trainingModel(m, optimizer=opt)(torch.randn(4, 6), torch.randint(0, 4, (4,)))
    assert not torch.equal(m.fc2.weight, before)


def test_non_scalar_final_loss_behaves_like_its_sum():
    class M(Linear2):
        def forward(self, x, t):
            return F.mse_loss(self.fc(x), t, reduction="none")

    m = M()
    ref = copy.deepcopy(m)
    x, t = torch.randn(3, 2), torch.randn(3, 2)
    poptorch.trainingModel(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))(x, t)
    F.mse_loss(ref.fc(x), t, reduction="none").sum().backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    assert_same_weights(m, ref, rtol=1e-5, atol=1e-6)


# -- weight synchronisation (docs/semantics.md S-31…S-34, docs/api-sections.md api §6)
# -------------------------------------------

def test_training_model_is_instrumented_and_syncs_lazily(poptorch_logs):
    m = Classifier()
    initial = m.fc1.weight.detach().clone()
    training = poptorch.trainingModel(m)
    assert type(m).__name__ == "PoptorchClassifier" and isinstance(m, Classifier)
    x, t = torch.randn(4, 6), torch.randint(0, 4, (4,))
    training(x, t)
    assert training._state.host.stale
    poptorch_logs.clear()
    assert not torch.equal(m.fc1.weight, initial)  # triggers the device → host copy
    assert not training._state.host.stale
    assert poptorch_logs.text.count("Implicit copyWeightsToHost()") == 1
    m.fc1.weight.sum()
    m.state_dict()
    assert poptorch_logs.text.count("Implicit copyWeightsToHost()") == 1
    assert m._host_weights_version == 1


def test_state_dict_is_plain_and_picklable():
    m = Classifier()
    training = poptorch.trainingModel(m)
    training(torch.randn(4, 6), torch.randint(0, 4, (4,)))
    state = m.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is Classifier
    assert type(loaded.fc1.weight) is torch.nn.Parameter
    torch.testing.assert_close(loaded.fc1.weight, state["fc1.weight"])
    assert type(pickle.loads(pickle.dumps(m.fc1.weight))) is torch.nn.Parameter


def test_inference_wrapper_follows_training_with_one_copy_each_way(poptorch_logs):
    m = Classifier()
    training = poptorch.trainingModel(m)
    inference = poptorch.inferenceModel(m)
    x, t = torch.randn(4, 6), torch.randint(0, 4, (4,))
    inference(x)
    for _ in range(5):
        training(x, t)
    poptorch_logs.clear()
    out = inference(x)
    assert poptorch_logs.text.count("Implicit copyWeightsToHost()") == 1
    assert poptorch_logs.text.count("Implicit copyWeightsToDevice()") == 1
    with torch.no_grad():
        torch.testing.assert_close(out, m(x))
    poptorch_logs.clear()
    inference(x)
    assert "Implicit copy" not in poptorch_logs.text


def test_copy_weights_to_device_restores_initial_weights():
    """docs/semantics.md S-32: without touching the host, copyWeightsToDevice discards device
    training."""
    m = Classifier()
    initial = copy.deepcopy(m.state_dict())
    training = poptorch.trainingModel(m)
    x, t = torch.randn(4, 6), torch.randint(0, 4, (4,))
    for _ in range(3):
        training(x, t)
    training.copyWeightsToDevice()
    training.copyWeightsToHost()
    for k, v in m.state_dict().items():
        assert torch.equal(v, initial[k])


def test_host_training_needs_explicit_copy_to_inference_device():
    m = Classifier()
    inference = poptorch.inferenceModel(m)
    x = torch.randn(4, 6)
    before = inference(x)
    with torch.no_grad():
        m.fc2.bias.add_(1.0)
    assert torch.equal(inference(x), before)
    inference.copyWeightsToDevice()
    torch.testing.assert_close(inference(x), before + 1)


def test_batchnorm_statistics_update_on_device():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.fc = nn.Linear(4, 2)

        def forward(self, x, t):
            out = self.fc(self.bn(x))
            return out, F.cross_entropy(out, t)

    m = M()
    ref = copy.deepcopy(m)
    opts = poptorch.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(2)
    x, t = torch.randn(18, 4), torch.randint(0, 2, (18,))
    poptorch.trainingModel(m, opts, torch.optim.SGD(m.parameters(), lr=0.1))(x, t)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, t, 3, 2, 1)
    torch.testing.assert_close(m.bn.running_mean, ref.bn.running_mean)
    torch.testing.assert_close(m.bn.running_var, ref.bn.running_var)
    assert m.bn.num_batches_tracked.item() == 6
    assert_same_weights(m, ref, rtol=1e-5, atol=1e-6)


def test_buffer_updated_per_micro_batch_like_cpu():
    """docs/semantics.md S-35 training example: buffer += conv.bias[0], D=3, A=5, 10 calls → 150
    steps."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)
            self.register_buffer("acc", torch.zeros(()))

        def forward(self, x):
            out = self.conv(x)
            self.acc += self.conv.bias[0].detach()
            return poptorch.identity_loss(out.sum() * 0 + self.acc * 0 + out.mean(), "sum")

    m = M()
    ref = copy.deepcopy(m)
    opts = poptorch.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(5)
    training = poptorch.trainingModel(m, opts, torch.optim.SGD(m.parameters(), lr=0.01))
    x = torch.randn(15, 1, 4, 4)
    for _ in range(10):
        training(x)
    opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for _ in range(10):
        for i in range(3):
            opt.zero_grad()
            for a in range(5):
                (ref(x[i * 5 + a:i * 5 + a + 1]) / 5).backward()
            opt.step()
    torch.testing.assert_close(m.acc, ref.acc, rtol=1e-5, atol=1e-5)


def test_replicas_with_buffer_updates_need_broadcast_buffers_off():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(2)

        def forward(self, x):
            return poptorch.identity_loss(self.bn(x), "mean")

    opts = poptorch.Options().replicationFactor(2)
    with pytest.raises(poptorch.Error, match="PopTorch does not support broadcasting buffers"):
        poptorch.trainingModel(M(), opts)(torch.randn(4, 2))


def test_per_replica_buffers_evolve_independently():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.zeros(1))

        def forward(self, x):
            self.b += x.sum()
            return self.b.clone()

    opts = poptorch.Options().replicationFactor(2).broadcastBuffers(False)
    model = poptorch.inferenceModel(M(), opts)
    for _ in range(50):
        out = model(torch.tensor([[9.], [2.]]))
    assert out.tolist() == [450.0, 100.0]


def test_top_level_training_flag_copied_at_wrap():
    class M(Linear2):
        def forward(self, x):
            return poptorch.identity_loss(self.fc(x).sum() * 0, "sum"), \
                torch.tensor(float(self.training))

    m = M()
    m.train()
    training = poptorch.trainingModel(m)
    m.eval()
    inference = poptorch.inferenceModel(m)
    assert training(torch.ones(1, 2))[1].item() == 1.0
    assert inference(torch.ones(1, 2))[1].item() == 0.0
