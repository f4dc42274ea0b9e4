"""Graphcore's published models, rebuilt the way graphcore/examples builds them, for the
IPU Model's calibration (``bench/calibration.py``).

BERT, GPT-2 and ViT are Hugging Face ``transformers`` models (random weights) with
the changes Graphcore's PopTorch examples make to them, written here from their
description: fused query-key-value projections, a serialised decoder / LM head tied to
the word embeddings, the masked positions of BERT's pre-training gathered with a
one-hot matmul, a ``recomputationCheckpoint`` on the output of every layer, one
``poptorch.BeginBlock`` per layer. ResNet-50 v1.5 is ``reference_models.ResNet50``
(torchvision is not installable here). Everything is built on the ``meta`` device and
converted to float16: the estimates read shapes only.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers.models.bert import modeling_bert

import poptorch

__all__ = ["BertPretraining", "BertSquad", "Gpt2Training", "VitPretraining",
           "layer_ipus", "checkpoint_outputs", "SerializedLinear"]


def layer_ipus(layers_per_ipu: Sequence[int]) -> List[int]:
    """IPU of each layer: ``[0, 2, 1]`` → ``[1, 1, 2]``."""
    return [ipu for ipu, count in enumerate(layers_per_ipu) for _ in range(count)]


def checkpoint_outputs(module: nn.Module) -> None:
    """Put a ``poptorch.recomputationCheckpoint`` on the tensor outputs of ``module``."""
    def hook(_module, _inputs, outputs):
        if isinstance(outputs, torch.Tensor):
            return poptorch.recomputationCheckpoint(outputs)
        return type(outputs)(poptorch.recomputationCheckpoint(o)
                             if isinstance(o, torch.Tensor) else o for o in outputs)
    module.register_forward_hook(hook)


class SerializedLinear(nn.Linear):
    """``nn.Linear`` whose product is ``poptorch.serializedMatMul`` over the output
    channels (Graphcore's serialised decoder and LM head)."""

    def __init__(self, features: int, outputs: int, factor: int, bias: bool):
        super().__init__(features, outputs, bias=bias)
        self.factor = factor

    def forward(self, x):
        y = poptorch.serializedMatMul(x, self.weight.t(),
                                      poptorch.MatMulSerializationMode.OutputChannels,
                                      self.factor)
        return y + self.bias if self.bias is not None else y


class _FusedSelfAttention(modeling_bert.BertSelfAttention):
    """BERT self-attention with one ``hidden × 3 hidden`` projection (Graphcore's
    ``BertFusedSelfAttention``); the attention itself is Hugging Face's eager one."""

    def __init__(self, config):
        super().__init__(config)
        hidden = config.hidden_size
        del self.query, self.key, self.value
        self.qkv = nn.Linear(hidden, 3 * self.all_head_size)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
        q, k, v = self.qkv(hidden_states).split(self.all_head_size, dim=-1)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        out, weights = modeling_bert.eager_attention_forward(
            self, q, k, v, attention_mask,
            dropout=self.dropout.p if self.training else 0.0, scaling=self.scaling)
        return out.reshape(*hidden_states.shape[:-1], -1).contiguous(), weights


def _bert_config(hidden: int, layers: int, heads: int, sequence_length: int,
                 attention_dropout: float = 0.0) -> transformers.BertConfig:
    return transformers.BertConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * hidden, max_position_embeddings=512,
        attention_probs_dropout_prob=attention_dropout, layer_norm_eps=1e-3,
        attn_implementation="eager")


def _pipeline_bert_layers(bert, layers_per_ipu, checkpoint_last=True) -> None:
    for layer in bert.encoder.layer:
        layer.attention.self = _FusedSelfAttention(bert.config)
    ipus = layer_ipus(layers_per_ipu)
    bert.embeddings = poptorch.BeginBlock(bert.embeddings, "Embedding", ipu_id=0)
    for index, layer in enumerate(bert.encoder.layer):
        if checkpoint_last or index != len(bert.encoder.layer) - 1:
            checkpoint_outputs(layer)
        bert.encoder.layer[index] = poptorch.BeginBlock(layer, f"Encoder{index}",
                                                        ipu_id=ipus[index])


