"""The models and rows of ``bench/peers.py``: toy sizes (issue 11) and real sizes
(issue 30).

Toy rows: an MLP (784-512-512-10, micro-batch 32), a CNN (2 × conv + pool, then a
linear layer; 3×32×32, micro-batch 16) and a BERT-style encoder (hidden 384, 6 layers,
6 heads, sequence 128, micro-batch 8); deviceIterations 8.

Real rows (``--rows real``): ResNet-50 v1.5 (``bench/reference_models.py``, built
without torchvision; 3×224×224, inference at micro-batch 32, training at 8), BERT-base
(hidden 768, 12 layers, 12 heads, sequence 128, vocabulary 30522; micro-batch 8, a
2-class head on token 0) and GPT-2 small (hidden 768, 12 layers, 12 heads, sequence 256,
vocabulary 50257, tied LM head, causal attention; training at micro-batch 4 with the
next-token loss over every position); deviceIterations 2 (a call is seconds already).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from reference_models import ResNet50  # bench/ is on sys.path (peers.py puts it there)

__all__ = ["Mlp", "Cnn", "Bert", "Gpt2", "ResNetLogits", "WithLoss", "Row", "ROWS",
           "TOY", "REAL", "MODELS", "DEVICE_ITERATIONS"]

#: Device iterations of the toy rows.
DEVICE_ITERATIONS = 8


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(),
                                 nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.net(x)


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


class EncoderLayer(nn.Module):
    """Post-LN transformer layer (BERT's); ``causal``: GPT's masked attention."""

    def __init__(self, hidden: int, heads: int, causal: bool = False):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                nn.Linear(4 * hidden, hidden))
        self.norm2 = nn.LayerNorm(hidden)

    def attention(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, h // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(att.transpose(1, 2).reshape(b, s, h))

    def forward(self, x):
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.ff(x))


class PreNormLayer(EncoderLayer):
    """Pre-LN transformer layer (GPT-2's)."""

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.ff(self.norm2(x))


class Bert(nn.Module):
    """Encoder over token ids: embedding, ``layers`` layers, a 2-class head on token 0."""

    def __init__(self, hidden=384, layers=6, heads=6, vocab=1000, seq=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.layers = nn.ModuleList([EncoderLayer(hidden, heads) for _ in range(layers)])
        self.head = nn.Linear(hidden, 2)

    def forward(self, ids):
        x = self.emb(ids) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(x[:, 0])


class Gpt2(nn.Module):
    """GPT-2 small over token ids ``[B, seq]`` → logits ``[B, seq, vocab]``: token and
    position embeddings, pre-LN causal layers, a final norm, the LM head tied to the
    token embedding."""

    def __init__(self, hidden=768, layers=12, heads=12, vocab=50257, seq=256):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.01)
        self.layers = nn.ModuleList([PreNormLayer(hidden, heads, causal=True)
                                     for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden)
        nn.init.normal_(self.emb.weight, std=0.02)  # GPT-2's initialisation

    def forward(self, ids):
        x = self.emb(ids) + self.pos
        for layer in self.layers:
            x = layer(x)
        return F.linear(self.norm(x), self.emb.weight)


class ResNetLogits(nn.Module):
    """``bench/reference_models.ResNet50`` (float32, no checkpoints) returning logits
    ``[B, 1000]`` for images ``[B, 3, 224, 224]``."""

    def __init__(self):
        super().__init__()
        self.net = ResNet50()

    def forward(self, images):
        net = self.net
        x = net.stem(images)
        for block in net.layers:
            x = block(x)
        return net.fc(x.mean((2, 3)))


class WithLoss(nn.Module):
    """``(output, cross-entropy)``; outputs ``[B, C]`` with targets ``[B]`` or token
    logits ``[B, S, C]`` with targets ``[B, S]``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, t):
        out = self.model(x)
        return out, F.cross_entropy(out.flatten(0, -2), t.flatten())


@dataclasses.dataclass(frozen=True)
class Row:
    """One model of the benchmark.

    Attributes:
        title: the row's title.
        make: builds the model (random weights).
        data: ``data(n)``: ``n`` input samples.
        targets: ``targets(n)``: the training targets of ``n`` samples.
        inference_mb / training_mb: micro-batch of each mode (``None``: no such row).
        iterations: deviceIterations of a call.
        real: a real-size row (``--rows real``).
    """
    title: str
    make: Callable[[], nn.Module]
    data: Callable[[int], torch.Tensor]
    targets: Callable[[int], torch.Tensor]
    inference_mb: Optional[int]
    training_mb: Optional[int]
    iterations: int = DEVICE_ITERATIONS
    real: bool = False


def _classes(k: int) -> Callable[[int], torch.Tensor]:
    return lambda n: torch.randint(0, k, (n,))


ROWS: Dict[str, Row] = {
    "mlp": Row("MLP 784-512-512-10, mb 32", Mlp, lambda n: torch.randn(n, 1, 28, 28),
               _classes(10), 32, 32),
    "cnn": Row("CNN 2×conv+pool+linear, 3×32×32, mb 16", Cnn,
               lambda n: torch.randn(n, 3, 32, 32), _classes(10), 16, 16),
    "bert": Row("BERT encoder, hidden 384, 6 layers, seq 128, mb 8", Bert,
                lambda n: torch.randint(0, 1000, (n, 128)), _classes(2), 8, 8),
    "resnet50": Row("ResNet-50, 3×224×224, mb 32 / 8", ResNetLogits,
                    lambda n: torch.randn(n, 3, 224, 224), _classes(1000), 32, 8,
                    iterations=2, real=True),
    "bert-base": Row("BERT-base, hidden 768, 12 layers, seq 128, mb 8",
                     lambda: Bert(hidden=768, layers=12, heads=12, vocab=30522),
                     lambda n: torch.randint(0, 30522, (n, 128)), _classes(2), 8, 8,
                     iterations=2, real=True),
    "gpt2": Row("GPT-2 small, seq 256, mb 4", Gpt2,
                lambda n: torch.randint(0, 50257, (n, 256)),
                lambda n: torch.randint(0, 50257, (n, 256)), None, 4,
                iterations=2, real=True),
}
TOY = [k for k, r in ROWS.items() if not r.real]
REAL = [k for k, r in ROWS.items() if r.real]

#: The toy rows as ``(title, class, micro-batch, data, classes)`` (bench/freezing.py).
MODELS = {k: (ROWS[k].title, ROWS[k].make, ROWS[k].inference_mb, ROWS[k].data,
              {"mlp": 10, "cnn": 10, "bert": 2}[k]) for k in TOY}
