"""Weights and buffers between host and device (spec docs/semantics.md S-30…S-36, S-40):
frozen parameters, buffers, host changes and copies, ``load_state_dict``, and several
wrappers of one host model."""
import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from models import SingleLinear


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.fc2 = nn.Linear(6, 2)

    def forward(self, x, t=None):
        out = self.fc2(F.relu(self.bn(self.fc1(x))))
        if t is None:
            return out
        return out, F.cross_entropy(out, t)


def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9, weight_decay=0.1),
    lambda p: poptorch.optim.SGD(p, lr=0.5, momentum=0.9, weight_decay=0.1,
                                 use_combined_accum=True),
    lambda p: poptorch.optim.AdamW(p, lr=0.1),
    lambda p: poptorch.optim.LAMB(p, lr=0.1),
], ids=["sgd", "sgd-combined", "adamw", "lamb"])
def test_frozen_parameters_are_not_updated(make):
    """docs/semantics.md S-40: requires_grad=False is never updated — not even by weight decay."""
    model = BNNet()
    model.fc1.weight.requires_grad_(False)
    frozen = model.fc1.weight.detach().clone()
    trained = model.fc2.weight.detach().clone()
    opts = poptorch.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(2)
    poptorch.trainingModel(model, opts, make(model.parameters()))(*data(24))
    assert torch.equal(model.fc1.weight, frozen)
    assert not torch.equal(model.fc2.weight, trained)
    assert model.fc1.weight.requires_grad is False


def test_batchnorm_buffers_in_training_then_inference():
    """Training updates the running statistics per micro-batch like the CPU; an eval
    inference wrapper of the same module then uses them without explicit copies."""
    model = BNNet().train()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(2)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(),
                                                                   lr=0.1))
    x, t = data(8)
    training(x, t)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(2):
        opt.zero_grad()
        ref(x[4 * i:4 * i + 4], t[4 * i:4 * i + 4])[1].backward()
        opt.step()
    model.eval()
    ref.eval()
    inference = poptorch.inferenceModel(model)
    probe = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(inference(probe), ref(probe), rtol=1e-5, atol=1e-6)
    assert model.bn.num_batches_tracked.item() == 2


def test_inference_batchnorm_in_train_mode_updates_device_buffers_only():
    """docs/semantics.md S-35: an inference wrapper updates buffers on the device; the host sees
    them after copyWeightsToHost."""
    model = nn.BatchNorm1d(3).train()
    ref = copy.deepcopy(model)
    inference = poptorch.inferenceModel(model)
    x = torch.randn(4, 3)
    inference(x)
    ref(x)
    assert torch.equal(model.running_mean, torch.zeros(3))
    inference.copyWeightsToHost()
    torch.testing.assert_close(model.running_mean, ref.running_mean)


def test_alternating_training_and_inference_always_sees_the_latest_weights():
    """docs/semantics.md S-31: every switch pulls the trainer's weights once and uploads them
    once."""
    model = BNNet()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.2))
    inference = poptorch.inferenceModel(model)
    x, t = data(4)
    probe = torch.randn(3, 4)
    previous = None
    for _ in range(3):
        training(x, t)
        out = inference(probe)
        host = copy.deepcopy(model)  # reads the host weights (synced from the device)
        with torch.no_grad():
            host.train()  # the inference wrapper captured train mode: batch statistics
            torch.testing.assert_close(out, host(probe), rtol=1e-5, atol=1e-6)
        assert previous is None or not torch.equal(out, previous)
        previous = out


def test_first_compile_uses_the_weights_at_compile_time():
    """docs/semantics.md S-33: wrap, train on the CPU, then the first call compiles with the CPU
    weights."""
    model = nn.Linear(4, 2)
    inference = poptorch.inferenceModel(model)
    with torch.no_grad():
        model.weight.mul_(3)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(inference(x), model(x))


def test_cases_that_need_explicit_copies():
    """docs/semantics.md S-32: host edits after compilation are not pushed implicitly;
    copyWeightsToDevice on a trainer without touching the host restores the weights it last
    uploaded."""
    model = BNNet()
    inference = poptorch.inferenceModel(model)
    probe = torch.randn(3, 4)
    before = inference(probe)
    with torch.no_grad():
        model.fc2.bias.add_(1.0)  # CPU "training"
    assert torch.equal(inference(probe), before)  # not seen
    inference.copyWeightsToDevice()
    torch.testing.assert_close(inference(probe), before + 1)
    initial = copy.deepcopy(model.state_dict())
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.5))
    x, t = data(4)
    for _ in range(3):
        training(x, t)
    training.copyWeightsToDevice()  # the un-copied trained weights are lost
    training.copyWeightsToHost()
    for k, v in model.state_dict().items():
        assert torch.equal(v, initial[k]), k


# -- weights and buffers of inference models (docs/semantics.md S-30…S-35)
# -------------------------------

