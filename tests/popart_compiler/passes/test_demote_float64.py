"""``demote_float64`` (passes/dtypes.py): ``torch.float64`` in op arguments becomes
``torch.float32`` (docs/semantics.md S-44), with PopTorch's warning."""
import pytest
import torch
import torch.nn as nn

from models import MLP, export
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.dtypes import demote_float64
from popart_compiler.session_options import SessionOptions


class Doubles(nn.Module):
    def forward(self, x):
        return x.to(torch.float64) * 2 + torch.zeros(2, dtype=torch.float64)


def dtype_args(graph):
    """``{node name: the torch.dtype values among its args and kwargs}``."""
    found = {}
    for node in graph.module.graph.nodes:
        values = list(node.args) + list(node.kwargs.values())
        dtypes = [v for v in values if isinstance(v, torch.dtype)]
        if dtypes:
            found[node.name] = dtypes
    return found


def test_float64_arguments_become_float32(run_pass, compiler_logs):
    g = export(Doubles(), torch.randn(2))
    assert dtype_args(g) == {"_assert_tensor_metadata_default": [torch.float32],
                             "to": [torch.float64], "zeros": [torch.float64]}
    result = run_pass(demote_float64, g, Compilation(SessionOptions(), False))
    assert result.graph is g and result.changed is True
    assert dtype_args(g) == {"_assert_tensor_metadata_default": [torch.float32],
                             "to": [torch.float32], "zeros": [torch.float32]}
    out = g.module(torch.tensor([1.0, 2.0]))[0]
    assert out.dtype == torch.float32 and out.tolist() == [2.0, 4.0]
    assert "[DISPATCHER] Type coerced from Double to Float in the graph" in \
        compiler_logs.text


def test_graph_without_float64_is_unchanged(run_pass, compiler_logs):
    g = export(MLP(), torch.randn(2, 4))
    before = g.module.code
    result = run_pass(demote_float64, g, Compilation(SessionOptions(), True))
    assert result.changed is False and g.module.code == before
    assert "Type coerced" not in compiler_logs.text


def test_demoted_values_are_described_as_float32(run_pass):
    g = export(Doubles(), torch.randn(2))
    result = run_pass(demote_float64, g, Compilation(SessionOptions(), False))
    assert result.changed
    dtypes = {n.name: n.meta["val"].dtype for n in g.module.graph.nodes
              if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)}
    assert dtypes == {"to": torch.float32, "mul": torch.float32, "zeros": torch.float32,
                      "add": torch.float32}
    assert [i.dtype for i in g.user_outputs] == [torch.float32]
