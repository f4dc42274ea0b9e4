"""Legacy ``torch.uint8`` masks: ``masked_fill`` / index-put take them as boolean masks,
as PopTorch did, with a one-time deprecation warning."""
import warnings

import pytest
import torch
import torch.nn as nn

import poptorch
from poptorch._capture import dtype_rules


@pytest.fixture
def fresh_warning():
    """Forget that the one-time warning was given."""
    dtype_rules._warned_uint8[0] = False
    yield
    dtype_rules._warned_uint8[0] = False


class MaskedFill(nn.Module):
    def forward(self, x, mask):
        return x.masked_fill(mask, -1.0), torch.masked_fill(x, mask, 5.0)


class IndexPut(nn.Module):
    def forward(self, x, mask):
        y = x.clone()
        y[mask] = 0.0
        z = x.clone()
        z.index_put_((mask,), torch.tensor(7.0))
        return y, z


@pytest.mark.parametrize("model", [MaskedFill, IndexPut])
def test_uint8_masks_act_as_boolean_masks(model, fresh_warning):
    x = torch.randn(2, 5)
    mask = torch.tensor([[1, 0, 1, 0, 0], [0, 0, 0, 1, 2]], dtype=torch.uint8)
    with pytest.warns(UserWarning, match="A torch.uint8 mask is deprecated: PopTorch "
                                         "treats it as a torch.bool mask") as record:
        out = poptorch.inferenceModel(model())(x, mask)
    expected = model()(x, mask.bool())
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want)
    ours = [w for w in record if "uint8 mask" in str(w.message)]
    assert len(ours) == 1  # once, although the model uses the mask twice
    assert ours[0].filename == __file__  # points at the user's forward


def test_the_warning_is_given_once_per_process(fresh_warning):
    mask = torch.tensor([1, 0, 1], dtype=torch.uint8)
    with pytest.warns(UserWarning, match="uint8 mask"):
        poptorch.inferenceModel(MaskedFill())(torch.ones(3), mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = poptorch.inferenceModel(MaskedFill())(torch.ones(3), mask)
    assert out.tolist() == [-1.0, 1.0, -1.0]


def test_boolean_masks_give_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = poptorch.inferenceModel(MaskedFill())(torch.ones(3),
                                                       torch.tensor([True, False, True]))
    assert out.tolist() == [-1.0, 1.0, -1.0]