class BertPretraining(nn.Module):
    """Graphcore's ``PipelinedBertForPretraining`` (``configs_pretraining.yml``):
    embeddings on IPU 0, the layers by ``layers_per_ipu``, pooler and heads on IPU 0,
    the decoder serialised and tied to the word embeddings, the ``mask_tokens`` masked
    positions gathered by a one-hot matmul. ``forward(input_ids, attention_mask,
    token_type_ids, masked_positions, masked_labels, nsp_labels)`` returns the loss.
    ``annotate=False``: the same model without placement, checkpoints or serialised
    decoder (what ``poptorch.plan`` places, ``bench/plan.py``)."""

    def __init__(self, hidden: int, layers: int, heads: int, layers_per_ipu: Sequence[int],
                 sequence_length: int = 128, mask_tokens: int = 20,
                 embedding_serialization: int = 1, annotate: bool = True):
        super().__init__()
        config = _bert_config(hidden, layers, heads, sequence_length)
        self.config = config
        self.mask_tokens = mask_tokens
        self.sequence_length = sequence_length
        model = transformers.BertForPreTraining(config)
        self.model = model
        if not annotate:  # the same model without placement (for poptorch.plan)
            for layer in model.bert.encoder.layer:
                layer.attention.self = _FusedSelfAttention(config)
            return
        if embedding_serialization > 1:
            decoder = SerializedLinear(hidden, config.vocab_size, embedding_serialization,
                                       bias=True)
            decoder.weight = model.bert.embeddings.word_embeddings.weight
            model.cls.predictions.decoder = decoder
        _pipeline_bert_layers(model.bert, layers_per_ipu)
        model.bert.pooler = poptorch.BeginBlock(model.bert.pooler, "Pooler", ipu_id=0)
        model.cls = poptorch.BeginBlock(model.cls, "Classifier", ipu_id=0)
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids, masked_positions,
                masked_labels, nsp_labels):
        sequence, pooled = self.model.bert(input_ids=input_ids,
                                           attention_mask=attention_mask,
                                           token_type_ids=token_type_ids,
                                           return_dict=False)[:2]
        one_hot = F.one_hot(masked_positions, sequence.shape[1]).to(sequence.dtype)
        masked = torch.matmul(one_hot.detach(), sequence)
        scores, nsp = self.model.cls(masked, pooled)
        mlm_loss = F.cross_entropy(scores.view(-1, self.config.vocab_size),
                                   masked_labels.view(-1), ignore_index=0).float()
        nsp_loss = F.cross_entropy(nsp.view(-1, 2), nsp_labels.view(-1)).float()
        return poptorch.identity_loss(mlm_loss + nsp_loss, reduction="none")

    def example_inputs(self, samples: int):
        s, p = self.sequence_length, self.mask_tokens
        ints = lambda *shape: torch.zeros(shape, dtype=torch.int64, device="meta")  # noqa: E731
        return (ints(samples, s), ints(samples, s), ints(samples, s), ints(samples, p),
                ints(samples, p), ints(samples))


class BertSquad(nn.Module):
    """Graphcore's ``PipelinedBertForQuestionAnswering`` (``configs_squad.yml``):
    the QA head on the last layer's IPU; no checkpoint after the last layer.
    ``forward(input_ids, attention_mask, token_type_ids[, start, end])``: the loss in
    training, the start / end logits in inference."""

    def __init__(self, hidden: int, layers: int, heads: int, layers_per_ipu: Sequence[int],
                 sequence_length: int = 384, attention_dropout: float = 0.1):
        super().__init__()
        config = _bert_config(hidden, layers, heads, sequence_length, attention_dropout)
        self.sequence_length = sequence_length
        model = transformers.BertForQuestionAnswering(config)
        _pipeline_bert_layers(model.bert, layers_per_ipu, checkpoint_last=False)
        model.qa_outputs = poptorch.BeginBlock(model.qa_outputs, "QA Outputs",
                                               ipu_id=len(layers_per_ipu) - 1)
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids, start=None, end=None):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         token_type_ids=token_type_ids, start_positions=start,
                         end_positions=end, return_dict=True)
        if start is None:
            return out.start_logits, out.end_logits
        return poptorch.identity_loss(out.loss, reduction="none")

    def example_inputs(self, samples: int, training: bool = True):
        ints = lambda *shape: torch.zeros(shape, dtype=torch.int64, device="meta")  # noqa: E731
        s = self.sequence_length
        base = (ints(samples, s), ints(samples, s), ints(samples, s))
        return base + (ints(samples), ints(samples)) if training else base


