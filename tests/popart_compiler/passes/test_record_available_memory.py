"""``record_available_memory`` (passes/compiler_hints.py): each ``set_available_memory``
proportion is copied onto the op that produced its input
(``node.meta["available_memory_proportion"]``). The graphs hold the ``poptorch::`` ops,
so this file imports their registration (``poptorch._ops.library``)."""
import torch
import torch.nn as nn

import poptorch._ops.library as ops_library  # registers the poptorch:: ops
from models import MLP, export
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.compiler_hints import record_available_memory
from popart_compiler.session_options import SessionOptions

KEY = "available_memory_proportion"


class Hinted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        y = ops_library.SET_AVAILABLE_MEMORY(self.fc(x), 0.3)
        z = ops_library.SET_AVAILABLE_MEMORY(x, 0.6)  # on an input: the marker only
        return ops_library.RECOMPUTATION_CHECKPOINT(y) + z


def test_record_available_memory_annotates_the_producer(run_pass):
    graph = export(Hinted(), torch.randn(2, 3))
    before = graph.module.code
    result = run_pass(record_available_memory, graph, Compilation(SessionOptions(), False))
    assert result.graph is graph and result.changed is False
    assert graph.module.code == before  # only metadata
    markers = [n for n in graph.module.graph.nodes
               if str(n.target) == "poptorch.set_available_memory.default"]
    assert [m.meta[KEY] for m in markers] == [0.3, 0.6]
    assert markers[0].args[0].target is torch.ops.aten.linear.default
    assert markers[0].args[0].meta[KEY] == 0.3
    assert markers[1].args[0].op == "placeholder" and KEY not in markers[1].args[0].meta
    annotated = {n.name for n in graph.module.graph.nodes if KEY in n.meta}
    assert annotated == {"linear", markers[0].name, markers[1].name}
    assert "# {'available_memory_proportion': 0.3}" in graph.as_text()


def test_graph_without_markers_gets_no_annotation(run_pass):
    graph = export(MLP(), torch.randn(2, 4))
    run_pass(record_available_memory, graph, Compilation(SessionOptions(), False))
    assert not any(KEY in n.meta for n in graph.module.graph.nodes)
