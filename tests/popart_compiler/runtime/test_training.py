"""The training session (runtime/training.py) on its own: device iterations and
gradient accumulation against a manual PyTorch loop (docs/semantics.md S-10, S-41, S-56), and a
floating-point exception that undoes the run (docs/semantics.md S-46, S-73). Nothing here imports
``poptorch``."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import Classifier, export
from popart_compiler import compiler
from popart_compiler.errors import Error
from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.runtime.training import TrainingSession
from popart_compiler.session_options import SessionOptions


def sgd(lr=0.1, **group):
    return OptimizerDescription("SGD", defaults=dict(lr=lr, **group), groups=[],
                                group_of={})


def test_training_session_matches_manual_loop():
    m = Classifier((4, 8, 3))
    ref = copy.deepcopy(m)
    d, a = 2, 3
    x, t = torch.randn(d * a * 2, 4), torch.randint(0, 3, (d * a * 2,))
    g = export(m, x[:2], t[:2])
    opts = SessionOptions(device_iterations=d, gradient_accumulation=a, output_mode=2)
    session = TrainingSession(compiler.compile(g, opts, training=True), None,
                              sgd(0.1, momentum=0.9))
    out, loss = session.run([x, t])
    assert out.shape == (12, 3) and loss.shape == (6,)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for i in range(d):
        opt.zero_grad()
        for s in range(a):
            row = (i * a + s) * 2
            l = ref(x[row:row + 2], t[row:row + 2])[1]
            (l / a).backward()
            losses.append(l.detach())
        opt.step()
    torch.testing.assert_close(loss, torch.stack(losses), rtol=1e-5, atol=1e-6)
    weights = session.readWeights()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6)
    # velocity and (A > 1) gradient accumulator of every weight (docs/semantics.md S-56)
    assert set(session.readOptimizerState()) == {
        f"{kind}___{n}" for n, _ in ref.named_parameters() for kind in ("Accl", "Accum")}


def test_floating_point_exception_restores_the_device_state():
    """An overflow in the second device iteration: the first iteration's update is
    undone, the optimizer state too."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x):
            y = torch.exp(self.w * x)
            return F.l1_loss(y, torch.zeros_like(y))

    g = export(M(), torch.ones(2))
    opts = SessionOptions(device_iterations=2, output_mode=2, fp_exceptions=True)
    session = TrainingSession(compiler.compile(g, opts, training=True), None,
                              sgd(lr=0.1, momentum=0.9))
    session.run([torch.ones(4)])
    weights = session.readWeights()
    state = session.readOptimizerState()
    with pytest.raises(Error, match="Floating point exception") as info:
        session.run([torch.tensor([1.0, 1.0, 1e3, 1e3])])  # exp(~800) overflows
    assert info.value.type == "poplar_application_runtime_error"
    assert torch.equal(session.readWeights()["w"], weights["w"])
    assert torch.equal(session.readOptimizerState()["Accl___w"], state["Accl___w"])
    session.run([torch.ones(4)])
