"""Compiler passes over the steering ops (popart_compiler.passes.compiler_hints) and the
per-micro-batch op registry (popart_compiler.ir), graph in / graph out. Here rather than
in tests/popart_compiler/ because the graphs hold the poptorch:: ops."""
import pytest
import torch
import torch.nn as nn

import poptorch._ops.library as ops_library  # registers the poptorch:: ops
from popart_compiler.passes import compiler_hints as steering
from popart_compiler import compiler
from popart_compiler.errors import Error
from popart_compiler.ir import Graph, register_per_micro_batch_op
from popart_compiler.passes.base import Compilation
from popart_compiler.session_options import SessionOptions, StrategySettings


def export(module, *args):
    return Graph(torch.export.export(module, args, strict=False))


class Hinted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        y = ops_library.SET_AVAILABLE_MEMORY(self.fc(x), 0.3)
        return ops_library.RECOMPUTATION_CHECKPOINT(y)


def test_record_available_memory_annotates_the_producer():
    graph = export(Hinted(), torch.randn(2, 3))
    steering.record_available_memory(graph, Compilation(SessionOptions(), False))
    marker = next(n for n in graph.module.graph.nodes
                  if str(n.target) == "poptorch.set_available_memory.default")
    assert marker.args[0].target is torch.ops.aten.linear.default
    assert marker.args[0].meta["available_memory_proportion"] == 0.3


class Overlap(nn.Module):
    def forward(self, x):
        y = ops_library.OVERLAP_INPUT(x, "OverlapAccumulationLoop")
        return ops_library.OVERLAP_OUTPUT(y * 2, "OverlapAccumulationLoop")


def test_check_overlapped_io_rules():
    graph = export(Overlap(), torch.randn(2))
    def options(mode, raw):
        return Compilation(SessionOptions(output_mode=mode, raw=raw,
                                          strategy=StrategySettings.from_raw(raw)), False)
    good = options(3, {"execution_mode": 1, "numIOTiles": 32})
    assert not steering.check_overlapped_io(graph, good).changed
    for raw, mode, message in [({"execution_mode": 0, "numIOTiles": 32}, 2, "Pipelined"),
                               ({"execution_mode": 1}, 2, "No IO tiles allocated"),
                               ({"execution_mode": 1, "numIOTiles": 32}, 0,
                                "Unsupported output mode")]:
        with pytest.raises(Error, match=message):
            steering.check_overlapped_io(graph, options(mode, raw))


def test_per_micro_batch_ops_are_never_vectorised():
    class Model(nn.Module):
        def forward(self, x):
            return torch.ops.test_steering.side_effect(x) + 1

    lib = torch.library.Library("test_steering", "FRAGMENT")
    lib.define("side_effect(Tensor x) -> Tensor")
    lib.impl("side_effect", lambda x: x.clone(), "CompositeExplicitAutograd")
    torch.library.register_fake("test_steering::side_effect", torch.empty_like, lib=lib)
    # a batching rule, so that vmap (which never falls back to a per-slice loop) can
    # vectorise the op until it is registered as per-micro-batch
    torch.library.register_vmap("test_steering::side_effect",
                                lambda info, in_dims, x: (x.clone(), in_dims[0]), lib=lib)
    options = SessionOptions(device_iterations=4)
    assert compiler.compile(export(Model(), torch.randn(3)), options,
                            training=False).vectorized is not None
    register_per_micro_batch_op("test_steering::side_effect")
    graph = export(Model(), torch.randn(3))
    assert graph.runs_per_micro_batch()
    assert compiler.compile(graph, options, training=False).vectorized is None
