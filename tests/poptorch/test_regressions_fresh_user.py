"""Regressions found by a fresh-user attack on the fidelity, reliability and
executable-file features (issues 13, 14 and 10)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


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
    """RMSE written as ``torch.sqrt(mse_loss(...))`` (S-40) trains like PyTorch."""
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


def test_every_options_group_can_be_stored_in_an_executable_file(tmp_path):
    """``Options.Backend`` lives in its own module: save() refused it and every
    save / compileAndExport failed (api §5.4)."""
    from poptorch._files import container
    opts = poptorch.Options()
    decoded = container.decode(container.encode(opts))
    assert decoded.Backend.compilerName == opts.Backend.compilerName
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    path = str(tmp_path / "linear.poptorch")
    poptorch.inferenceModel(model).compileAndExport(path, x)
    torch.testing.assert_close(poptorch.load(path)(x), model(x))


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=0.01)], ids=["sgd_momentum", "adam"])
def test_torch_optim_state_survives_save_and_load(tmp_path, make):
    """A ``torch.optim`` optimizer keeps its state only on the device: save() lost
    the momentum / Adam moments, so the loaded model trained differently (S-62)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    trainer = poptorch.trainingModel(
        _Loss(model), optimizer=make(model.parameters()))
    x, t = torch.randn(4, 4), torch.randint(0, 4, (4,))
    for _ in range(2):
        trainer(x, t)
    path = str(tmp_path / "train.poptorch")
    trainer.save(path)
    expected = [trainer(x, t) for _ in range(3)]
    loaded = poptorch.load(path)
    got = [loaded(x, t) for _ in range(3)]
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


class _Loss(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, t):
        return F.cross_entropy(self.body(x), t)


def test_default_options_that_are_not_json(monkeypatch):
    """A malformed POPTORCH_DEFAULT_OPTIONS raised a TypeError from re-raising a
    json.JSONDecodeError; it is a ValueError naming the variable."""
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", "notjson")
    with pytest.raises(ValueError, match="POPTORCH_DEFAULT_OPTIONS='notjson': Expecting"):
        poptorch.Options()


def test_calling_a_loaded_model_after_destroy_says_to_load_again(tmp_path):
    """The error told the user to use 'the executor returned by poptorch.load()',
    which is the one they were calling; it now says to load the file again."""
    x = torch.randn(3, 4)
    model = nn.Linear(4, 2)
    path = str(tmp_path / "linear.poptorch")
    poptorch.inferenceModel(model).compileAndExport(path, x)
    loaded = poptorch.load(path)
    loaded.destroy()
    with pytest.raises(poptorch.Error, match=r"after destroy\(\)\)\. Load the file "
                                             r"again with poptorch\.load\(\)"):
        loaded(x)
    torch.testing.assert_close(poptorch.load(path)(x), model(x))
