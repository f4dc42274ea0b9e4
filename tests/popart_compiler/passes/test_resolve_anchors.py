"""``resolve_anchors`` (passes/anchors.py): requested anchors (docs/semantics.md S-15) sorted into
state anchors (weights, gradients, updated weights, optimizer state, loss scaling) and activation
anchors, whose values are appended to the graph's outputs after the user outputs, in order."""
import pytest
import torch

from models import MLP, Classifier, export
from popart_compiler.enums import OutputMode
from popart_compiler.errors import Error
from popart_compiler.passes.anchors import resolve_anchors
from popart_compiler.passes.base import Compilation
from popart_compiler.session_options import Anchor, SessionOptions

X, T = torch.randn(2, 6), torch.tensor([1, 3])


def anchors(*names, **options):
    return SessionOptions(anchors=[Anchor(n, OutputMode.All) for n in names], **options)


def outputs(graph):
    return [n.name for n in graph.output_node.args[0]]


def test_activation_anchors_follow_the_user_outputs(run_pass):
    g = export(MLP(), torch.randn(2, 4))
    assert outputs(g) == ["linear_1"]
    c = Compilation(anchors("Relu:0", "fc1/Linear:0"), False)
    result = run_pass(resolve_anchors, g, c)
    assert result.graph is g and result.changed is True
    c = result.compilation
    assert outputs(g) == ["linear_1", "relu", "linear"]
    assert [a.name for a in c.activation_anchors] == ["Relu:0", "fc1/Linear:0"]
    assert c.state_anchors == []
    assert g.num_user_outputs == 1 and [n.name for n in g.output_nodes] == ["linear_1"]
    state = [p.detach() for p in MLP().parameters()]
    x = torch.randn(2, 4)
    out, relu, linear = g.module(*state, x)
    torch.testing.assert_close(relu, torch.relu(linear))


def test_state_anchors_add_no_output(run_pass):
    g = export(Classifier(), X, T)
    c = Compilation(anchors("fc1.weight", "Gradient___fc2.bias", "UpdatedVar___fc1.bias",
                            "Accl___fc2.weight"), True)
    result = run_pass(resolve_anchors, g, c)
    c = result.compilation
    assert result.changed is False and outputs(g) == ["linear_1", "cross_entropy_loss"]
    assert [a.name for a in c.state_anchors] == ["fc1.weight", "Gradient___fc2.bias",
                                                 "UpdatedVar___fc1.bias",
                                                 "Accl___fc2.weight"]
    assert c.activation_anchors == []


def test_loss_scaling_anchors_with_automatic_loss_scaling(run_pass):
    c = Compilation(anchors("finalLossScale", "lossScaleUpdateFactor", "Relu:0",
                            auto_loss_scaling=True), True)
    g = export(Classifier(), X, T)
    c = run_pass(resolve_anchors, g, c).compilation
    assert [a.name for a in c.state_anchors] == ["finalLossScale", "lossScaleUpdateFactor"]
    assert [a.name for a in c.activation_anchors] == ["Relu:0"]
    assert outputs(g) == ["linear_1", "cross_entropy_loss", "relu"]


def test_no_anchors_leave_the_graph_unchanged(run_pass):
    g = export(MLP(), torch.randn(2, 4))
    before = g.module.code
    c = Compilation(SessionOptions(), False)
    result = run_pass(resolve_anchors, g, c)
    c = result.compilation
    assert result.changed is False
    assert g.module.code == before and c.activation_anchors == c.state_anchors == []


@pytest.mark.parametrize("name,training,options", [
    ("nope", False, {}),
    ("Gradient___fc1.weight", False, {}),  # gradients only exist in training
    ("Gradient___nope", True, {}),
    ("finalLossScale", True, {}),  # without automatic loss scaling
])
def test_unknown_anchor(name, training, options):
    g = export(Classifier(), X, T)
    with pytest.raises(Error, match=f"Anchored tensor {name} not found in the graph. Valid "
                                    r"names are listed by PoplarExecutor\.getTensorNames\(\)"):
        resolve_anchors(g, Compilation(anchors(name, **options), training))
