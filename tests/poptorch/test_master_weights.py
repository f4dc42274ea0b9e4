"""Master-weight mixed precision (docs/semantics.md S-45): weighted ops whose activation and weight
dtypes differ compute in the activation's dtype; gradients reach the weights in their
own dtype. (PopTorch tests: ``half_float_test.py``
``test_float16_activations_float32_weights``, ``test_master_weight_training``.)"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


@pytest.mark.parametrize("module, shape", [(lambda: nn.Linear(10, 20), (3, 10)),
                                           (lambda: nn.Conv1d(4, 5, 2), (3, 4, 6))])
def test_float32_weights_with_float16_activations_return_float16(module, shape):
    model = module()
    x = torch.randn(shape).half()
    out = poptorch.inferenceModel(model)(x)
    assert out.dtype == torch.float16
    assert model.weight.dtype == torch.float32
    expected = copy.deepcopy(model).half()(x)  # the same float16 arithmetic
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("module, shape", [(lambda: nn.Linear(10, 20), (3, 10)),
                                           (lambda: nn.Conv1d(4, 5, 2), (3, 4, 6))])
def test_half_model_with_float32_activations_returns_float32(module, shape):
    model = module().half()
    x = torch.randn(shape)
    out = poptorch.inferenceModel(model)(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, copy.deepcopy(model).float()(x))


@pytest.mark.parametrize("op", ["matmul", "mm", "bmm", "addmm", "baddbmm",
                                "conv2d", "conv_transpose1d"])
def test_matmul_family_and_convolutions_compute_in_the_activation_dtype(op):
    w2, w3 = torch.randn(4, 3), torch.randn(2, 4, 3)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w2, self.w3 = nn.Parameter(w2), nn.Parameter(w3)
            self.b = nn.Parameter(torch.randn(3))
            self.k = nn.Parameter(torch.randn(5, 2, 3, 3))
            self.kt = nn.Parameter(torch.randn(5, 2, 3))

        def forward(self, x):
            return {
                "matmul": lambda: x @ self.w2,
                "mm": lambda: torch.mm(x[0], self.w2),
                "bmm": lambda: torch.bmm(x, self.w3),
                "addmm": lambda: torch.addmm(self.b, x[0], self.w2),
                "baddbmm": lambda: torch.baddbmm(self.b, x, self.w3),
                "conv2d": lambda: F.conv2d(x[None], self.k, padding=1),
                "conv_transpose1d": lambda: F.conv_transpose1d(x, self.kt),
            }[op]()

    x = torch.randn(2, 5, 4).half()
    model = M()
    out = poptorch.inferenceModel(model)(x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, copy.deepcopy(model).half()(x), rtol=2e-3, atol=2e-3)


def test_element_wise_ops_keep_type_promotion():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w

    out = poptorch.inferenceModel(M())(torch.ones(3).half())
    assert out.dtype == torch.float32


class LinearMse(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 10)
        self.loss = nn.MSELoss()

    def forward(self, x, target):
        out = self.fc(x)
        return out, self.loss(out, target)


def test_master_weight_training_fits_a_random_target():
    """float32 Linear(10, 10) + MSELoss on float16 inputs and targets, 2,500 SGD steps at
    lr 0.01 (250 per call): the fit reaches 1e-2, the parameters stay float32."""
    torch.manual_seed(42)
    model = LinearMse()
    x, target = torch.randn(1, 10).half(), torch.randn(1, 10).half()
    steps_per_call = 250
    opts = poptorch.Options().deviceIterations(steps_per_call)
    training = poptorch.trainingModel(model, opts,
                                      torch.optim.SGD(model.parameters(), lr=0.01))
    for _ in range(2500 // steps_per_call):
        out, loss = training(x.repeat(steps_per_call, 1), target.repeat(steps_per_call, 1))
    assert out.dtype == torch.float16 and loss.dtype == torch.float16
    assert float(loss) < 1e-2
    for p in model.parameters():
        assert p.dtype == torch.float32
    fitted = model.fc(x.float())
    torch.testing.assert_close(fitted, target.float(), rtol=0, atol=0.2)


def test_gradients_reach_float32_weights_as_float32():
    """One SGD step equals plain PyTorch's step with the weight cast in the graph."""
    torch.manual_seed(0)
    model = LinearMse()
    ref = copy.deepcopy(model)
    x, target = torch.randn(4, 10).half(), torch.randn(4, 10).half()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1))
    training(x, target)
    out = F.linear(x, ref.fc.weight.half(), ref.fc.bias.half())
    F.mse_loss(out, target).backward()
    assert ref.fc.weight.grad.dtype == torch.float32
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.detach(), q.detach())


def test_automatic_loss_scaling_on_a_half_model_fed_float32_data():
    torch.manual_seed(0)
    model = LinearMse().half()
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.setAutomaticLossScaling(True)
    opts.anchorTensor("scale", "finalLossScale")
    training = poptorch.trainingModel(model, opts,
                                      torch.optim.SGD(model.parameters(), lr=0.01))
    x, target = torch.randn(4, 10), torch.randn(4, 10)
    before = copy.deepcopy(model.state_dict())
    losses = [training(x, target)[1] for _ in range(3)]
    for loss in losses:
        assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    assert float(losses[-1]) < float(losses[0])
    for name, p in model.state_dict().items():
        assert p.dtype == torch.float16
        assert not torch.equal(p, before[name])
    assert float(training.getAnchoredTensor("scale").max()) > 1.0  # the scale grew
