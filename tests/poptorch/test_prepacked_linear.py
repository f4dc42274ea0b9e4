"""Linear layers of inference programs on the CPU (issue 30,
``popart_compiler/backends/prepack.py``): wide layers run oneDNN's prepacked kernel with
a following ReLU fused as its post-op, narrow ones ``addmm``; results are eager
PyTorch's, and weights uploaded with ``copyWeightsToDevice`` are packed again at the
next call without a recompilation.

Most tests replace TorchInductor's compilation by the graph itself (``stand_in``); one
compiles for real (slow)."""
import pytest
import torch
import torch.nn as nn

import poptorch
from models import assert_uploads_used_without_recompiling, upload_new_weights
from popart_compiler.backends import inductor as inductor_backend

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="oneDNN is not available")


def _model(compiler="inductor"):
    """An MLP as bench/peer_models.py's, smaller: 160 → 128 → 128 → 10."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Flatten(), nn.Linear(160, 128), nn.ReLU(), nn.Linear(128, 128),
                      nn.ReLU(), nn.Linear(128, 10)).eval()
    opts = poptorch.Options().deviceIterations(4)
    opts.Backend.compiler(compiler)
    return m, poptorch.inferenceModel(m, opts)


@pytest.fixture
def kernels(monkeypatch):
    """The oneDNN kernels the packed linear calls, recorded: ``("reorder", N)`` per
    weight packed, ``("linear", N, post-op)`` per packed product."""
    seen = []
    reorder, pointwise = (torch.ops.mkldnn._reorder_linear_weight,
                          torch.ops.mkldnn._linear_pointwise)

    def spy_reorder(w, m):
        seen.append(("reorder", w.shape[0], m))
        return reorder(w, m)

    def spy_linear(rows, w, b, attr, scalars, algorithm):
        assert w.layout == torch._mkldnn  # the packed copy, not the plain weight
        seen.append(("linear", w.shape[0], attr))
        return pointwise(rows, w, b, attr, scalars, algorithm)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", spy_reorder)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy_linear)
    return seen


def test_an_mlp_runs_packed_linears_with_fused_relus_and_matches_eager(stand_in, kernels):
    m, model = _model()
    x = torch.randn(4 * 8, 10, 16)
    torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    code = "\n".join(gm.code for gm in stand_in)
    assert "onednn_linear_packed" in code and "aten.relu" not in code
    # the two 128-wide layers on oneDNN, ReLU fused; the last (10 outputs) on addmm
    # (the compilation's warm-up may have run the program once already)
    assert set(kernels) == {("reorder", 128, 32), ("linear", 128, "relu")}
    kernels.clear()
    torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    assert kernels == [("linear", 128, "relu")] * 2  # packed once, reused


def test_uploaded_weights_are_packed_again_without_recompiling(stand_in, kernels):
    m, model = _model()
    x = torch.randn(4 * 8, 10, 16)
    before = model(x)
    compiled = len(stand_in)
    upload_new_weights(m, model, -1.5, 0.25)
    kernels.clear()
    after = model(x)
    torch.testing.assert_close(after, m(x).detach(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after, before)
    assert [k for k in kernels if k[0] == "reorder"] == [("reorder", 128, 32)] * 2
    assert len(stand_in) == compiled  # no new compilation


def test_the_eager_backend_keeps_plain_kernels(kernels):
    m, model = _model("eager")
    x = torch.randn(4 * 8, 10, 16)
    torch.testing.assert_close(model(x), m(x).detach(), rtol=0, atol=0)
    assert not kernels


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_real_inductor_compilation_of_the_packed_linears():
    """Inductor calls the packed linear (a dispatcher op with a Python CPU kernel and a
    string argument) as an external kernel: eager's values, new weights used."""
    m, model = _model()
    assert_uploads_used_without_recompiling(m, model, torch.randn(4 * 8, 10, 16),
                                            inductor_backend.compile_count)
