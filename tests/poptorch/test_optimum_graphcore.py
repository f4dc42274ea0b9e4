"""Hugging Face optimum-graphcore 0.7.1 runs unchanged: ``IPUTrainer`` trains tiny
BERT, GPT-2 and ViT models pipelined over 2 IPUs with the losses and weights of a
plain-PyTorch run of the same steps.

optimum-graphcore pins old libraries (numpy < 1.24, transformers 4.29.2), so it lives
in its own virtual environment (README, "optimum-graphcore"); without it these tests
are skipped.
"""
import copy
import os

import pytest
import torch

optimum_graphcore = pytest.importorskip("optimum.graphcore")

import poptorch  # noqa: E402
from transformers import (BertConfig, BertForSequenceClassification,  # noqa: E402
                          GPT2Config, GPT2LMHeadModel, ViTConfig,
                          ViTForImageClassification)

# GPT-2 runs 3 forward stages (its tied head is on IPU 0 again): 5 pipeline stages
MICRO_BATCH, ACCUMULATION, STEPS = 2, 6, 3
SAMPLES = MICRO_BATCH * ACCUMULATION * STEPS


class _Dataset(torch.utils.data.Dataset):
    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def _text_samples(n, vocab, seq, classes=None):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    out = []
    for i in range(n):
        sample = {"input_ids": ids[i], "attention_mask": torch.ones(seq, dtype=torch.long)}
        sample["labels"] = (torch.randint(0, classes, (), generator=g) if classes
                            else ids[i].clone())
        out.append(sample)
    return out


def _image_samples(n, size, classes):
    g = torch.Generator().manual_seed(1)
    return [{"pixel_values": torch.randn(3, size, size, generator=g),
             "labels": torch.randint(0, classes, (), generator=g)} for _ in range(n)]


def _bert():
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=16, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg), _text_samples(SAMPLES, 50, 8, classes=2)


def _gpt2():
    cfg = GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg), _text_samples(SAMPLES, 50, 8)


def _vit():
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                    num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    num_labels=3)
    return ViTForImageClassification(cfg), _image_samples(SAMPLES, 8, 3)


class _Trainer(optimum_graphcore.IPUTrainer):
    """The IPUTrainer with a sequential sampler, SGD with momentum and a record of the
    loss each step returns (what a plain-PyTorch run can reproduce exactly)."""

    losses = None

    def _get_train_sampler(self):
        return torch.utils.data.SequentialSampler(self.train_dataset)

    def create_optimizer(self):
        if self.optimizer is None:
            self.optimizer = poptorch.optim.SGD(self.model.parameters(),
                                                lr=self.args.learning_rate, momentum=0.9)
        return self.optimizer

    def training_step(self, model, inputs):
        loss = super().training_step(model, inputs)
        self.losses.append(loss.detach().clone())
        return loss


def _reference(model, samples, lr):
    """Plain PyTorch: each step averages the gradients of ACCUMULATION micro-batches
    (optimum's ReductionType.Mean) and returns the last micro-batch's loss (its
    OutputMode.Final)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    collate = torch.utils.data.default_collate
    losses, i = [], 0
    for _ in range(STEPS):
        opt.zero_grad()
        for _ in range(ACCUMULATION):
            batch = collate(samples[i:i + MICRO_BATCH])
            i += MICRO_BATCH
            loss = model(**batch).loss
            (loss / ACCUMULATION).backward()
        losses.append(loss.detach())
        opt.step()
    return losses


@pytest.mark.parametrize("build", [_bert, _gpt2, _vit], ids=["bert", "gpt2", "vit"])
def test_ipu_trainer_pipelined_over_two_ipus_matches_pytorch(build, tmp_path, monkeypatch):
    monkeypatch.setenv("POPTORCH_IPU_MODEL_AS_HARDWARE", "1")  # optimum asks for a Mk2
    torch.manual_seed(0)
    model, samples = build()
    ipu_config = optimum_graphcore.IPUConfig(
        layers_per_ipu=[1, 1], ipus_per_replica=2, gradient_accumulation_steps=ACCUMULATION,
        embedding_serialization_factor=1)
    args = optimum_graphcore.IPUTrainingArguments(
        output_dir=str(tmp_path), fp32=True, max_steps=STEPS,
        per_device_train_batch_size=MICRO_BATCH, learning_rate=0.05, logging_steps=1,
        report_to=[], seed=0, dataloader_drop_last=True, lr_scheduler_type="constant",
        dataloader_num_workers=0)
    trainer = _Trainer(model=model, ipu_config=ipu_config, args=args,
                       train_dataset=_Dataset(samples))
    trainer.losses = []
    reference = copy.deepcopy(trainer.model)  # the pipelined model, before training
    trainer.train()

    assert trainer.training_model.options.Training.gradient_accumulation == ACCUMULATION
    assert len(trainer.losses) == STEPS
    expected = _reference(reference, samples, lr=0.05)
    for got, want in zip(trainer.losses, expected):
        torch.testing.assert_close(got.reshape(()), want, rtol=1e-5, atol=1e-6)
    trained = dict(trainer.model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(trained[name].detach(), p.detach(), rtol=1e-4, atol=1e-6,
                                   msg=f"weight {name} differs from the PyTorch run")


def test_import_needs_no_stubs():
    """optimum-graphcore imports popart's enums and poptorch._impl's wrapping helpers."""
    import popart
    from poptorch._impl import rewrapModelIfNecessary, unwrapModelIfNecessary
    assert int(popart.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized) == 3
    assert int(popart.SubgraphCopyingStrategy.JustInTime) == 1
    assert callable(rewrapModelIfNecessary) and callable(unwrapModelIfNecessary)
    assert os.path.basename(os.path.dirname(optimum_graphcore.__file__)) == "graphcore"
