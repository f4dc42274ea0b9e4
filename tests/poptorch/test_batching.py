"""Batching of inference calls (docs/semantics.md S-10…S-13): device iterations and replicas split
the batch dimension, output modes and periods select what comes back, stateless models
run all micro-batches at once and stateful ones loop."""
import pytest
import torch
import torch.nn as nn

import poptorch
from models import SingleLinear


# -- output modes (docs/semantics.md S-12)
# ---------------------------------------------------------------

@pytest.mark.parametrize("mode,period,rows", [
    (poptorch.OutputMode.All, None, list(range(10))),
    (poptorch.OutputMode.EveryN, 5, [4, 9]),
    (poptorch.OutputMode.Final, None, [9]),
])
def test_output_modes_shapes_and_values(mode, period, rows):
    m = SingleLinear()
    opts = poptorch.Options().deviceIterations(10).outputMode(mode, period)
    x = torch.randn(10, 1, 5, 6)
    out = poptorch.inferenceModel(m, opts)(x)
    ref = m(x).detach()
    assert out.shape == (len(rows), 1, 5, 20)
    torch.testing.assert_close(out, ref[rows], rtol=1e-5, atol=1e-6)


def test_output_mode_sum():
    m = SingleLinear()
    opts = poptorch.Options().deviceIterations(10).outputMode(poptorch.OutputMode.Sum)
    x = torch.randn(10, 1, 5, 6)
    out = poptorch.inferenceModel(m, opts)(x)
    assert out.shape == (1, 1, 5, 20)
    torch.testing.assert_close(out, m(x).detach().sum(0, keepdim=True), rtol=1e-5, atol=1e-5)


def test_default_output_mode_resolves_to_all_for_inference():
    opts = poptorch.Options().deviceIterations(3)
    model = poptorch.inferenceModel(SingleLinear(), opts)
    assert model.options.output_mode == poptorch.OutputMode.All
    assert opts.output_mode == poptorch.OutputMode.Default


def test_scalar_outputs_stay_0d_when_k_is_1_and_become_vectors_otherwise():
    class M(nn.Module):
        def forward(self, x):
            return x.sum()

    assert poptorch.inferenceModel(M())(torch.ones(3)).shape == ()
    opts = poptorch.Options().deviceIterations(4)
    out = poptorch.inferenceModel(M(), opts)(torch.arange(8.).reshape(4, 2))
    assert out.tolist() == [1.0, 5.0, 9.0, 13.0]


# -- batch dimension and replicas (docs/semantics.md S-10, S-11, S-13)
# -----------------------------------

def test_replica_ordering_of_inputs_and_outputs():
    """docs/semantics.md S-13: D=2, R=2, B=1: rows [x0..x3] → iteration 0 runs x0 (replica 0) and
    x1."""
    class M(nn.Module):
        def forward(self, x):
            return x * 10

    opts = poptorch.Options().deviceIterations(2).replicationFactor(2)
    x = torch.tensor([[0.], [1.], [2.], [3.]])
    assert poptorch.inferenceModel(M(), opts)(x).flatten().tolist() == [0., 10., 20., 30.]
    final = poptorch.Options().deviceIterations(2).replicationFactor(2).outputMode(
        poptorch.OutputMode.Final)
    assert poptorch.inferenceModel(M(), final)(x).flatten().tolist() == [20., 30.]


def test_vectorized_and_looped_execution_agree():
    """A stateless model runs all micro-batches at once; a stateful one loops."""
    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 4)
            self.register_buffer("n", torch.zeros(()))

        def forward(self, x):
            self.n += 1
            return self.fc(x) * 1

    m = Stateful()
    x = torch.randn(16 * 3, 6)
    opts = poptorch.Options().deviceIterations(16)
    stateful = poptorch.inferenceModel(m, opts)
    plain = poptorch.inferenceModel(SingleLinear(), opts)
    out = stateful(x)
    plain(x)
    assert stateful._state.executable.vectorized is None
    assert plain._state.executable.vectorized is not None
    torch.testing.assert_close(out, m.fc(x).detach(), rtol=1e-5, atol=1e-6)
    stateful.copyWeightsToHost()
    assert m.n.item() == 16.0


def test_bad_batch_dimension_raises_assertion_error():
    opts = poptorch.Options().deviceIterations(4).replicationFactor(2)
    model = poptorch.inferenceModel(SingleLinear(), opts)
    with pytest.raises(AssertionError, match=r"\(10\).*\[10, 6\].*deviceIterations\(4\) \* "
                                             r"replicationFactor\(2\).* = 8"):
        model(torch.randn(10, 6))
    assert not model.isCompiled()
    assert model(torch.randn(16, 6)).shape == (16, 20)


def test_scalar_input_only_when_factor_is_one():
    class M(nn.Module):
        def forward(self, x):
            return x * 2

    assert poptorch.inferenceModel(M())(torch.tensor(3.)).item() == 6.0
    with pytest.raises(AssertionError, match="scalar"):
        poptorch.inferenceModel(M(), poptorch.Options().deviceIterations(2))(torch.tensor(3.))
