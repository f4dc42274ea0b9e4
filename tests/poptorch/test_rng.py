"""Device random numbers: seeds, ``rng_state``, dropout and ``torch.rand*`` inside the
model (docs/api-sections.md api §5.16; docs/semantics.md S-95…S-97)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


class Noise(nn.Module):
    def forward(self, x):
        return x + torch.rand(x.shape, device=x.device), torch.randn_like(x)


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, t=None):
        out = self.drop(self.fc(x))
        if t is None:
            return out
        return out, F.mse_loss(out, t)


def seeded(seed=42, **kw):
    opts = poptorch.Options().randomSeed(seed)
    if "d" in kw:
        opts.deviceIterations(kw["d"])
    if "r" in kw:
        opts.replicationFactor(kw["r"])
    return opts


def test_same_seed_same_numbers_across_wrappers():
    """docs/semantics.md S-95 example: two wrappers with randomSeed(42) return identical tensors."""
    x = torch.zeros(4, 3)
    a = poptorch.inferenceModel(Noise(), seeded(42))(x)
    b = poptorch.inferenceModel(Noise(), seeded(42))(x)
    c = poptorch.inferenceModel(Noise(), seeded(7))(x)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert not torch.equal(a[0], c[0])
    assert ((a[0] >= 0) & (a[0] < 1)).all()


def test_random_seed_also_seeds_the_host():
    poptorch.Options().randomSeed(5)
    first = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(first, torch.rand(3))


def test_numbers_differ_between_iterations_replicas_and_calls():
    model = poptorch.inferenceModel(Noise(), seeded(1, d=2, r=2))
    x = torch.zeros(4, 3)
    first, _ = model(x)
    blocks = first.reshape(4, 3)  # [iteration 0: replicas 0, 1; iteration 1: 0, 1]
    assert len({tuple(b.tolist()) for b in blocks}) == 4
    second, _ = model(x)
    assert not torch.equal(first, second)


def test_rng_state_before_and_after_runs():
    """docs/semantics.md S-97: before any run [seed] (or None without a seed); a model without
    random ops reports seed 0."""
    model = poptorch.inferenceModel(Noise(), seeded(3))
    with pytest.raises(poptorch.Error, match="Model has not been compiled"):
        model.rng_state
    model.compile(torch.zeros(2, 3))
    assert model.rng_state == [3]
    unseeded = poptorch.inferenceModel(Noise())
    unseeded.compile(torch.zeros(2, 3))
    assert unseeded.rng_state is None
    model(torch.zeros(2, 3))
    state = model.rng_state
    assert state[0] == 3 and len(state) > 1
    plain = poptorch.inferenceModel(nn.Linear(3, 3), seeded(3))
    plain(torch.zeros(2, 3))
    assert plain.rng_state == [0]


def test_restoring_rng_state_replays_random_numbers():
    """docs/semantics.md S-96 example: s = m.rng_state; a = m(x); m.rng_state = s; b = m(x) → a ==
    b. (Dropout is the identity in inference models, docs/semantics.md S-34: random masks come from
    torch.rand here.)"""
    class Mask(nn.Module):
        def forward(self, x):
            return x * (torch.rand_like(x) > 0.5)

    inference = poptorch.inferenceModel(Mask(), seeded(11))
    x = torch.ones(4, 8)
    inference(x)
    state = inference.rng_state
    a = inference(x)
    inference.rng_state = state
    b = inference(x)
    c = inference(x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a == 0).any()  # the mask is random


def test_rng_state_survives_detach_and_attach():
    inference = poptorch.inferenceModel(Noise(), seeded(9))
    x = torch.zeros(2, 3)
    inference(x)
    inference.detachFromDevice()
    saved = inference.rng_state
    inference.attachToDevice()
    after_attach = inference(x)[0]
    inference.rng_state = saved
    assert torch.equal(inference(x)[0], after_attach)


def test_training_with_dropout_is_reproducible_for_a_seed():
    """Same seed, same initial weights, same data → identical trained weights and
    losses; another seed gives other weights; replaying the RNG state replays a step."""
    base = DropoutNet().train()
    x, t = torch.randn(8, 8), torch.randn(8, 8)

    def train(seed):
        model = copy.deepcopy(base)
        training = poptorch.trainingModel(model, seeded(seed, d=4),
                                          torch.optim.SGD(model.parameters(), lr=0.1))
        losses = [training(x, t)[1] for _ in range(3)]
        return model, training, torch.stack(losses)

    m1, _, l1 = train(5)
    m2, training, l2 = train(5)
    m3, _, _ = train(6)
    assert torch.equal(l1, l2)
    assert torch.equal(m1.fc.weight, m2.fc.weight)
    assert not torch.equal(m1.fc.weight, m3.fc.weight)
    # replay: same weights + same RNG state → same outputs
    state = training.rng_state
    weights = copy.deepcopy(m2.state_dict())
    out1, _ = training(x, t)
    training.load_state_dict(weights)
    training.rng_state = state
    out2, _ = training(x, t)
    assert torch.equal(out1, out2)


def test_invalid_rng_state_is_rejected_and_the_model_stays_usable():
    """Found by a user: ``rng_state = [1, 2, 3]`` was accepted and every later call failed
    with a raw RuntimeError."""
    class D(torch.nn.Module):
        def forward(self, x):
            return x * torch.rand_like(x)

    model = poptorch.inferenceModel(D(), poptorch.Options().randomSeed(1))
    model(torch.ones(8))
    good = model.rng_state
    for bad in ([1, 2, 3], [], ["a"], [1, 300] + good[2:]):
        with pytest.raises(poptorch.Error, match="Invalid RNG state"):
            model.rng_state = bad
    assert model.rng_state == good
    a = model(torch.ones(8))
    model.rng_state = good
    assert torch.equal(model(torch.ones(8)), a)
