"""Errors raised while a model is captured read as eager PyTorch's: they never name the
capture's stand-ins (``FakeTensor``, ``FunctionalTensor``, fx proxies)."""
import pytest
import torch
import torch.nn as nn

import poptorch
from poptorch._capture.eager_words import eager_text


class _Op(nn.Module):
    def __init__(self, op, shape):
        super().__init__()
        self.op = op
        self.w = nn.Parameter(torch.ones(shape))

    def forward(self, *xs):
        out = self.op(xs[0] * self.w, *xs[1:])
        return out, poptorch.identity_loss(out.sum(), reduction="sum")


def _eager_error(op, *inputs):
    with pytest.raises(Exception) as info:
        op(*inputs)
    return info.value


def _scatter_positional_reduce(inp, idx, src):
    return inp.scatter(1, idx, src, "add")  # reduce is keyword-only: a TypeError


def _scatter_value_positional_none(inp, idx):
    return inp.scatter(0, idx, 5.0, None)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("case", ["tensor_src", "value_src"])
def test_refused_op_raises_eager_type_and_text(training, case):
    torch.manual_seed(0)
    inp = torch.randn(3, 3)
    idx = torch.randint(3, (3, 3))
    if case == "tensor_src":
        op, inputs = _scatter_positional_reduce, (inp, idx, torch.randn(3, 3))
    else:
        op, inputs = _scatter_value_positional_none, (inp, idx)
    eager = _eager_error(op, *inputs)
    assert isinstance(eager, TypeError)
    if training:
        model = poptorch.trainingModel(_Op(op, inp.shape))
    else:
        model = poptorch.inferenceModel(_Op(op, inp.shape).eval())
    with pytest.raises(TypeError) as info:
        model(*inputs)
    assert str(info.value) == str(eager)
    assert "FakeTensor" not in str(info.value)
    assert "got (int, Tensor," in str(info.value)


def test_eager_text_rewrites_only_stand_in_names():
    assert eager_text("got (int, FakeTensor, FunctionalTensor)") == "got (int, Tensor, Tensor)"
    assert eager_text("a torch._subclasses.fake_tensor.FakeTensor here") == \
        "a torch.Tensor here"
    assert eager_text("type torch.fx.proxy.Proxy") == "type torch.Tensor"
    # The user's own words stay: a bare "Proxy", "MyFakeTensorLike", "Tensor".
    assert eager_text("Proxy server MyFakeTensorLike Tensor") == \
        "Proxy server MyFakeTensorLike Tensor"


# -- reading a tensor's memory during capture ---------------------------------------------

class _DeepCopies(nn.Module):
    def forward(self, x):
        import copy
        return copy.deepcopy(x) + 1


def test_storage_read_names_the_line_not_fake_tensors():
    model = poptorch.inferenceModel(_DeepCopies())
    with pytest.raises(poptorch.Error) as info:
        model(torch.ones(2))
    text = str(info.value)
    assert "reads the memory of a tensor" in text
    assert f"{__file__}:" in text and "copy.deepcopy(x)" in text
    assert "FakeTensor" not in text and "FunctionalTensor" not in text


_FAKE_LIGHTNING = '''
import copy

import torch


def log(name, value):
    # As Lightning's metric objects do: copy a state tensor made for the value.
    copy.deepcopy(torch.zeros((), dtype=value.dtype))
'''


def test_lightning_log_in_captured_step_says_so(tmp_path, monkeypatch):
    # A stand-in laid out like Lightning: lightning/pytorch/core/module.py's log().
    package = tmp_path / "lightning" / "pytorch" / "core"
    package.mkdir(parents=True)
    (package / "module.py").write_text(_FAKE_LIGHTNING)
    monkeypatch.syspath_prepend(str(package))
    import importlib
    fake = importlib.import_module("module")

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            loss = self.lin(x).sum()
            fake.log("train_loss", loss)
            return poptorch.identity_loss(loss, reduction="sum")

    model = poptorch.trainingModel(Step())
    with pytest.raises(poptorch.Error) as info:
        model(torch.ones(1, 2))
    text = str(info.value)
    assert "calls Lightning's logging" in text
    assert 'fake.log("train_loss", loss)' in text and f"{__file__}:" in text
    assert "on_train_batch_end" in text
    assert "FakeTensor" not in text
