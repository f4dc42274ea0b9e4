"""Inference graphs of prepacked oneDNN kernels and views only run as they are, without
a TorchInductor compilation (issue 30, ``popart_compiler/backends/direct.py``): the same
results as eager PyTorch, weights uploaded with ``copyWeightsToDevice`` used at the next
call; graphs with any other op are compiled. Which graphs qualify:
tests/popart_compiler/backends/test_direct.py."""
import pytest
import torch
import torch.nn as nn

import poptorch
from models import assert_uploads_used_without_recompiling
from popart_compiler.backends import prepack
from popart_compiler.backends import inductor as inductor_backend

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="oneDNN is not available")


def _wrapped(m: nn.Module, iterations: int = 4):
    opts = poptorch.Options().deviceIterations(iterations)
    opts.Backend.compiler("inductor")
    return poptorch.inferenceModel(m.eval(), opts)


def _direct_runner(model):
    return model._state.session._vectorized._direct  # pylint: disable=protected-access


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(160, 128), nn.ReLU(), nn.Linear(128, 128),
                         nn.ReLU(), nn.Linear(128, 10))


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


@pytest.mark.parametrize("make, shape", [(_mlp, (4 * 8, 10, 16)), (_cnn, (4 * 8, 3, 16, 16))])
def test_a_graph_of_kernels_runs_without_compiling_and_follows_uploads(make, shape):
    m = make()
    model = _wrapped(m)
    x = torch.randn(shape)
    before = inductor_backend.compile_count()
    assert_uploads_used_without_recompiling(m, model, x, inductor_backend.compile_count)
    assert inductor_backend.compile_count() == before  # never compiled
    assert _direct_runner(model) is not None
    out = model(x)
    assert out.shape == (4 * 8, 10) and out.dtype == torch.float32


def test_the_direct_graph_calls_the_kernels_implementations():
    model = _wrapped(_mlp())
    model(torch.randn(4 * 8, 160))
    targets = {n.target for n in _direct_runner(model).__self__.graph.nodes
               if n.op == "call_function"}
    assert prepack.KERNELS[torch.ops.popart_compiler.onednn_linear_packed.default] in targets
    assert not [t for t in targets if isinstance(t, torch._ops.OpOverload)]


def test_a_graph_with_another_op_is_compiled(stand_in):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(160, 128), nn.Sigmoid(), nn.Linear(128, 10))
    model = _wrapped(m)
    x = torch.randn(4 * 8, 160)
    torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    assert _direct_runner(model) is None
    assert stand_in  # handed to the compilation


def test_in_place_relus_fold_into_the_linears_and_run_directly():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(160, 128), nn.ReLU(inplace=True), nn.Linear(128, 128),
                      nn.ReLU(inplace=True), nn.Linear(128, 10))
    model = _wrapped(m)
    x = torch.randn(4 * 8, 160)
    torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    assert _direct_runner(model) is not None


def test_a_convolution_result_returned_is_row_major(stand_in):
    """A prepacked convolution computes channels-last; the output, like a device → host
    transfer's, is dense and row-major (``view`` works on it as on eager's)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
    model = _wrapped(m)
    x = torch.randn(8, 3, 6, 6)
    y = model(x)
    assert stand_in and y.is_contiguous()
    torch.testing.assert_close(y.view(8, -1), m(x).detach().view(8, -1), rtol=1e-5,
                               atol=1e-5)
