"""BERT and ResNet-50 built from their published configurations, for the IPU Model's
estimates (``bench/ipu_estimates.py`` and the calibration tests).

The models are written compactly here (no pretrained weights, no extra dependency) and
are meant to be built on the ``meta`` device: the estimates only read shapes, so
BERT-Large is captured without allocating its 340 M parameters.

BERT follows Devlin et al. (2019) / the Hugging Face ``BertForPreTraining`` layout
(post-layer-norm encoder, GELU feed-forward, masked-LM head tied to the word
embeddings, next-sentence head). ResNet-50 follows He et al. (2016), v1.5 (stride on
the 3×3 convolution of each bottleneck).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

__all__ = ["BertConfig", "BERT_LARGE", "BERT_BASE", "BertForPreTraining", "ResNet50",
           "capture_for_estimate", "recomputation_checkpoint"]


def _checkpoint_op():
    """An identity op named ``recomputation_checkpoint``: the IPU Model recognises
    steering ops by name (as it does ``poptorch.recomputationCheckpoint``'s op), and a
    local definition keeps these captures independent of how ``poptorch``'s ops
    behave outside a wrapper."""
    @torch.library.custom_op("poptorch_reference::recomputation_checkpoint",
                             mutates_args=())
    def _checkpoint(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    _checkpoint.register_fake(lambda x: torch.empty_like(x))
    _checkpoint.register_autograd(lambda ctx, grad: grad)
    return _checkpoint


#: The recomputation checkpoint of these models (see :func:`_checkpoint_op`).
recomputation_checkpoint = _checkpoint_op()


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """BERT hyper-parameters (defaults: BERT-Large, sequence length 128)."""
    vocab_size: int = 30522
    hidden: int = 1024
    layers: int = 24
    heads: int = 16
    intermediate: int = 4096
    max_positions: int = 512
    type_vocab: int = 2
    sequence_length: int = 128
    max_predictions: int = 20
    recompute_checkpoint_every_layer: bool = True


BERT_LARGE = BertConfig()
BERT_BASE = BertConfig(hidden=768, layers=12, heads=12, intermediate=3072)


class _Layer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden)
        self.out = nn.Linear(c.hidden, c.hidden)
        self.norm1 = nn.LayerNorm(c.hidden)
        self.ffn_in = nn.Linear(c.hidden, c.intermediate)
        self.ffn_out = nn.Linear(c.intermediate, c.hidden)
        self.norm2 = nn.LayerNorm(c.hidden)
        self.checkpoint = c.recompute_checkpoint_every_layer

    def forward(self, x, mask):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(
            2, 0, 3, 1, 4).unbind(0)
        scores = q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5 + mask
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
        x = self.norm1(x + self.out(context))
        x = self.norm2(x + self.ffn_out(F.gelu(self.ffn_in(x))))
        if self.checkpoint:
            x = recomputation_checkpoint(x)
        return x


class BertForPreTraining(nn.Module):
    """BERT with the masked-LM and next-sentence heads; ``forward`` returns the
    combined loss (``ids``, ``types``, ``mask``: ``[B, S]`` int64; ``positions``,
    ``labels``: ``[B, P]`` int64, the masked positions and their tokens, P =
    ``max_predictions`` as in Graphcore's pre-training, which decodes only those;
    ``nsp``: ``[B]`` int64)."""

    def __init__(self, c: BertConfig = BERT_LARGE):
        super().__init__()
        self.config = c
        self.word = nn.Embedding(c.vocab_size, c.hidden)
        self.position = nn.Embedding(c.max_positions, c.hidden)
        self.token_type = nn.Embedding(c.type_vocab, c.hidden)
        self.embedding_norm = nn.LayerNorm(c.hidden)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.layers))
        self.transform = nn.Linear(c.hidden, c.hidden)
        self.transform_norm = nn.LayerNorm(c.hidden)
        self.decoder_bias = nn.Parameter(torch.zeros(c.vocab_size))
        self.pooler = nn.Linear(c.hidden, c.hidden)
        self.nsp = nn.Linear(c.hidden, 2)

    def forward(self, ids, types, mask, masked, labels, nsp):
        s = ids.shape[1]
        positions = torch.arange(s, device=ids.device)
        x = self.word(ids) + self.position(positions) + self.token_type(types)
        x = self.embedding_norm(x)
        additive = (1.0 - mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, additive)
        picked = torch.gather(x, 1, masked[:, :, None].expand(-1, -1, x.shape[-1]))
        t = self.transform_norm(F.gelu(self.transform(picked)))
        logits = t @ self.word.weight.t() + self.decoder_bias
        mlm = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1),
                              ignore_index=-100)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        nsp_loss = F.cross_entropy(self.nsp(pooled).float(), nsp)
        return poptorch.identity_loss(mlm + nsp_loss, reduction="none")

    def example_inputs(self, micro_batch: int, device="meta"):
        s, p = self.config.sequence_length, self.config.max_predictions
        ints = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=device)  # noqa: E731
        return (ints(micro_batch, s), ints(micro_batch, s), ints(micro_batch, s),
                ints(micro_batch, p), ints(micro_batch, p), ints(micro_batch))


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int, keep_all: bool = False):
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))
        self.keep_all = keep_all

    def forward(self, x):
        keep = recomputation_checkpoint if self.keep_all else (lambda t: t)
        y = F.relu(keep(self.bn1(keep(self.conv1(x)))))
        y = F.relu(keep(self.bn2(keep(self.conv2(y)))))
        y = keep(self.bn3(keep(self.conv3(y))))
        return F.relu(y + (x if self.down is None else keep(self.down(x))))


class ResNet50(nn.Module):
    """ResNet-50 v1.5 for 224×224 ImageNet images; ``forward(images, labels)`` returns
    the cross-entropy loss (``images``: ``[B, 3, 224, 224]`` float16, or uint8 with
    ``eight_bit_input``; ``labels``: ``[B]``).

    Args:
        classes: output classes.
        checkpoint_stages: a recomputation checkpoint after every bottleneck.
        checkpoint_blocks: bottlenecks (0 … 15) whose residual add is checkpointed.
        keep_blocks: bottlenecks whose every convolution and norm output is a
            checkpoint (nothing recomputed there).
        eight_bit_input: images arrive as uint8 and are normalised on the device
            (Graphcore's ``eight_bit_io`` with ``normalization_location: ipu``).
        label_smoothing: of the cross-entropy loss.
    """

    def __init__(self, classes: int = 1000, checkpoint_stages: bool = False,
                 checkpoint_blocks: Sequence[int] = (), keep_blocks: Sequence[int] = (),
                 eight_bit_input: bool = False, label_smoothing: float = 0.0):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks: List[nn.Module] = []
        cin = 64
        for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(_Bottleneck(cin, width, stride if i == 0 else 1,
                                          keep_all=len(blocks) in keep_blocks))
                cin = width * 4
        self.layers = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, classes)
        self.checkpointed = set(range(len(blocks))) if checkpoint_stages else \
            set(checkpoint_blocks) | set(keep_blocks)
        self.eight_bit_input = eight_bit_input
        self.label_smoothing = label_smoothing

    def forward(self, images, labels):
        if self.eight_bit_input:
            weight = self.fc.weight
            images = (images.to(weight.dtype) / 255.0 - 0.45) / 0.225
        x = self.stem(images)
        for index, block in enumerate(self.layers):
            x = block(x)
            if index in self.checkpointed:
                x = recomputation_checkpoint(x)
        logits = self.fc(x.mean((2, 3)))
        return F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)

    def example_inputs(self, micro_batch: int, dtype=torch.float16, device="meta"):
        dtype = torch.uint8 if self.eight_bit_input else dtype
        return (torch.zeros(micro_batch, 3, 224, 224, dtype=dtype, device=device),
                torch.zeros(micro_batch, dtype=torch.int64, device=device))


def capture_for_estimate(model: nn.Module, inputs: Sequence[torch.Tensor],
                         dtype: Optional[torch.dtype] = torch.float16):
    """Capture ``model`` built on the ``meta`` device for the IPU Model's estimates.

    Args:
        model: a module whose parameters are on the ``meta`` device.
        inputs: one micro-batch of example inputs (``meta`` tensors).
        dtype: floating dtype of the parameters (``None``: keep).

    Returns:
        popart_compiler.ir.Graph: the captured program (shapes only, no data).
    """
    from popart_compiler.ir import Graph
    if dtype is not None:
        model = model.to(dtype)
    with torch.no_grad():
        program = torch.export.export(model, tuple(inputs), strict=False)
    return Graph(program)