class Gpt2Training(nn.Module):
    """Graphcore's GPT-2 training wrapper (``nlp/gpt2/pytorch/train_gpt2.py``):
    ``wte`` on IPU 0, ``wpe`` on IPU 1, the layers by ``layers_per_ipu``, the LM head
    tied to ``wte``, serialised and on IPU 0; the loss over sequence slices of
    ``serialized_seq_len`` tokens; the vocabulary padded to 50,272 as in the examples'
    ``config*.json``. ``forward(input_ids, labels)`` returns the loss; in
    inference (``training=False``) the logits. ``annotate=False``: the same model
    without placement or checkpoints, its LM head a plain tied ``nn.Linear`` (what
    ``poptorch.plan`` places, ``bench/plan.py``)."""

    def __init__(self, hidden: int, layers: int, heads: int, layers_per_ipu: Sequence[int],
                 sequence_length: int = 1024, embedding_serialization: int = 4,
                 serialized_seq_len: int = 128, training: bool = True, annotate: bool = True):
        super().__init__()
        config = transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads,
                                         n_positions=sequence_length, vocab_size=50272,
                                         attn_implementation="eager")
        self.sequence_length = sequence_length
        self.serialized_seq_len = serialized_seq_len
        self.training_model = training
        model = transformers.GPT2LMHeadModel(config)
        self.model = model
        if not annotate:  # the same model without placement (for poptorch.plan)
            model.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
            model.lm_head.weight = model.transformer.wte.weight
            return
        head = SerializedLinear(hidden, config.vocab_size, embedding_serialization, bias=False)
        head.weight = model.transformer.wte.weight
        model.lm_head = head
        t = model.transformer
        t.wte = poptorch.BeginBlock(t.wte, "wte", ipu_id=0)
        t.wpe = poptorch.BeginBlock(t.wpe, "wpe", ipu_id=1 if len(layers_per_ipu) > 1 else 0)
        ipus = layer_ipus(layers_per_ipu)
        for index, layer in enumerate(t.h):
            if training:
                checkpoint_outputs(layer)
            t.h[index] = poptorch.BeginBlock(layer, f"Encoder{index}", ipu_id=ipus[index])
        model.lm_head = poptorch.BeginBlock(model.lm_head, "LM head", ipu_id=0)
        self.model = model

    def forward(self, input_ids, labels=None):
        hidden = self.model.transformer(input_ids=input_ids, return_dict=False)[0]
        logits = self.model.lm_head(hidden)
        if labels is None:
            return logits
        logits = logits.view(-1, logits.shape[-1])
        labels = labels.view(-1)
        step = self.serialized_seq_len
        loss = None
        for start in range(0, logits.shape[0], step):
            part = F.cross_entropy(logits[start:start + step], labels[start:start + step],
                                   reduction="sum").float()
            loss = part if loss is None else loss + part
        return poptorch.identity_loss(loss / labels.shape[0], reduction="none")

    def example_inputs(self, samples: int):
        ids = torch.zeros(samples, self.sequence_length, dtype=torch.int64, device="meta")
        return (ids, ids.clone()) if self.training_model else (ids,)


class VitPretraining(nn.Module):
    """Graphcore's ``PipelinedViTForImageClassificationPretraining``
    (``vision/vit/pytorch``): embeddings on IPU 0, blocks named after their IPU
    (``AutoStage.SameAsIpu``), a representation layer and the head on the last IPU.
    ``forward(images, labels)`` returns the loss."""

    def __init__(self, layers_per_ipu: Sequence[int], hidden: int = 768, layers: int = 12,
                 heads: int = 12, classes: int = 1000, image_size: int = 224,
                 patch: int = 16, attention_dropout: float = 0.1):
        super().__init__()
        config = transformers.ViTConfig(hidden_size=hidden, num_hidden_layers=layers,
                                        num_attention_heads=heads,
                                        intermediate_size=4 * hidden, image_size=image_size,
                                        patch_size=patch, hidden_dropout_prob=0.1,
                                        attention_probs_dropout_prob=attention_dropout,
                                        layer_norm_eps=1e-6, attn_implementation="eager")
        self.image_size = image_size
        vit = transformers.ViTModel(config, add_pooling_layer=False)
        last = len(layers_per_ipu) - 1
        vit.embeddings = poptorch.BeginBlock(vit.embeddings, "Embedding", ipu_id=0)
        ipus = layer_ipus(layers_per_ipu)
        layers = vit.layers  # ``vit.encoder.layer`` in transformers < 5
        for index, layer in enumerate(layers):
            checkpoint_outputs(layer)
            layers[index] = poptorch.BeginBlock(layer, f"Encoder{ipus[index]}",
                                                ipu_id=ipus[index])
        vit.layernorm = poptorch.BeginBlock(vit.layernorm, "Representation", ipu_id=last)
        self.vit = vit
        self.representation = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, classes)

    def forward(self, images, labels):
        x = self.vit(pixel_values=images, return_dict=False)[0][:, 0]
        logits = self.head(self.representation(x))
        loss = F.cross_entropy(logits.float(), labels)
        return poptorch.identity_loss(loss, reduction="none")

    def example_inputs(self, samples: int):
        s = self.image_size
        return (torch.zeros(samples, 3, s, s, dtype=torch.float16, device="meta"),
                torch.zeros(samples, dtype=torch.int64, device="meta"))
