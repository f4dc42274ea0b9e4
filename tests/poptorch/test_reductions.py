"""Gradient reductions over accumulated micro-batches and replicas (docs/semantics.md S-41, S-42):
the ``Mean`` strategies (Running, Post) and ``Sum`` against one big batch or a larger
learning rate, float16 accumulators on the running mean, and ``identity_loss``
reductions against plain PyTorch. Tolerance ``rtol=1e-5, atol=1e-6``."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from models import assert_same_weights

TOL = dict(rtol=1e-5, atol=1e-6)


def options(d=1, a=1, r=1):
    opts = poptorch.Options().deviceIterations(d).replicationFactor(r)
    opts.Training.gradientAccumulation(a)
    return opts


class L1Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 1)

    def forward(self, x, t):
        return F.l1_loss(self.fc(x), t)


def _train_l1(base, a, r, reduction=None, strategy=None, lr=0.01, accum_type=None):
    model = copy.deepcopy(base)
    opts = options(a=a, r=r)
    if reduction is not None:
        opts.Training.accumulationAndReplicationReductionType(reduction)
    if strategy is not None:
        opts.Training.setMeanAccumulationAndReplicationReductionStrategy(strategy)
    opt = poptorch.optim.SGD(model.parameters(), lr=lr, accum_type=accum_type)
    training = poptorch.trainingModel(model, opts, opt)
    return model, training


@pytest.mark.parametrize("strategy", [poptorch.MeanReductionStrategy.Post,
                                      poptorch.MeanReductionStrategy.Running])
@pytest.mark.parametrize("a,r", [(4, 1), (2, 2), (1, 4)])
def test_mean_reduction_strategies_equal_one_big_batch(strategy, a, r):
    """docs/semantics.md S-41 example: Mean over A × R micro-batches of 2 == one batch of 2·A·R (L1
    mean loss), for both the running and the post mean (rtol 1e-5)."""
    base = L1Model()
    x, t = torch.randn(8, 3), torch.randn(8, 1)
    model, training = _train_l1(base, a, r, strategy=strategy)
    for _ in range(10):
        training(x, t)
    assert training.options.Training.meanAccumulationAndReplicationReductionStrategy == \
        strategy
    whole = copy.deepcopy(base)
    opt = torch.optim.SGD(whole.parameters(), lr=0.01)
    for _ in range(10):
        opt.zero_grad()
        F.l1_loss(whole.fc(x), t).backward()
        opt.step()
    assert_same_weights(model, whole, **TOL)


def test_sum_reduction_equals_larger_learning_rate():
    """docs/semantics.md S-41 example: with Sum, A=2 and lr=0.01 equals A=1 (mean over 4) with
    lr=0.02."""
    base = L1Model()
    x, t = torch.randn(4, 3), torch.randn(4, 1)
    summed, training = _train_l1(base, 2, 1, reduction=poptorch.ReductionType.Sum)
    training(x, t)
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.02)
    (F.l1_loss(ref.fc(x[:2]), t[:2]) + F.l1_loss(ref.fc(x[2:]), t[2:])).div(2).backward()
    opt.step()
    assert_same_weights(summed, ref, **TOL)


def test_float16_accumulators_switch_to_running_mean(poptorch_logs):
    """docs/semantics.md S-41: float16 accum_type (not SGD combined) → Running before compile; after
    compiling with Post it is a ValueError; the combined SGD variant keeps Post."""
    base = L1Model()
    _, training = _train_l1(base, 2, 1, accum_type=torch.float16)
    assert training.options.Training.meanAccumulationAndReplicationReductionStrategy == \
        poptorch.MeanReductionStrategy.Running
    combined = copy.deepcopy(base)
    training = poptorch.trainingModel(combined, options(a=2), poptorch.optim.SGD(
        combined.parameters(), lr=0.01, accum_type=torch.float16, use_combined_accum=True))
    assert training.options.Training.meanAccumulationAndReplicationReductionStrategy == \
        poptorch.MeanReductionStrategy.Post
    model, training = _train_l1(base, 2, 1)
    training(torch.randn(4, 3), torch.randn(4, 1))
    with pytest.raises(ValueError, match="is already compiled"):
        training.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.01,
                                                 accum_type=torch.float16))
    training.destroy()
    training.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.01,
                                             accum_type=torch.float16))
    assert training.options.Training.meanAccumulationAndReplicationReductionStrategy == \
        poptorch.MeanReductionStrategy.Running


def test_float16_accumulators_use_the_running_mean():
    """Summing 8 float16 gradients of 12000 would overflow a float16 accumulator; the
    automatically selected running mean gives the exact mean (the Post overflow is
    shown in tests/popart_compiler/optim/test_device_optimizer.py)."""
    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1, dtype=torch.float16))

        def forward(self, x):
            return poptorch.identity_loss((self.w * x).sum(), reduction="sum")

    model = Big()
    opt = poptorch.optim.SGD(model.parameters(), lr=1e-4, accum_type=torch.float16)
    training = poptorch.trainingModel(model, options(a=8), opt)
    training(torch.full((8, 1), 12000.0, dtype=torch.float16))
    assert model.w.item() == pytest.approx(-1.2, rel=1e-3)


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_identity_loss_reductions_train_like_plain_pytorch(reduction):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return poptorch.identity_loss(self.fc(x) ** 2, reduction=reduction)

    model = M()
    ref = copy.deepcopy(model)
    x = torch.randn(10 * 2, 3)
    out = poptorch.trainingModel(model, options(d=10), torch.optim.SGD(
        model.parameters(), lr=0.01))(x)
    opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    last = None
    for i in range(10):
        opt.zero_grad()
        y = ref.fc(x[2 * i:2 * i + 2]) ** 2
        last = {"sum": y.sum(), "mean": y.mean(), "none": y}[reduction]
        # a non-scalar final loss behaves like its sum (docs/semantics.md S-40)
        last.sum().backward()
        opt.step()
    assert out.shape == last.shape
    torch.testing.assert_close(out, last.detach(), **TOL)
    assert_same_weights(model, ref, **TOL)
