"""Data types at the IPU boundary (docs/semantics.md S-44, S-45, S-47): 64-bit values come back as
32-bit, other types pass through, bfloat16 and complex inputs are refused (float16
models: ``test_precision.py``)."""
import pytest
import torch
import torch.nn as nn

import poptorch


def test_64_bit_outputs_come_back_as_32_bit():
    class M(nn.Module):
        def forward(self, x, y):
            return (x + y).type(torch.float64), torch.arange(3), x.long()

    out = poptorch.inferenceModel(M())(torch.ones(1), torch.ones(1))
    assert [t.dtype for t in out] == [torch.float32, torch.int32, torch.int32]
    assert out[0].item() == 2.0 and out[1].tolist() == [0, 1, 2]


def test_64_bit_inputs_and_parameters():
    m = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    model = poptorch.inferenceModel(m)
    out = model(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, m(x).float().detach(), rtol=1e-5, atol=1e-6)
    assert m.weight.dtype == torch.float64  # host keeps its dtype
    ints = poptorch.inferenceModel(nn.Identity())(torch.tensor([1, 2]))
    assert ints.dtype == torch.int32 and ints.tolist() == [1, 2]


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16,
                                   torch.int32, torch.float16, torch.float32])
def test_other_dtypes_pass_through(dtype):
    x = torch.tensor([1, 0, 1]).to(dtype)
    out = poptorch.inferenceModel(nn.Identity())(x)
    assert out.dtype == dtype and torch.equal(out, x)


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "BFloat16"),
                                        (torch.complex64, "ComplexFloat")])
def test_unsupported_input_dtype(dtype, name):
    model = poptorch.inferenceModel(nn.Identity())
    with pytest.raises(poptorch.Error, match=f"Unsupported tensor input type from pytorch: "
                                             f"{name}"):
        model(torch.ones(2, dtype=dtype))
    assert not model.isCompiled()
    assert model(torch.ones(2)).tolist() == [1.0, 1.0]
