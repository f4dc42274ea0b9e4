"""Frozen parameters, buffers, and several wrappers of one host model (spec
semantics S-31…S-36, S-40)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


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
    """S-40: requires_grad=False is never updated — not even by weight decay."""
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
    """S-35: an inference wrapper updates buffers on the device; the host sees them
    after copyWeightsToHost."""
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
    """S-31: every switch pulls the trainer's weights once and uploads them once."""
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
    """S-33: wrap, train on the CPU, then the first call compiles with the CPU weights."""
    model = nn.Linear(4, 2)
    inference = poptorch.inferenceModel(model)
    with torch.no_grad():
        model.weight.mul_(3)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(inference(x), model(x))


def test_cases_that_need_explicit_copies():
    """S-32: host edits after compilation are not pushed implicitly; copyWeightsToDevice
    on a trainer without touching the host restores the weights it last uploaded."""
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
