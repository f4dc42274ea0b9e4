"""Half precision and precision options (docs/semantics.md S-45…S-47,
docs/api-sections.md options §4.2); what the IPU Model does instead of hardware-only numerics is
documented in the README ("Numerics of the IPU Model")."""
import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x, t=None):
        out = self.fc2(torch.tanh(self.fc1(x)))
        if t is None:
            return out
        return out, F.mse_loss(out, t)


def test_half_model_keeps_float16_outputs():
    """docs/semantics.md S-45 example: Linear(1, 10).half() with a float16 input returns float16."""
    model = nn.Linear(1, 10).half()
    x = torch.randn(3, 1).half()
    out = poptorch.inferenceModel(model)(x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, model(x))


def test_mixed_half_and_float_follow_type_promotion():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.half_fc = nn.Linear(4, 4).half()
            self.float_fc = nn.Linear(4, 2)

        def forward(self, x_half, y_float):
            h = self.half_fc(x_half)
            return h + y_float, self.float_fc(h.float())

    model = Mixed()
    x, y = torch.randn(2, 4).half(), torch.randn(2, 4)
    s, out = poptorch.inferenceModel(model)(x, y)
    assert s.dtype == torch.float32 and out.dtype == torch.float32
    ref_s, ref_out = model(x, y)
    torch.testing.assert_close(s, ref_s)
    torch.testing.assert_close(out, ref_out)


def test_half_training_matches_plain_pytorch_in_float16():
    """A .half() model trained with float16 inputs: same float16 arithmetic as plain
    PyTorch on the CPU (SGD with float32 update arithmetic, weights rounded to float16:
    within 2 float16 ulps after 10 steps)."""
    model = Net().half()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(10)
    training = poptorch.trainingModel(model, opts,
                                      torch.optim.SGD(model.parameters(), lr=0.05))
    x, t = torch.randn(20, 4).half(), torch.randn(20, 2).half()
    _, loss = training(x, t)
    assert loss.dtype == torch.float16
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for i in range(10):
        opt.zero_grad()
        ref(x[2 * i:2 * i + 2], t[2 * i:2 * i + 2])[1].backward()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float16
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-3, atol=2e-3)


def test_mixed_precision_parameters_train():
    """float16 and float32 parameters in one model: each keeps its dtype; the float16
    part is updated from float16 gradients."""
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc_half = nn.Linear(4, 4).half()
            self.fc = nn.Linear(4, 1)

        def forward(self, x, t):
            return F.mse_loss(self.fc(self.fc_half(x).float()), t)

    model = Mixed()
    ref = copy.deepcopy(model)
    x, t = torch.randn(6, 4).half(), torch.randn(6, 1)
    opts = poptorch.Options().deviceIterations(3)
    poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))(x, t)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(3):
        opt.zero_grad()
        F.mse_loss(ref.fc(ref.fc_half(x[2 * i:2 * i + 2]).float()), t[2 * i:2 * i + 2]) \
            .backward()
        opt.step()
    assert model.fc_half.weight.dtype == torch.float16 and model.fc.weight.dtype == \
        torch.float32
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-3, atol=2e-3)


def test_batchnorm_statistics_keep_the_buffer_dtype():
    model = nn.Sequential(nn.BatchNorm1d(3)).half().train()
    poptorch.inferenceModel(model)(torch.randn(4, 3).half())
    assert model[0].running_mean.dtype == torch.float16


def test_bfloat16_inputs_are_rejected():
    with pytest.raises(poptorch.Error, match="Unsupported tensor input type from pytorch: "
                                             "BFloat16"):
        poptorch.inferenceModel(nn.Identity().float())(torch.randn(2, 2).bfloat16() * 1)


@pytest.mark.parametrize("setter", [
    lambda o: o.Precision.setPartialsType(torch.half),
    lambda o: o.Precision.enableStochasticRounding(True),
], ids=["half-partials", "stochastic-rounding"])
def test_hardware_precision_options_are_accepted_without_numerical_effect(setter):
    """docs/semantics.md S-45 [SIM]: partials type and stochastic rounding are ignored by the IPU
    Model (float partials, round-to-nearest), see the README's "Numerics of the IPU Model"."""
    model = Net().half()
    x = torch.randn(4, 4).half()
    plain = poptorch.inferenceModel(copy.deepcopy(model))(x)
    opts = poptorch.Options()
    setter(opts)
    assert torch.equal(poptorch.inferenceModel(model, opts)(x), plain)


