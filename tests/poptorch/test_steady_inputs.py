"""The steady-state input path (poptorch._executor.call_io.steady_inputs): after a call
that ran, a call with plain tensors of the same dtypes, shapes, devices and layouts skips
binding and validation; anything else takes the full path and raises its errors."""
import pytest
import torch
import torch.nn as nn

import poptorch


class _Affine(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, y):
        return self.lin(x) * y


def _model(iterations: int = 2):
    torch.manual_seed(0)
    net = _Affine().eval()
    opts = poptorch.Options().deviceIterations(iterations)
    return net, poptorch.inferenceModel(net, opts)


def _steady(model):
    return model._state.compiled.steady  # pylint: disable=protected-access


def test_steady_calls_match_pytorch_and_are_remembered():
    net, model = _model()
    assert model.isCompiled() is False
    for seed in range(3):
        torch.manual_seed(seed)
        x, y = torch.randn(4, 4), torch.randn(4, 3)
        out = model(x, y)
        with torch.no_grad():
            torch.testing.assert_close(out, net(x, y))
        assert _steady(model) is not None


def test_changed_dtype_shape_or_device_still_raise_after_steady_calls():
    _, model = _model()
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    model(x, y)
    model(x, y)
    with pytest.raises(poptorch.Error, match="Data type mismatch for x: expected "
                                             "torch.float32 but got torch.float16"):
        model(x.half(), y)
    with pytest.raises(poptorch.Error, match=r"Shape mismatch for y: expected "
                                             r"torch.Size\(\[4, 3\]\) but got"):
        model(x, torch.randn(4, 1))
    with pytest.raises(AssertionError, match="Invalid batch dimension"):
        model(torch.randn(3, 4), y)
    with pytest.raises(poptorch.Error, match="meta device"):
        model(x.to("meta"), y)
    with pytest.raises(poptorch.Error, match="layout"):
        model(x.to_sparse(), y)
    torch.testing.assert_close(model(x, y=y), model(x, y))


def test_keyword_and_non_contiguous_inputs_take_the_full_path_with_real_values():
    net, model = _model()
    x, y = torch.randn(4, 4), torch.randn(3, 4).t()  # y: non-contiguous
    model(x, y.contiguous())
    model(x, y.contiguous())
    out = model(x, y)
    with torch.no_grad():
        torch.testing.assert_close(out, net(x, y))


def test_forward_with_a_default_is_not_remembered():
    class M(nn.Module):
        def forward(self, x, scale=2.0):
            return x * scale

    model = poptorch.inferenceModel(M())
    x = torch.randn(2, 3)
    model(x)
    assert _steady(model) is None
    torch.testing.assert_close(model(x), x * 2.0)


def test_recompile_after_destroy_forgets_the_steady_inputs():
    net, model = _model(iterations=1)
    x, y = torch.randn(1, 4), torch.randn(1, 3)
    model(x, y)
    model(x, y)
    model.destroy()
    out = model(x.double(), y.double())
    assert out.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(out, net(x, y))
    with pytest.raises(poptorch.Error, match="Data type mismatch for x"):
        model(x, y)
