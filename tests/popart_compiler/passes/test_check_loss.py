"""``check_loss`` (passes/checks.py): a training graph has exactly one final loss,
returned once by ``forward`` (docs/semantics.md S-40); its output index is returned as
``loss_index``."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import MLP, Classifier, export
from popart_compiler.errors import Error
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.checks import check_loss
from popart_compiler.session_options import SessionOptions

X, T = torch.randn(2, 6), torch.tensor([1, 3])


class Body(nn.Module):
    """``Linear(6, 4)`` then ``body(out, t)``."""

    def __init__(self, body):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.body = body

    def forward(self, x, t):
        return self.body(self.fc(x), t)


def training(run_pass, body):
    g = export(Body(body), X, T)
    c = Compilation(SessionOptions(), True)
    result = run_pass(check_loss, g, c)
    assert result.graph is g and result.changed is False
    return result.compilation


def test_inference_needs_no_loss(run_pass):
    c = Compilation(SessionOptions(), False)
    result = run_pass(check_loss, export(MLP(), torch.randn(2, 4)), c)
    assert result.changed is False and result.compilation.loss_index is None


def returned_and_scaled(loss):
    """The loss itself is returned: a value computed from it is just another output."""
    return loss, loss * 2


@pytest.mark.parametrize("body,index", [
    (lambda out, t: (out, F.cross_entropy(out, t)), 1),
    (lambda out, t: (F.cross_entropy(out, t), out), 0),
    (lambda out, t: (out, F.cross_entropy(out, t) * 0.5), 1),  # scalar arithmetic
    (lambda out, t: (out, torch.sqrt(F.mse_loss(out, F.one_hot(t, 4).float()))), 1),
    (lambda out, t: returned_and_scaled(F.cross_entropy(out, t)), 0),
], ids=["second", "first", "scaled", "rmse", "returned_and_scaled"])
def test_loss_index_is_recorded(run_pass, body, index):
    assert training(run_pass, body).loss_index == index


def test_classifier_loss_is_output_1(run_pass):
    c = Compilation(SessionOptions(), True)
    c = run_pass(check_loss, export(Classifier(), X, T), c).compilation
    assert c.loss_index == 1


def twice(loss):
    return loss * 2, loss * 3


@pytest.mark.parametrize("body,message", [
    (lambda out, t: out * 2,
     r"Couldn't find a loss in graph! A training model must compute its loss"),
    (lambda out, t: (F.cross_entropy(out, t), F.l1_loss(out, out * 0)),
     r"Multiple independent losses found in graph\. Graph must have one final loss\. "
     r"Wrap final graph loss in poptorch\.identity_loss\. \(Losses: cross_entropy_loss, "
     r"l1_loss"),
    (lambda out, t: twice(F.cross_entropy(out, t)),
     r"The model's forward returns 2 different values computed from its final loss "
     r"\(outputs 0, 1\)"),
    (lambda out, t: (out, F.cross_entropy(out, t).detach()),
     r"The final loss must be returned by the model's forward"),
], ids=["none", "two", "returned_twice", "not_returned"])
def test_loss_errors(body, message):
    g = export(Body(body), X, T)
    with pytest.raises(Error, match=message):
        check_loss(g, Compilation(SessionOptions(), True))
