"""Small models for the planner's tests (``test_plan.py``); ``factory`` is the
command line's ``MODULE:FACTORY`` example."""
import torch
import torch.nn as nn


class Block(nn.Module):
    """A pre-norm MLP block with a residual."""

    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """Embedding, ``layers`` blocks, a norm and an LM head tied to the embedding;
    ``forward(ids, labels)`` returns the cross-entropy loss."""

    def __init__(self, vocab=1024, d=48, layers=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.vocab = vocab

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), labels.reshape(-1))

    def example_inputs(self, batch=2, sequence=32):
        g = torch.Generator().manual_seed(1)
        return (torch.randint(0, self.vocab, (batch, sequence), generator=g),
                torch.randint(0, self.vocab, (batch, sequence), generator=g))


class Classifier(nn.Module):
    """An MLP classifier (``nn.Sequential`` layers); ``forward(x)`` returns logits."""

    def __init__(self, d=32, layers=4, classes=10):
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(d, d) for _ in range(layers)])
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        return self.out(self.body(x))


class Stage(nn.Module):
    """A stage of ``depth`` blocks (an ``nn.ModuleList``) and a ``downsample`` linear
    (a Swin stage's blocks and patch merging)."""

    def __init__(self, d, depth):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(depth)])
        self.downsample = nn.Linear(d, d)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.downsample(x)


class Staged(nn.Module):
    """A Swin-like nested model: an embedding, stages (``nn.ModuleList``) of blocks
    (``nn.ModuleList`` each), a norm and a classifier; ``forward(x, labels)`` returns
    the cross-entropy loss of ``x`` ``[batch, tokens, d]``."""

    def __init__(self, d=48, depths=(1, 3), classes=10):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.stages = nn.ModuleList([Stage(d, n) for n in depths])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)
        self.d = d

    def forward(self, x, labels):
        x = self.embed(x)
        for stage in self.stages:
            x = stage(x)
        logits = self.head(self.norm(x).mean(dim=1))
        return nn.functional.cross_entropy(logits, labels)

    def example_inputs(self, batch=2, tokens=32):
        g = torch.Generator().manual_seed(1)
        return (torch.randn(batch, tokens, self.d, generator=g),
                torch.randint(0, 10, (batch,), generator=g))


def factory():
    """The command line's example: ``(model, example_inputs)``."""
    torch.manual_seed(0)
    model = TinyLM()
    return model, model.example_inputs()
