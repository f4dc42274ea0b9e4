"""Warnings that reach the user are ours and point at the user's code; PyTorch's notes
about its own internals do not reach users of supported models; the compilation
progress bar writes one final line when stderr is not a terminal."""
import inspect
import io
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import poptorch


def _captured_warnings(fn):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = fn()
    return result, record


def _line_of(fragment: str) -> int:
    """Line number of ``fragment`` in this file."""
    lines, _ = inspect.getsourcelines(sys.modules[__name__])
    return next(i for i, line in enumerate(lines, 1) if fragment in line)


class UserWarns(nn.Module):
    def forward(self, x):
        warnings.warn("my model's own warning", UserWarning, stacklevel=2)
        return x * 2


class TorchWarnsAtUserLine(nn.Module):
    def forward(self, x):
        return torch.tensor(x) + 1  # torch: "To copy construct from a tensor ..."


@pytest.mark.parametrize("model, message, line", [
    (UserWarns, "my model's own warning", "my model's own warning\", UserWarning"),
    (TorchWarnsAtUserLine, "To copy construct from a tensor", "torch.tensor(x) + 1"),
])
def test_warnings_raised_during_capture_point_at_the_user_line(model, message, line):
    _, record = _captured_warnings(
        lambda: poptorch.inferenceModel(model())(torch.ones(2)))
    ours = [w for w in record if message in str(w.message)]
    assert ours, [str(w.message) for w in record]
    for w in ours:
        assert (w.filename, w.lineno) == (__file__, _line_of(line))


def test_host_output_warning_points_at_the_call():
    constant = torch.tensor([42.])

    class HostOutput(nn.Module):
        def forward(self, x):
            return x + 1, constant

    model = poptorch.inferenceModel(HostOutput())
    _, record = _captured_warnings(lambda: model(torch.ones(2)))  # the call: this line
    ours = [w for w in record if "Output expected to be on the IPU" in str(w.message)]
    assert len(ours) == 1
    assert (ours[0].filename, ours[0].lineno) == (__file__, _line_of("the call: this line"))


def test_lstm_capture_gives_no_torch_internal_warning():
    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(4, 8, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0]

    model = Recurrent().eval()
    x = torch.randn(2, 3, 4)
    out, record = _captured_warnings(lambda: poptorch.inferenceModel(model)(x))
    assert [str(w.message) for w in record] == []
    torch.testing.assert_close(out, model(x))


def test_vectorized_inference_gives_no_vmap_fallback_warning():
    """torch.renorm has no vmap batching rule: vectorising the micro-batches falls back
    to a loop inside vmap, which PyTorch reports with "please file us an issue"."""
    class Renorm(nn.Module):
        def forward(self, x):
            return torch.renorm(x, 2, 0, 1.0)

    x = torch.randn(8, 3, 5)
    out, record = _captured_warnings(
        lambda: poptorch.inferenceModel(Renorm(), poptorch.Options().deviceIterations(4))(x))
    assert [str(w.message) for w in record] == []
    torch.testing.assert_close(out, torch.cat([torch.renorm(c, 2, 0, 1.0)
                                               for c in x.split(2)]))


def test_progress_bar_writes_one_line_when_stderr_is_not_a_terminal(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    poptorch.inferenceModel(nn.Linear(2, 2))(torch.ones(1, 2))
    text = stream.getvalue()
    assert "\r" not in text
    lines = [line for line in text.splitlines() if "Graph compilation" in line]
    assert len(lines) == 1
    assert lines[0].startswith("Graph compilation: 100%|") and "10/10" in lines[0]


def test_progress_bar_is_animated_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    poptorch.inferenceModel(nn.Linear(2, 2))(torch.ones(1, 2))
    assert stream.getvalue().count("Graph compilation") > 1


@pytest.mark.slow
def test_bert_style_sdpa_inference_prints_no_vmap_note(monkeypatch, capfd):
    """HuggingFace BERT inference over several micro-batches vectorises attention whose
    CPU kernel has no batching rule; PyTorch's note about it is printed from inside its
    dispatcher (on stderr, not as a Python warning)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import transformers
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64,
                                     vocab_size=100, max_position_embeddings=32)
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(config).train()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask):
            return self.bert(input_ids=ids, attention_mask=mask).logits

    ids = torch.randint(0, 100, (8, 10))
    mask = torch.ones(8, 10, dtype=torch.long)
    mask[:, 7:] = 0
    model = poptorch.inferenceModel(Logits(), poptorch.Options().deviceIterations(4))
    out, record = _captured_warnings(lambda: model(ids, mask))
    err = capfd.readouterr().err
    assert "performance drop" not in err and "file us an issue" not in err
    assert not [str(w.message) for w in record if "performance drop" in str(w.message)]
    bert.eval()  # dropout is the identity in inference models (docs/semantics.md S-34)
    torch.testing.assert_close(out, Logits()(ids, mask), rtol=1e-5, atol=1e-5)