def test_readme_documents_the_numerics():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    text = open(path, encoding="utf-8").read()
    text = text[text.index("## Numerics of the IPU Model"):]
    for phrase in ("setPartialsType", "enableStochasticRounding",
                   "enableFloatingPointExceptions", "accum_type"):
        assert phrase in text


# -- floating-point exceptions (docs/semantics.md S-46)
# ---------------------------------------------------

class Divide(nn.Module):
    def forward(self, x, y):
        return x / y


def _fp(enabled):
    opts = poptorch.Options()
    opts.Precision.enableFloatingPointExceptions(enabled)
    return opts


@pytest.mark.parametrize("d", [1, 3])
def test_division_by_zero_raises_with_exceptions_on(d):
    """docs/semantics.md S-46 example: x / 0 raises with the option on and returns inf with it
    off."""
    x, y = torch.ones(d * 2, 2), torch.zeros(d * 2, 2)
    opts = _fp(True).deviceIterations(d)
    with pytest.raises(poptorch.Error, match="Floating point exception") as info:
        poptorch.inferenceModel(Divide(), opts)(x, y)
    assert info.value.type == "poplar_application_runtime_error"
    out = poptorch.inferenceModel(Divide(), _fp(False).deviceIterations(d))(x, y)
    assert torch.isinf(out).all()


@pytest.mark.parametrize("fn,args", [
    (lambda x: torch.sqrt(x - 2.0), (torch.ones(3),)),                   # invalid: NaN
    (lambda x: torch.log(x - 1.0), (torch.ones(3),)),                     # log(0) = -inf
    (lambda x: torch.exp(x * 100.0), (torch.ones(3),)),                   # overflow
    (lambda x: torch.exp(x) * 1e4, (torch.full((3,), 3.0).half(),)),      # fp16 overflow
    (lambda x: (x / (x - x)) > 0, (torch.zeros(3),)),                     # NaN compared
], ids=["sqrt-negative", "log-zero", "exp-overflow", "half-overflow", "nan-compare"])
def test_floating_point_exceptions(fn, args):
    class M(nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    with pytest.raises(poptorch.Error, match="Floating point exception"):
        poptorch.inferenceModel(M(), _fp(True))(*args)
    poptorch.inferenceModel(M(), _fp(False))(*args)  # off by default: no error


def test_non_finite_inputs_and_constants_are_not_exceptions():
    """Only non-finite values created from finite inputs count: masking with -inf and
    propagating an inf input are fine."""
    class M(nn.Module):
        def forward(self, x, mask):
            return torch.softmax(x.masked_fill(mask, float("-inf")), dim=-1), x * 2

    x = torch.tensor([[1.0, float("inf"), 2.0]])
    mask = torch.tensor([[False, True, False]])
    soft, doubled = poptorch.inferenceModel(M(), _fp(True))(x, mask)
    assert torch.isinf(doubled[0, 1]) and torch.isfinite(soft).all()


def test_floating_point_exception_in_backward_pass_of_training():
    """Loss scaling that overflows float16 gradients raises in the backward pass; the
    device weights are not updated."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, dtype=torch.float16))

        def forward(self, x):
            return poptorch.identity_loss((self.w * x).sum(), reduction="sum")

    model = M()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=30000.0)
    training = poptorch.trainingModel(model, _fp(True), opt)
    x = torch.full((4,), 100.0, dtype=torch.float16)   # gradient 100 × 30000 > 65504
    with pytest.raises(poptorch.Error, match="overflow in the backward pass"):
        training(x)
    # a failed first call commits no compilation (issue 14): nothing ran, nothing changed
    assert not training.isCompiled()
    assert torch.equal(model.w.detach(), torch.ones(4).half())
    training.destroy()
    model = M()
    poptorch.trainingModel(model, _fp(False), poptorch.optim.SGD(
        model.parameters(), lr=0.1, loss_scaling=30000.0))(x)
    assert not torch.isfinite(model.w).all()  # without the option: inf reaches weights
