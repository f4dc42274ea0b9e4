#!/usr/bin/env python3
"""Fine-tune a (tiny) Hugging Face BERT pipelined over 2 IPUs, as in Graphcore's
BERT examples and tutorials, then run it with each pipeline stage in its own process.

The model is ``transformers.BertForSequenceClassification`` annotated the way
Graphcore's examples do it: the embeddings and the first half of the encoder layers on
IPU 0 (``poptorch.BeginBlock(..., ipu_id=0)``), the second half and the classifier on
IPU 1. ``poptorch.Options`` sets ``deviceIterations``, ``gradientAccumulation`` (the
micro-batches in flight in the pipeline) and ``PipelinedExecution``. The script itself
does not mention processes: the same file runs

* in one process, every stage on the IPU Model one after the other::

      python examples/pipelined_bert.py

* with each pipeline stage in its own process (``Options.Distributed.
  pipelineAcrossProcesses``, switched on here by its environment variable), launched
  by ``torchrun`` (or ``poprun``) with one process per stage::

      POPTORCH_PIPELINE_ACROSS_PROCESSES=1 torchrun --nproc-per-node 2 \\
          examples/pipelined_bert.py

Both print the same losses (dropout is off in the tiny config so that the runs can be
compared; with dropout each stage draws from its own random stream). The data are
random token sequences with a label that depends on them (no download needed).
``--out DIR`` writes each process's losses and final weights to ``DIR/rank<i>.pt``.
"""
import argparse
import os
from typing import Dict

import torch
import transformers

import poptorch

#: One call consumes MICRO_BATCH × DEVICE_ITERATIONS × GRADIENT_ACCUMULATION samples.
MICRO_BATCH, DEVICE_ITERATIONS, GRADIENT_ACCUMULATION = 2, 2, 4
SEQUENCE, VOCAB, SAMPLES = 16, 100, 64


def tiny_config() -> transformers.BertConfig:
    """A 4-layer BERT small enough for a CPU, without dropout."""
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=SEQUENCE, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


class PipelinedBertForSequenceClassification(transformers.BertForSequenceClassification):
    """BERT for sequence classification over ``ipus`` IPUs (Graphcore's layout):
    embeddings on IPU 0, the encoder layers spread evenly, the classifier on the last
    IPU. ``forward`` returns ``(loss, logits)`` (the loss first, as with
    ``return_dict=False``)."""

    def parallelize(self, ipus: int = 2) -> "PipelinedBertForSequenceClassification":
        self.bert.embeddings = poptorch.BeginBlock(self.bert.embeddings, "Embedding",
                                                   ipu_id=0)
        layers = self.bert.encoder.layer
        for index, layer in enumerate(layers):
            ipu = index * ipus // len(layers)
            layers[index] = poptorch.BeginBlock(layer, f"Encoder{index}", ipu_id=ipu)
        self.classifier = poptorch.BeginBlock(self.classifier, "Classifier", ipu_id=ipus - 1)
        return self

    def forward(self, input_ids, attention_mask, labels):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                               labels=labels, return_dict=False)


class RandomSentences(torch.utils.data.Dataset):
    """``SAMPLES`` random sequences; the label says whether token 1 is below the
    vocabulary's middle; the last quarter of each sequence is padding."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, VOCAB, (SAMPLES, SEQUENCE), generator=gen)
        self.mask = torch.ones(SAMPLES, SEQUENCE, dtype=torch.long)
        self.mask[:, -SEQUENCE // 4:] = 0
        self.ids[self.mask == 0] = 0
        self.labels = (self.ids[:, 1] < VOCAB // 2).long()

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.ids[i], self.mask[i], self.labels[i]


def options() -> poptorch.Options:
    opts = poptorch.Options().deviceIterations(DEVICE_ITERATIONS).randomSeed(42)
    opts.Training.gradientAccumulation(GRADIENT_ACCUMULATION)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
    opts.showCompilationProgressBar(False)
    return opts


def train(epochs: int = 2) -> Dict[str, object]:
    """Train for ``epochs``; returns the loss of each call and the final weights."""
    torch.manual_seed(0)
    model = PipelinedBertForSequenceClassification(tiny_config()).parallelize().train()
    opts = options()
    loader = poptorch.DataLoader(opts, RandomSentences(), batch_size=MICRO_BATCH)
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=1e-3)
    training = poptorch.trainingModel(model, opts, optimizer)
    losses = []
    for epoch in range(epochs):
        for ids, mask, labels in loader:
            loss, _ = training(ids, mask, labels)
            losses.append(float(loss.mean()))
        print(f"epoch {epoch}: loss {losses[-1]:.5f}")
    training.destroy()
    return {"losses": losses,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", help="write rank<i>.pt (losses, weights) here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = train(args.epochs)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        rank = int(os.environ.get("RANK", "0"))
        torch.save(result, os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
