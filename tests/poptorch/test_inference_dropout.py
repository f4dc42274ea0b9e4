"""Dropout in inference models is the identity, even for modules left in training mode;
training models keep dropout (docs/semantics.md S-34)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


class EveryDropout(nn.Module):
    """One of every dropout variant, as modules and functions, plus attention dropout."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.5)
        self.dropout1d = nn.Dropout1d(0.5)
        self.dropout2d = nn.Dropout2d(0.5)
        self.dropout3d = nn.Dropout3d(0.5)
        self.alpha = nn.AlphaDropout(0.5)
        self.feature_alpha = nn.FeatureAlphaDropout(0.5)
        self.attention = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)

    def forward(self, x, seq, image, volume):
        h = self.fc(x)
        return (self.dropout(h), self.dropout1d(seq), self.dropout2d(image),
                self.dropout3d(volume), self.alpha(h), self.feature_alpha(image),
                F.dropout(h, 0.3), F.dropout1d(seq, 0.3), F.dropout2d(image, 0.3),
                F.dropout3d(volume, 0.3), F.alpha_dropout(h, 0.3, True),
                F.feature_alpha_dropout(image, 0.3, True), torch.dropout(h, 0.2, True),
                F.scaled_dot_product_attention(seq, seq, seq, dropout_p=0.5),
                self.attention(seq, seq, seq, need_weights=False)[0])


def _inputs():
    torch.manual_seed(1)
    return (torch.randn(4, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 4, 5),
            torch.randn(2, 3, 2, 4, 5))


def _without_dropout(model, inputs):
    """Plain PyTorch with every dropout probability set to 0."""
    x, seq, image, volume = inputs
    ref = copy.deepcopy(model).eval()
    h = ref.fc(x)
    attention = ref.attention(seq, seq, seq, need_weights=False)[0]
    return (h, seq, image, volume, h, image, h, seq, image, volume, h, image, h,
            F.scaled_dot_product_attention(seq, seq, seq), attention)


def test_every_dropout_variant_is_the_identity_in_a_training_mode_inference_model():
    model = EveryDropout().train()
    inputs = _inputs()
    inference = poptorch.inferenceModel(model)
    first = inference(*inputs)
    second = inference(*inputs)
    assert model.training and model.dropout.training  # PopTorch never calls eval()
    for got, again, expected in zip(first, second, _without_dropout(model, inputs)):
        torch.testing.assert_close(got, expected)
        assert torch.equal(got, again)  # deterministic


def test_an_unevaluated_classifier_gives_deterministic_accuracy():
    """Graphcore's MNIST tutorial wraps its model for inference without model.eval()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))
    opts = poptorch.Options().deviceIterations(4)
    inference = poptorch.inferenceModel(model, opts)
    x = torch.randn(32, 16)
    expected = copy.deepcopy(model).eval()(x)
    for _ in range(3):
        torch.testing.assert_close(inference(x), expected)


def test_training_models_keep_dropout():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x):
            out = self.body(x)
            return out, F.mse_loss(out, torch.zeros_like(out))

    training = poptorch.trainingModel(WithLoss(), poptorch.Options().randomSeed(3),
                                      torch.optim.SGD(model.parameters(), lr=0.0))
    out, _ = training(torch.ones(16, 8))
    zeros = (out == 0).float().mean().item()
    assert 0.3 < zeros < 0.7  # about half of the activations dropped


@pytest.mark.parametrize("inplace", [False, True])
def test_inplace_dropout_is_removed_too(inplace):
    class M(nn.Module):
        def forward(self, x):
            y = x * 2
            return F.dropout(y, 0.5, True, inplace=inplace) + 1

    x = torch.randn(6)
    torch.testing.assert_close(poptorch.inferenceModel(M())(x), x * 2 + 1)


def test_lstm_inter_layer_dropout_is_off_in_inference():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 6, num_layers=2, dropout=0.5, batch_first=True).train()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = lstm

        def forward(self, x):
            return self.lstm(x)[0]

    x = torch.randn(2, 3, 4)
    expected = copy.deepcopy(lstm).eval()(x)[0]
    torch.testing.assert_close(poptorch.inferenceModel(M())(x), expected)
