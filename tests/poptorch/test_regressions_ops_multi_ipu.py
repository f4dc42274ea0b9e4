"""Regressions found by using the PopTorch ops (api §8) and multi-IPU execution
(api §9) as a user would."""
import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


def quiet(opts=None):
    return (opts or poptorch.Options()).showCompilationProgressBar(False)


def max_weight_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


class InlineCpuPipeline(nn.Module):
    """A two-stage pipeline creating its poptorch.CPU op inside forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.c = nn.Linear(6, 2)

    def forward(self, x, y):
        with poptorch.Block("A", ipu_id=0):
            x = self.a(x)
        with poptorch.Block("B", ipu_id=1):
            x = poptorch.CPU(lambda t: t * 2, "double")(x)
            x = self.c(torch.relu(x))
            loss = F.mse_loss(x, y)
        return x, loss


def test_cpu_op_created_inside_forward_stays_alive_for_training():
    torch.manual_seed(0)
    model = InlineCpuPipeline()
    ref = copy.deepcopy(model)
    opts = quiet()
    opts.Training.gradientAccumulation(4)
    executor = poptorch.trainingModel(model, opts,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 6), torch.randn(8, 2)
    executor.compile(x, y)
    gc.collect()  # the CPU object has no owner but the compiled graph
    executor(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for mb in range(4):
        xs, ys = x[2 * mb:2 * mb + 2], y[2 * mb:2 * mb + 2]
        hidden = (ref.a(xs) * 2).detach()  # no gradient through host code
        (F.mse_loss(ref.c(torch.relu(hidden)), ys) / 4).backward()
    ref_opt.step()
    executor.copyWeightsToHost()
    assert max_weight_diff(model, ref) < 1e-6


class DynamicOp(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, start):
        return self.fn(x, start)


@pytest.mark.parametrize("fn, message", [
    (lambda x, i: poptorch.dynamic_slice(x, 5, i, 2, 1),
     r"dim 5 is out of range for a tensor of shape \[8, 6\]: use a dimension in \[-2, 1\]"),
    (lambda x, i: poptorch.dynamic_update(x, torch.zeros(8, 3), 1, i, 2),
     r"src has shape \[8, 3\], but a window of size 2 along dim 1 .* has shape \[8, 2\]"),
])
def test_dynamic_slicing_bad_dim_or_src_shape_is_a_clear_error(fn, message):
    executor = poptorch.inferenceModel(DynamicOp(fn), quiet())
    with pytest.raises(poptorch.Error, match=message):
        executor(torch.randn(8, 6), torch.tensor([1]))


def test_dynamic_slice_negative_dim_wraps_like_positive():
    executor = poptorch.inferenceModel(
        DynamicOp(lambda x, i: poptorch.dynamic_slice(x, -1, i, 3, 1)), quiet())
    x = torch.arange(12.).reshape(2, 6)
    out = executor(x, torch.tensor([4]))
    assert torch.equal(out, x[:, [4, 5, 0]])


class PrintInCond(nn.Module):
    def forward(self, x):
        return poptorch.cond(x.sum() > 0,
                             lambda a: [poptorch.ipu_print_tensor(a, "then")], [x],
                             lambda a: [a], [x])[0]


def test_host_op_inside_cond_branch_is_a_clear_error():
    executor = poptorch.inferenceModel(PrintInCond(), quiet())
    with pytest.raises(poptorch.Error, match=r"poptorch.cond: a branch could not be captured"
                       r".*call host ops \(ipu_print_tensor, CPU, custom_op\) outside"):
        executor(torch.ones(2, 2))


class OpCall(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.fn = fn

    def forward(self, x):
        return self.fn(self, x)


@pytest.mark.parametrize("fn, error, message", [
    (lambda m, x: poptorch.for_loop(2, lambda a: [a], x), ValueError,
     r"\(Object is not list\)"),
    (lambda m, x: poptorch.cond(x.sum() > 0, lambda a: [a], x, lambda a: [a], [x]),
     ValueError, r"\(Object is not list\)"),
    (lambda m, x: poptorch.recomputationCheckpoint(m.fc(x), 3), ValueError,
     "All inputs must be tensors"),
    (lambda m, x: poptorch.serializedMatMul(x, m.fc.weight,
                                            poptorch.MatMulSerializationMode.ReducingDim,
                                            2, 1), AssertionError,
     "keep_precision must be a bool"),
])
def test_op_argument_errors_inside_a_wrapped_model_keep_the_spec_exception_type(
        fn, error, message):
    model = OpCall(fn)
    before = copy.deepcopy(model.state_dict())
    executor = poptorch.inferenceModel(model, quiet())
    with pytest.raises(error, match=message):
        executor(torch.ones(2, 2))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
