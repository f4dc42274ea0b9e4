"""The tiny models that many test files use, defined once, with the plain-PyTorch
training loop the tests compare PopTorch's training against.

Importable as ``models`` from any test (``tests/conftest.py`` loads it by its path; a
subprocess started by a test loads it the same way). Nothing here imports ``poptorch``,
so the compiler's tests (``tests/popart_compiler/``) use it too.

Layers are created in the order of their attributes (``fc1`` then ``fc2``), so a model
built after ``torch.manual_seed(s)`` has the same weights as the per-file classes it
replaced.
"""
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from popart_compiler.ir import Graph

__all__ = ["MLP", "Classifier", "BNClassifier", "SingleLinear", "export", "classifier_data",
           "reference_training", "assert_same_weights"]


class MLP(nn.Module):
    """``fc2(activation(fc1(x)))``.

    Args:
        sizes: ``(in, hidden, out)`` features; ``x`` is ``[batch, in]`` float32, the
            output ``[batch, out]``.
        activation: the element-wise function between the layers (default ReLU).
    """

    def __init__(self, sizes: Sequence[int] = (4, 8, 3),
                 activation: Callable[[torch.Tensor], torch.Tensor] = torch.relu):
        super().__init__()
        self.fc1 = nn.Linear(sizes[0], sizes[1])
        self.fc2 = nn.Linear(sizes[1], sizes[2])
        self.activation = activation

    def forward(self, x):
        return self.fc2(self.activation(self.fc1(x)))


class Classifier(MLP):
    """An :class:`MLP` (default ``6 → 8 → 4``) that returns ``(out, cross-entropy
    loss)`` when given the int64 class indices ``t`` (``[batch]``), else ``out``."""

    def __init__(self, sizes: Sequence[int] = (6, 8, 4),
                 activation: Callable[[torch.Tensor], torch.Tensor] = torch.relu):
        super().__init__(sizes, activation)

    def forward(self, x, t=None):
        out = super().forward(x)
        return out if t is None else (out, F.cross_entropy(out, t))


class BNClassifier(nn.Module):
    """``BatchNorm1d(features)`` then ``Linear(features, classes)``; returns
    ``(out, cross-entropy loss)``. Its running statistics are buffers written in place
    by training."""

    def __init__(self, features: int = 4, classes: int = 3):
        super().__init__()
        self.bn = nn.BatchNorm1d(features)
        self.fc = nn.Linear(features, classes)

    def forward(self, x, t):
        out = self.fc(self.bn(x))
        return out, F.cross_entropy(out, t)


class SingleLinear(nn.Module):
    """One linear layer ``fc`` (default ``6 → 20``)."""

    def __init__(self, in_features: int = 6, out_features: int = 20):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return self.fc(x)


def export(module: nn.Module, *args) -> Graph:
    """``module`` captured with ``torch.export`` (non-strict, as PopTorch captures) as
    the compiler's :class:`~popart_compiler.ir.Graph`; ``args`` is one micro-batch."""
    return Graph(torch.export.export(module, args, strict=False))


def classifier_data(n: int, seed: int = 0):
    """``n`` samples for a :class:`Classifier` of the default sizes: a ``[n, 6]`` float32
    input and ``[n]`` int64 class indices below 4, from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def reference_training(model: nn.Module, optimizer, x, t, d: int, a: int, r: int,
                       reduction: str = "mean", clip: float = None):
    """What a PopTorch training call computes, in plain PyTorch.

    Per device iteration (``d``), ``a × r`` micro-batches in PopTorch's order
    (docs/semantics.md S-13: accumulation step, then replica), each loss divided by ``a × r`` for
    the ``"mean"`` reduction (docs/semantics.md S-41), the gradients clipped to the global norm
    ``clip`` if given, then one ``optimizer.step()``.

    Args:
        model: returns ``(out, loss)`` for ``model(x, t)``.
        x, t: the call's inputs, ``d × a × r`` micro-batches along dimension 0.

    Returns:
        ``(outputs, losses)``: the detached output and loss of every micro-batch, in
        order.
    """
    micro = x.shape[0] // (d * a * r)
    outs, losses = [], []
    for i in range(d):
        optimizer.zero_grad()
        for step in range(a):
            for rep in range(r):
                row = ((i * a + step) * r + rep) * micro
                out, loss = model(x[row:row + micro], t[row:row + micro])
                (loss / (a * r) if reduction == "mean" else loss).backward()
                outs.append(out.detach())
                losses.append(loss.detach())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return outs, losses


def assert_same_weights(a: nn.Module, b: nn.Module, **tol) -> None:
    """Every parameter of ``a`` equals the same parameter of ``b``
    (``torch.testing.assert_close`` with ``tol``; the message names the parameter)."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=name, **tol)


def assert_uploads_used_without_recompiling(module: nn.Module, model, x: torch.Tensor,
                                            compiles) -> None:
    """``model`` (a poptorch wrapper of ``module``) gives ``module``'s results for ``x``
    (rtol and atol 1e-5), and again after new weights are written into ``module`` in
    place and uploaded with ``copyWeightsToDevice``, with ``compiles()`` (a compilation
    counter) unchanged by the upload."""
    torch.testing.assert_close(model(x), module(x).detach(), rtol=1e-5, atol=1e-5)
    count = compiles()
    upload_new_weights(module, model)
    torch.testing.assert_close(model(x), module(x).detach(), rtol=1e-5, atol=1e-5)
    assert compiles() == count


def upload_new_weights(module: nn.Module, model, scale: float = 0.5,
                       shift: float = -0.1) -> None:
    """Write ``p * scale + shift`` into every parameter of ``module`` in place, then
    upload them with ``model.copyWeightsToDevice()`` (``model``: its poptorch wrapper)."""
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(scale).add_(shift)
    model.copyWeightsToDevice()
