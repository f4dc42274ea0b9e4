"""Which graphs run as they are (``popart_compiler/backends/direct.py``, issue 30): only
prepacked oneDNN kernels and views, at least one kernel; the runner computes what the
graph computes. End-to-end runs: tests/poptorch/test_direct_kernels.py."""
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from popart_compiler.backends import direct

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="oneDNN is not available")


def _graph(*ops) -> fx.GraphModule:
    """``(x, w) → ops[0] → ops[1] → …``, each op a ``(target, extra args)`` pair; ``"w"``
    in the extra args stands for the placeholder ``w``."""
    g = fx.Graph()
    v, w = g.placeholder("x"), g.placeholder("w")
    for target, args in ops:
        v = g.call_function(target, (v, *[w if a == "w" else a for a in args]))
    g.output(v)
    return fx.GraphModule(nn.Module(), g)


def test_runs_as_is_needs_a_kernel_and_only_views_besides():
    aten = torch.ops.aten
    linear = (torch.ops.popart_compiler.onednn_linear_packed.default, ("w", None))
    assert direct.runs_as_is(_graph(linear, (aten.view.default, ([-1],))))
    assert direct.runs_as_is(_graph(linear, (aten.unsqueeze.default, (-1,)),
                                    (aten.squeeze.dims, ([-1],))))
    assert not direct.runs_as_is(_graph((aten.view.default, ([-1],))))  # no kernel
    assert not direct.runs_as_is(_graph(linear, (aten.relu.default, ())))
    assert not direct.runs_as_is(_graph(linear, (operator.add, (1.0,))))
    assert direct.runner(_graph(linear, (aten.relu.default, ()))) is None
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    run = direct.runner(_graph(linear, (aten.t.default, ())))
    torch.testing.assert_close(run(x, w), (x @ w.t()).t(), rtol=1e-5, atol=1e-6)
