"""``remove_inference_dropout`` and the rewrite under it, ``remove_dropout``
(passes/dropout.py): in inference sessions every dropout is the identity (docs/semantics.md S-34),
whatever mode the module was captured in; training keeps it."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import MLP, export
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.dropout import remove_dropout, remove_inference_dropout
from popart_compiler.session_options import SessionOptions


class Everything(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 4, num_layers=2, dropout=0.5)

    def forward(self, x):
        a = F.dropout(x, 0.5, True) + F.dropout2d(x[None, None], 0.5, True)[0, 0]
        b = F.alpha_dropout(x, 0.5, True) + F.feature_alpha_dropout(x[None], 0.5, True)[0]
        q = x[None, None]
        c = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)[0, 0]
        return a + b + c + self.lstm(x[:, None])[0][:, 0]


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x)) * 2


def _ops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload)]


@pytest.mark.filterwarnings("ignore:The tensor attributes .*_flat_weights")
def test_every_dropout_becomes_the_identity():
    program = torch.export.export(Everything().train(), (torch.randn(3, 4),), strict=False)
    gm = program.graph_module
    assert any("dropout" in str(n.target) for n in _ops(gm))
    assert remove_dropout(gm) is True
    names = [n.target._schema.name for n in _ops(gm)]
    assert not [name for name in names if "dropout" in name]
    for node in _ops(gm):
        for index, arg in enumerate(node.target._schema.arguments):
            if arg.name in ("dropout", "dropout_p") and index < len(node.args):
                assert node.args[index] == 0.0, node
    assert remove_dropout(gm) is False  # nothing left to change


def test_graph_without_dropout_is_unchanged():
    program = torch.export.export(nn.Linear(2, 2), (torch.randn(1, 2),), strict=False)
    before = str(program.graph_module.graph)
    assert remove_dropout(program.graph_module) is False
    assert str(program.graph_module.graph) == before


def test_inference_removes_the_dropout_node(run_pass):
    model = Dropped().train()
    g = export(model, torch.randn(2, 4))
    assert [n.name for n in _ops(g.module)] == ["linear", "dropout", "mul"]
    assert g.random
    result = run_pass(remove_inference_dropout, g, Compilation(SessionOptions(), False))
    assert result.graph is g and result.changed is True
    assert [n.name for n in _ops(g.module)] == ["linear", "mul"]
    mul = next(n for n in _ops(g.module) if n.name == "mul")
    assert mul.args[0].name == "linear"
    assert not g.random  # refreshed: no random op left
    x = torch.randn(2, 4)
    state = [p.detach() for p in model.parameters()]
    torch.testing.assert_close(g.module(*state, x)[0], model.fc(x).detach() * 2)


def test_training_keeps_dropout(run_pass):
    g = export(Dropped().train(), torch.randn(2, 4))
    before = g.module.code
    result = run_pass(remove_inference_dropout, g, Compilation(SessionOptions(), True))
    assert result.changed is False and g.module.code == before and g.random


def test_inference_without_dropout_is_unchanged(run_pass):
    g = export(MLP(), torch.randn(2, 4))
    before = g.module.code
    result = run_pass(remove_inference_dropout, g, Compilation(SessionOptions(), False))
    assert result.changed is False and g.module.code == before