def test_buffer_persists_between_calls_and_needs_explicit_copy_to_host():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("i", torch.tensor([0.]))

        def forward(self, x):
            self.i += 1
            return self.i + 0 * x

    m = M()
    model = poptorch.inferenceModel(m)
    assert model(torch.zeros(1)).tolist() == [1.0]
    assert model(torch.zeros(1)).tolist() == [2.0]
    assert m.i.tolist() == [0.0]  # docs/semantics.md S-35: inference never marks the host stale
    model.copyWeightsToHost()
    assert m.i.tolist() == [2.0]


def test_shallow_copy_shares_tensors_not_attributes():
    m = SingleLinear()
    model = poptorch.inferenceModel(m)
    m.foo = 2
    assert not hasattr(model._state.model, "foo")
    with torch.no_grad():
        m.fc.weight.fill_(0)
        m.fc.bias.fill_(1)
    assert torch.equal(model(torch.randn(2, 6)), torch.ones(2, 20))  # docs/semantics.md S-33


def test_host_changes_need_copy_weights_to_device():
    m = SingleLinear()
    model = poptorch.inferenceModel(m)
    x = torch.randn(2, 6)
    before = model(x)
    with torch.no_grad():
        m.fc.bias.add_(1)
    assert torch.equal(model(x), before)  # docs/semantics.md S-32
    model.copyWeightsToDevice()
    torch.testing.assert_close(model(x), before + 1)


def test_load_state_dict_through_the_executor():
    m, other = SingleLinear(), SingleLinear()
    model = poptorch.inferenceModel(m)
    x = torch.randn(2, 6)
    model(x)
    result = model.load_state_dict(other.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    torch.testing.assert_close(model(x), other(x).detach())


def test_buffer_updates_are_lost_on_reattach_unless_copied():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("i", torch.zeros(()))

        def forward(self, x):
            self.i += 1
            return self.i + 0 * x

    model = poptorch.inferenceModel(M())
    model(torch.zeros(()))
    model(torch.zeros(()))
    model.detachFromDevice()
    model.attachToDevice()
    assert model(torch.zeros(())).item() == 1.0


def test_deep_copy_of_model_is_independent():
    m = SingleLinear()
    copied = copy.deepcopy(m)
    model = poptorch.inferenceModel(copied)
    x = torch.randn(2, 6)
    torch.testing.assert_close(model(x), m(x).detach())


# -- a second trainer of the model (docs/semantics.md S-31)
# ----------------------------------------------

class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, y=None):
        out = self.fc(x)
        return out if y is None else (out, nn.functional.cross_entropy(out, y))


@pytest.mark.parametrize("drop", ["destroy", "garbage_collect"])
def test_inference_sees_weights_of_a_second_trainer_of_the_model(drop):
    """docs/semantics.md S-31: an inference wrapper uploads the trained weights of whichever trainer
    wraps its model now. A second ``trainingModel`` of the model (after the first one was destroyed
    or freed) counts its host copies from 1 again; its first copy must not be taken for the first
    trainer's copy that the inference wrapper already uploaded."""
    torch.manual_seed(0)
    model = _Classifier()
    ref = copy.deepcopy(model)
    xs, ys, probe = torch.randn(2, 4, 6), torch.randint(0, 3, (2, 4)), torch.randn(4, 6)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    expected = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        ref(x, y)[1].backward()
        opt.step()
        expected.append(ref(probe).detach())

    def trainer():
        return poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(),
                                                                       lr=0.1))
    inference = poptorch.inferenceModel(model)
    first = trainer()
    first(xs[0], ys[0])
    torch.testing.assert_close(inference(probe), expected[0])
    if drop == "destroy":
        first.destroy()
    else:
        del first
        gc.collect()
    second = trainer()
    second(xs[1], ys[1])
    torch.testing.assert_close(inference(probe), expected[1])


class _WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, target=None):
        out = self.fc(x)
        return out if target is None else (out, F.mse_loss(out, target))


def test_implicit_copy_calls_the_wrappers_copy_weights_to_host():
    """As PopTorch: the implicit device → host copy goes through the wrapper's
    ``copyWeightsToHost``, so a method set on the instance sees every implicit copy."""
    torch.manual_seed(0)
    model = _WithLoss()
    initial = model.fc.weight.detach().clone()
    trainer = poptorch.trainingModel(model)
    calls = []
    real = trainer.copyWeightsToHost
    trainer.copyWeightsToHost = lambda: (calls.append(1), real())[1]
    x, target = torch.randn(2, 4), torch.randn(2, 4)
    for _ in range(3):
        trainer(x, target)
    assert calls == []  # training needs no copy
    assert not torch.equal(model.fc.weight.detach(), initial)  # the trained weights
    assert calls == [1]
    model.fc(x)
    assert calls == [1]  # the host copy is current
    inference = poptorch.inferenceModel(model)
    trainer(x, target)
    inference(x)  # uploads the trainer's latest weights: one implicit copy first
    assert calls == [1, 1]
    assert trainer.copyWeightsToHostIfNeeded() is False
