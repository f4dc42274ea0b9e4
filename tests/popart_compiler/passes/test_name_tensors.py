"""``name_tensors`` (passes/anchors.py): ``tensor_names``, every tensor name of the
program (docs/semantics.md S-16, ``PoplarExecutor.getTensorNames()``)."""
import torch
import torch.nn as nn

from models import Classifier, export
from popart_compiler.passes.anchors import name_tensors
from popart_compiler.passes.base import Compilation
from popart_compiler.session_options import SessionOptions

X, T = torch.randn(2, 6), torch.tensor([1, 3])
ACTIVATIONS = ["fc1/Linear:0", "Relu:0", "fc2/Linear:0", "CrossEntropyLoss:0"]


def names(training, **options):
    g = export(Classifier(), X, T)
    before = g.module.code
    c = Compilation(SessionOptions(**options), training)
    result = name_tensors(g, c)
    assert result.graph is g and result.changed is False and g.module.code == before
    return result.compilation.tensor_names


def test_inference_names_weights_then_activations(run_pass):
    g = export(Classifier(), X, T)
    c = Compilation(SessionOptions(), False)
    c = run_pass(name_tensors, g, c).compilation
    assert c.tensor_names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"] + \
        ACTIVATIONS
    assert names(False) == c.tensor_names


def test_training_adds_gradients_and_updated_weights():
    weights = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    state = [f"{kind}___{w}" for w in weights for kind in ("Gradient", "UpdatedVar")]
    assert names(True) == weights + state + ACTIVATIONS
    assert names(True, auto_loss_scaling=True) == \
        weights + ["finalLossScale", "lossScaleUpdateFactor"] + state + ACTIVATIONS


def test_frozen_weights_and_buffers_have_no_gradient():
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.fc.bias.requires_grad_(False)
            self.register_buffer("shift", torch.ones(2))

        def forward(self, x):
            return nn.functional.mse_loss(self.fc(x) + self.shift, x)

    g = export(Frozen(), torch.randn(3, 2))
    c = Compilation(SessionOptions(), True)
    c = name_tensors(g, c).compilation
    assert c.tensor_names == ["fc.weight", "fc.bias", "shift", "Gradient___fc.weight",
                              "UpdatedVar___fc.weight"] + list(g.activation_names())
    assert c.tensor_names[5:7] == ["fc/Linear:0", "Add:0"]
    assert c.tensor_names[-1] == "MseLoss:0"
