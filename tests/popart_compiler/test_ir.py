"""The compiler's view of a captured program (popart_compiler/ir.py): the placeholder
layout, what is written in place, random ops, losses, op names, and the analyses
computed again by ``refresh()`` after a pass changed the module."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import MLP, export


def test_graph_analysis():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)
            self.register_buffer("count", torch.zeros(()))
            self.const = torch.ones(3)

        def forward(self, x, y):
            self.count += 1
            y.mul_(2)
            return F.dropout(self.bn(x), 0.5) + self.const, F.mse_loss(x, y)

    g = export(M().train(), torch.randn(2, 3), torch.randn(2, 3))
    assert g.parameters == ["bn.weight", "bn.bias"]
    assert sorted(g.buffers) == ["bn.num_batches_tracked", "bn.running_mean",
                                 "bn.running_var", "count"]
    assert g.constants == ["const"]
    assert g.mutated_buffers == {"bn.running_mean", "bn.running_var",
                                 "bn.num_batches_tracked", "count"}
    assert g.mutated_inputs == {1}
    assert g.random
    assert [n.name for n in g.final_losses()] == ["mse_loss"]
    assert g.num_user_inputs == 2 and g.num_user_outputs == 2
    names = g.activation_names()
    assert "bn/BatchNorm:0" in names and "Dropout:0" in names


def test_placeholders_user_inputs_and_outputs():
    g = export(MLP(), torch.randn(2, 4))
    assert [n.name for n in g.placeholders] == ["p_fc1_weight", "p_fc1_bias",
                                                "p_fc2_weight", "p_fc2_bias", "x"]
    assert [n.name for n in g.user_input_nodes] == ["x"]
    assert [(i.shape, i.dtype) for i in g.user_inputs] == [((2, 4), torch.float32)]
    assert [(i.shape, i.dtype) for i in g.user_outputs] == [((2, 3), torch.float32)]
    assert g.output_node.op == "output" and [n.name for n in g.output_nodes] == ["linear_1"]
    assert g.has_device_work() and not g.random and not g.runs_per_micro_batch()
    assert not export(nn.Identity(), torch.ones(2)).has_device_work()


def test_refresh_recomputes_the_analyses_after_an_edit():
    """Outputs appended after the user outputs (anchors) never count as user outputs;
    removing the only random op makes the graph deterministic once refreshed."""
    class Drop(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5, True) * 2

    g = export(Drop(), torch.ones(3))
    assert g.random
    dropout = next(n for n in g.module.graph.nodes if "dropout" in str(n.target))
    out = g.output_node
    out.args = (tuple(out.args[0]) + (dropout.args[0],),)  # an anchor on the input
    dropout.replace_all_uses_with(dropout.args[0])
    g.module.graph.erase_node(dropout)
    g.module.recompile()
    assert g.random  # not yet refreshed
    g.refresh()
    assert not g.random and g.num_user_outputs == 1
    assert [n.name for n in g.output_nodes] == ["mul"]
    assert g.module(torch.ones(3))[0].tolist() == [2.0, 2.0, 2.0]
