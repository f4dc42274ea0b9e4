"""Loss detection follows the loss (docs/semantics.md S-40): a loss op followed by scalar arithmetic
is still the final loss, and back-propagation starts from the value ``forward``
returns, so the gradient carries the factor."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


class Classifier(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.head = head

    def forward(self, x, t):
        out = self.fc(x)
        return out, self.head(out, t)


HEADS = {
    "kl_div_batchmean": lambda o, t: nn.KLDivLoss(reduction="batchmean")(
        F.log_softmax(o, 1), t),
    "mse_times_half": lambda o, t: F.mse_loss(o, t) * 0.5,
    "mse_divided_by_n": lambda o, t: F.mse_loss(o, t) / o.shape[0],
    "unreduced_then_mean": lambda o, t: F.mse_loss(o, t, reduction="none").mean(),
    "scaled_and_shifted": lambda o, t: 2.0 * F.l1_loss(o, t) - 1.0,
}


@pytest.mark.parametrize("head", sorted(HEADS))
def test_scalar_arithmetic_after_a_loss_is_the_loss(head):
    torch.manual_seed(0)
    model = Classifier(HEADS[head])
    ref = copy.deepcopy(model)
    x, t = torch.randn(5, 6), torch.softmax(torch.randn(5, 4), 1)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.5))
    _, loss = training(x, t)
    _, expected = ref(x, t)
    torch.testing.assert_close(loss, expected.detach())
    expected.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())


def test_the_factor_reaches_the_gradient():
    """loss * 0.5 moves the weights half as far as loss (plain SGD, one step)."""
    def step(factor):
        torch.manual_seed(0)
        model = Classifier(lambda o, t: F.mse_loss(o, t) * factor)
        before = model.fc.weight.detach().clone()
        poptorch.trainingModel(model, optimizer=torch.optim.SGD(
            model.parameters(), lr=0.1))(torch.ones(2, 6), torch.zeros(2, 4))
        return model.fc.weight.detach() - before

    torch.testing.assert_close(step(0.5), step(1.0) * 0.5)


class Tiny(nn.Module):
    """``Linear(2, 2)`` followed by ``body(model, x, t)``."""

    def __init__(self, body):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.body = body

    def forward(self, x, t):
        return self.body(self, x, t)


def _combined_without_identity_loss(m, x, t):
    o = F.log_softmax(m.fc(x), 1)
    return (F.nll_loss(o, t) + 5 * F.nll_loss(o, t)) * 0.5


def _loss_not_returned(m, x, t):
    out = m.fc(x)
    (F.mse_loss(out, t) * 0.5).detach()
    return out


def _loss_returned_twice(m, x, t):
    loss = F.mse_loss(m.fc(x), t)
    return loss * 0.5, loss * 2


@pytest.mark.parametrize("body, target, message", [
    (_combined_without_identity_loss, torch.tensor([1]),
     "Multiple independent losses found in graph"),
    (_loss_not_returned, torch.ones(1, 2), "final loss must be returned"),
    (_loss_returned_twice, torch.ones(1, 2),
     "returns 2 different values computed from its final loss"),
])
def test_losses_that_are_not_one_returned_loss_still_raise(body, target, message):
    with pytest.raises(poptorch.Error, match=message):
        poptorch.trainingModel(Tiny(body))(torch.ones(1, 2), target)


# -- unary math after a loss -----------------------------------------------------------

class _Regressor(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = head

    def forward(self, x, t):
        return self.head(F.mse_loss(self.fc(x), t))


@pytest.mark.parametrize("head", [torch.sqrt, lambda l: l ** 2, torch.log],
                         ids=["rmse_sqrt", "squared", "log"])
def test_unary_math_after_a_loss_is_the_loss(head):
    """RMSE written as ``torch.sqrt(mse_loss(...))`` (docs/semantics.md S-40) trains like
    PyTorch."""
    torch.manual_seed(0)
    model = _Regressor(head)
    ref = copy.deepcopy(model)
    x, t = torch.randn(3, 4), torch.randn(3, 4)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1))
    loss = training(x, t)
    expected = ref(x, t)
    torch.testing.assert_close(loss, expected.detach())
    expected.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    training.copyWeightsToHost()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())
