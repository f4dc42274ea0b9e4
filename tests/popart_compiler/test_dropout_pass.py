"""``popart_compiler.passes.dropout.remove_dropout``: graph in, graph out (spec S-34)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from popart_compiler.passes.dropout import remove_dropout


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
