"""Anchors and tensor names (docs/semantics.md S-15, S-16, docs/api-sections.md api §5.20)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x, t):
        out = self.fc2(F.relu(self.fc1(x)))
        return out, F.mse_loss(out, t)


def test_training_tensor_names():
    m = Net()
    training = poptorch.trainingModel(m)
    training.compile(torch.randn(2, 3), torch.randn(2, 2))
    names = training.getTensorNames()
    for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        assert p in names
        assert f"Gradient___{p}" in names and f"UpdatedVar___{p}" in names
    assert "fc1/Linear:0" in names and "fc2/Linear:0" in names


def test_gradient_and_updated_weight_anchors():
    """``anchorTensor('grad_bias', 'Gradient___fc2.bias')`` returns the reduced gradient
    of the last device iteration (default output mode Final)."""
    m = Net()
    ref = copy.deepcopy(m)
    opts = poptorch.Options()
    opts.anchorTensor("grad_bias", "Gradient___fc2.bias")
    opts.anchorTensor("new_bias", "UpdatedVar___fc2.bias")
    opts.anchorTensor("weight", "fc2.bias")
    training = poptorch.trainingModel(m, opts, torch.optim.SGD(m.parameters(), lr=0.1))
    x, t = torch.randn(2, 3), torch.randn(2, 2)
    training(x, t)
    F.mse_loss(ref(x, t)[0], t).backward()
    torch.testing.assert_close(training.getAnchoredTensor("grad_bias"), ref.fc2.bias.grad)
    expected = ref.fc2.bias.detach() - 0.1 * ref.fc2.bias.grad
    torch.testing.assert_close(training.getAnchoredTensor("new_bias"), expected)
    torch.testing.assert_close(training.getAnchoredTensor("weight"), expected)


def test_anchor_output_modes():
    m = Net()
    opts = poptorch.Options().deviceIterations(4)
    opts.anchorTensor("all_grads", "Gradient___fc2.bias", poptorch.OutputMode.All)
    opts.anchorTensor("every2", "Gradient___fc2.bias", poptorch.OutputMode.EveryN, 2)
    opts.anchorTensor("hidden", "fc1/Linear:0", poptorch.OutputMode.All)
    opts.anchorTensor("last_hidden", "fc1/Linear:0")  # inherits the model's Final
    training = poptorch.trainingModel(m, opts)
    x, t = torch.randn(8, 3), torch.randn(8, 2)
    training(x, t)
    all_grads = training.getAnchoredTensor("all_grads")
    assert all_grads.shape == (8,)  # 4 iterations × [2]
    torch.testing.assert_close(training.getAnchoredTensor("every2"),
                               all_grads.reshape(4, 2)[[1, 3]].reshape(4))
    assert training.getAnchoredTensor("hidden").shape == (8, 4)
    torch.testing.assert_close(training.getAnchoredTensor("last_hidden"),
                               training.getAnchoredTensor("hidden")[-2:])


def test_anchor_values_are_replaced_at_each_call():
    m = Net()
    opts = poptorch.Options()
    opts.anchorTensor("grad", "Gradient___fc1.weight")
    training = poptorch.trainingModel(m, opts)
    x, t = torch.randn(2, 3), torch.randn(2, 2)
    training(x, t)
    first = training.getAnchoredTensor("grad").clone()
    training(x, t)
    assert not torch.equal(first, training.getAnchoredTensor("grad"))


def test_unknown_anchor_fails_at_compile():
    opts = poptorch.Options()
    opts.anchorTensor("nope", "no/such/Tensor:0")
    model = poptorch.inferenceModel(nn.Linear(2, 2), opts)
    with pytest.raises(poptorch.Error, match="Anchored tensor no/such/Tensor:0 not found"):
        model(torch.ones(1, 2))
    assert not model.isCompiled()


def test_debug_ir_lists_scoped_operations():
    model = poptorch.inferenceModel(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    model(torch.ones(1, 2))
    text = model._debugGetPopartIR()
    assert "0/Linear:0" in text and "1/Relu:0" in text


# -- tensor names and activation anchors of inference models ---------------------------

def test_tensor_names_and_activation_anchor():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

        def forward(self, x):
            return self.layer(x) * 2

    m = M()
    probe = poptorch.inferenceModel(m)
    with pytest.raises(AssertionError, match="Model must be compiled before calling "
                                             "getTensorNames"):
        probe.getTensorNames()
    probe(torch.randn(2, 4))
    names = probe.getTensorNames()
    assert "layer.0.weight" in names and "layer/0/Linear:0" in names
    opts = poptorch.Options().deviceIterations(2)
    opts.anchorTensor("hidden", "layer/0/Linear:0")
    model = poptorch.inferenceModel(m, opts)
    with pytest.raises(AssertionError, match="No tensor with name hidden found."):
        model.getAnchoredTensor("hidden")
    x = torch.randn(4, 4)
    model(x)
    torch.testing.assert_close(model.getAnchoredTensor("hidden"), m.layer[0](x).detach())
