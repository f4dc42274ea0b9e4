"""Zero-sized tensors are refused only where the user passes or receives them
(docs/semantics.md S-3): intermediate values of PyTorch's own decompositions (``nn.EmbeddingBag``'s
offsets, GPT-2's empty key/value cache) are computed as in PyTorch."""
import copy
import os

import pytest
import torch
import torch.nn as nn

import poptorch

EMBEDDING_BAGS = {
    "sum": dict(mode="sum"),
    "mean": dict(mode="mean"),
    "max": dict(mode="max"),
    "sum_per_sample_weights": dict(mode="sum", per_sample_weights=True),
    "sum_include_last_offset": dict(mode="sum", include_last_offset=True),
    "mean_include_last_offset": dict(mode="mean", include_last_offset=True),
    "padding_idx": dict(mode="sum", padding_idx=0),
}


class Bag(nn.Module):
    def __init__(self, per_sample_weights=False, **kwargs):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 3, **kwargs)
        self.weighted = per_sample_weights

    def forward(self, indices, offsets, weights):
        if self.weighted:
            return self.bag(indices, offsets, per_sample_weights=weights)
        return self.bag(indices, offsets)


@pytest.mark.parametrize("form", sorted(EMBEDDING_BAGS))
def test_every_embedding_bag_form_equals_pytorch(form):
    torch.manual_seed(0)
    model = Bag(**EMBEDDING_BAGS[form])
    indices = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    offsets = torch.tensor([0, 3, 8]) if "include_last" in form else torch.tensor([0, 3])
    weights = torch.rand(8)
    expected = model(indices, offsets, weights)
    out = poptorch.inferenceModel(copy.deepcopy(model))(indices, offsets, weights)
    torch.testing.assert_close(out, expected)


def test_embedding_bag_trains_like_pytorch():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(10, 3, mode="sum")

        def forward(self, indices, offsets, weights, target):
            out = self.bag(indices, offsets, per_sample_weights=weights)
            return out, nn.functional.mse_loss(out, target)

    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    args = (torch.tensor([1, 2, 4, 5, 4, 3]), torch.tensor([0, 2]), torch.rand(6),
            torch.randn(2, 3))
    poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))(
        *args)
    ref(*args)[1].backward()
    with torch.no_grad():
        ref.bag.weight -= 0.5 * ref.bag.weight.grad
    torch.testing.assert_close(model.bag.weight, ref.bag.weight)


@pytest.mark.slow
def test_gpt2_causal_lm_trains_like_pytorch(monkeypatch):
    """HuggingFace GPT2LMHeadModel (n_embd 64, 2 layers, 4 heads, vocab 200) trained
    with labels: its key/value cache starts from empty tensors even in training."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import transformers  # a test dependency (pyproject.toml: the test extra)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=200,
                                     n_positions=32, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(config).train()

    class CausalLM(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            out = self.model(input_ids=ids, labels=ids)
            return out.logits, out.loss

    model, ref = CausalLM(gpt2), CausalLM(copy.deepcopy(gpt2))
    ids = torch.randint(0, 200, (2, 12))
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        logits, loss = training(ids)
        ref_logits, ref_loss = ref(ids)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, ref_logits.detach(), rtol=1e-4, atol=1e-4)
        optimizer.zero_grad()
        ref_loss.backward()
        optimizer.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_zero_sized_user_inputs_and_outputs_are_still_rejected():
    class M(nn.Module):
        def forward(self, x):
            return x[:0] * 2

    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got "
                                             r"shape \[0, 3\]\)"):
        poptorch.inferenceModel(M())(torch.ones(2, 3))
    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got "
                                             r"shape \[0\]\)"):
        poptorch.inferenceModel(nn.Identity())(torch.ones(0))


@pytest.mark.slow
def test_bert_sequence_classification_trains_like_pytorch(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import transformers
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     vocab_size=100, max_position_embeddings=32,
                                     hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(config).train()

    class Classifier(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids, mask, labels):
            return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss

    model, ref = Classifier(bert), Classifier(copy.deepcopy(bert))
    ids, labels = torch.randint(0, 100, (4, 10)), torch.tensor([0, 1, 1, 0])
    mask = torch.ones(4, 10, dtype=torch.long)
    mask[:, 7:] = 0
    loss = poptorch.trainingModel(model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1))(ids, mask, labels)
    ref_loss = ref(ids, mask, labels)
    torch.testing.assert_close(loss, ref_loss.detach())
    ref_loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


# -- zero-sized user inputs and outputs are refused (docs/semantics.md S-3)
# ------------------------------

def test_zero_sized_inputs_are_rejected():
    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got "
                                             r"shape \[0, 2, 5, 5\]\)"):
        poptorch.inferenceModel(nn.Identity())(torch.ones(0, 2, 5, 5))


def test_zero_sized_outputs_are_rejected():
    class M(nn.Module):
        def forward(self, x):
            return x + 1, torch.zeros(0, 2, 5, 5, device="ipu")

    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got "
                                             r"shape \[0, 2, 5, 5\]\)"):
        poptorch.inferenceModel(M())(torch.ones(1))
