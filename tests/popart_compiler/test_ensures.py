"""What each pass ensures (popart_compiler/ensures.py): every check holds after its pass
on the graphs the compiler makes, and fails on a graph broken by hand; ``compile()``
with ``POPTORCH_VERIFY=1`` names the pass whose promise does not hold."""
import dataclasses
import operator

import pytest
import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from models import MLP, export
from popart_compiler import compiler, ensures
from popart_compiler.errors import Error
from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation, Pass, unchanged
from popart_compiler.passes.dropout import remove_inference_dropout
from popart_compiler.passes.dtypes import demote_float64, retarget_device
from popart_compiler.passes.estimate import estimate
from popart_compiler.passes.placement import BLOCK_KEY, Placement, place
from popart_compiler.passes.split_stages import split_stages
from popart_compiler.passes.vectorize import vectorize
from popart_compiler.session_options import SessionOptions
from popart_compiler.verify import verify

BLOCKS = {"a": Placement(0, 0), "b": Placement(1, 1), "c": Placement(0, 2)}


class Staged(nn.Module):
    """Three Linear + ReLU layers, layer ``i`` in block ``"abc"[i]`` (one stage each)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in BLOCKS])

    def forward(self, x):
        for layer, block in zip(self.layers, BLOCKS):
            fx_traceback.current_meta.setdefault("custom", {})[BLOCK_KEY] = block
            x = torch.relu(layer(x))
        return x


def staged_program():
    """A program placed on three pipeline stages: ``(graph, compilation)``."""
    with fx_traceback.preserve_node_meta():
        program = torch.export.export(Staged(), (torch.randn(2, 4),), strict=False)
    g = Graph(program, blocks=BLOCKS)
    return g, place(g, Compilation(SessionOptions(device_iterations=3), False)).compilation


def break_order(gm: fx.GraphModule) -> None:
    """Move the first op that reads another op's result before that op (fx lint fails)."""
    for node in gm.graph.nodes:
        inputs = [a for a in node.all_input_nodes if a.op == "call_function"]
        if node.op == "call_function" and inputs:
            inputs[0].prepend(node)
            return
    raise AssertionError("no op reads another op's result")


def ops(g, name=None):
    return [n for n in g.module.graph.nodes if n.op == "call_function"
            and (name is None or name in str(n.target))]


def test_every_pass_with_a_promise_is_checked():
    checked = {p.name: p.ensures for p in compiler.PASSES}
    assert checked["demote_float64"] is ensures.no_float64
    assert checked["remove_inference_dropout"] is ensures.no_inference_dropout
    assert checked["place"] is ensures.placement_complete
    assert checked["split_stages"] is ensures.stages_well_formed
    assert checked["vectorize"] is ensures.vectorized_well_formed
    assert checked["check_inputs"] is ensures.ipu_types_and_ops
    assert checked["retarget_device"] is ensures.on_session_device
    assert checked["estimate"] is ensures.estimated


class Double(nn.Module):
    def forward(self, x):
        return (x.double() * 2).float()


def test_no_float64_after_demote_float64():
    g = export(Double(), torch.randn(2, 3))
    c = Compilation(SessionOptions(), False)
    problem = ensures.no_float64(g, c)
    assert problem is not None and "still has torch.float64 in its arguments" in problem
    demote_float64(g, c)
    assert ensures.no_float64(g, c) is None
    node = ops(g, "mul")[0]  # broken by hand: a float64 value again
    val = node.meta["val"]
    with val.fake_mode:
        node.meta["val"] = torch.empty(val.shape, dtype=torch.float64)
    assert ensures.no_float64(g, c) == f"op {node.name} still computes a float64 value"


class Zeros(nn.Module):
    def forward(self, x):
        return x + torch.zeros(3, device="cpu")


def test_devices_are_the_sessions_after_retarget_device():
    g = export(Zeros(), torch.randn(2, 3))
    c = Compilation(SessionOptions(device="cuda"), False)
    problem = ensures.on_session_device(g, c)
    assert problem is not None and "has the device cpu in its arguments, not cuda" in problem
    assert ensures.on_session_device(g, Compilation(SessionOptions(), False)) is None
    retarget_device(g, c)
    assert ensures.on_session_device(g, c) is None


class Dropping(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


def test_no_dropout_in_inference_after_remove_inference_dropout():
    g = export(Dropping().train(), torch.randn(2, 3))
    inference = Compilation(SessionOptions(), False)
    problem = ensures.no_inference_dropout(g, inference)
    assert problem is not None and "is a dropout" in problem
    assert ensures.no_inference_dropout(g, Compilation(SessionOptions(), True)) is None
    remove_inference_dropout(g, inference)
    assert ensures.no_inference_dropout(g, inference) is None


def test_no_dropout_probability_left():
    g = export(MLP(), torch.randn(2, 4))
    c = Compilation(SessionOptions(), False)
    relu = ops(g, "relu")[0]
    with g.module.graph.inserting_after(relu):  # broken by hand: a native dropout
        drop = g.module.graph.call_function(torch.ops.aten.native_dropout.default,
                                            (relu, 0.5, True))
    assert ensures.no_inference_dropout(g, c) == \
        f"op {drop.name} drops out in training mode"
    drop.args = (relu, 0.5, False)
    assert ensures.no_inference_dropout(g, c) is None
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    drop.target, drop.args = sdpa, (relu, relu, relu, None, 0.1)
    assert ensures.no_inference_dropout(g, c) == \
        f"op {drop.name} drops out with probability 0.1"


def test_placement_complete_after_place():
    g = export(MLP(), torch.randn(2, 4))
    c = Compilation(SessionOptions(), False)
    assert ensures.placement_complete(g, c) == "no placement plan"
    c = place(g, c).compilation
    assert ensures.placement_complete(g, c) is None
    node = ops(g, "relu")[0]
    node.meta["placement"] = Placement(ipu=3)
    assert ensures.placement_complete(g, c) == \
        f"op {node.name} is placed at {Placement(ipu=3)}, outside the plan"
    node.meta["placement"] = Placement(stage=1)
    assert "outside the plan" in ensures.placement_complete(g, c)
    del node.meta["placement"]
    assert ensures.placement_complete(g, c) == f"op {node.name} has no placement"


def test_stage_submodules_are_well_formed_after_split_stages():
    g, c = staged_program()
    assert ensures.stages_well_formed(g, c) == "3 stages but no staged graph"
    c = split_stages(g, c).compilation
    assert ensures.stages_well_formed(g, c) is None
    break_order(c.stages.split.submod_1)  # broken by hand: an op before its input
    problem = ensures.stages_well_formed(g, c)
    assert problem.startswith("stage submodule submod_1: fx lint: ")
    g, c = staged_program()
    c = split_stages(g, c).compilation
    c = dataclasses.replace(c, stages=dataclasses.replace(c.stages, segment_stages=[0, 1, 2, 3]))
    assert ensures.stages_well_formed(g, c) == "the staged graph has an IPU for some of " \
        "its segments only"
    c = dataclasses.replace(c, stages=dataclasses.replace(c.stages, segment_ipus=[]))
    assert ensures.stages_well_formed(g, c) == "the staged graph has no submodule submod_3"


def test_the_vectorized_graph_is_well_formed_after_vectorize():
    g = export(MLP(), torch.randn(2, 4))
    c = Compilation(SessionOptions(device_iterations=3), False)
    c = vectorize(g, c).compilation
    assert isinstance(c.vectorized, fx.GraphModule)
    assert ensures.vectorized_well_formed(g, c) is None
    vectorized, slots = c.vectorized, c.vectorized_slots
    c = dataclasses.replace(c, vectorized_slots=1)
    assert ensures.vectorized_well_formed(g, c) == "a vectorized graph over 1 micro-batches"
    c = dataclasses.replace(c, vectorized=None, vectorized_slots=3)
    assert ensures.vectorized_well_formed(g, c) == \
        "3 micro-batches per call but no vectorized graph"
    c = dataclasses.replace(c, vectorized=vectorized, vectorized_slots=slots)
    break_order(vectorized)
    assert ensures.vectorized_well_formed(g, c).startswith("the vectorized graph: fx lint: ")
    one_placeholder = export(nn.Identity(), torch.randn(2)).module
    c = dataclasses.replace(c, vectorized=one_placeholder)
    assert ensures.vectorized_well_formed(g, c) == \
        f"the vectorized graph has 1 placeholders, the graph {len(g.placeholders)}"


def _host_function(t):
    return t


def test_only_supported_ops_after_check_inputs():
    g = export(MLP(), torch.randn(2, 4))
    c = Compilation(SessionOptions(), False)
    assert ensures.ipu_types_and_ops(g, c) is None
    relu = ops(g, "relu")[0]
    with g.module.graph.inserting_after(relu):
        call = g.module.graph.call_function(_host_function, (relu,))
    problem = ensures.ipu_types_and_ops(g, c)
    assert problem.startswith(f"op {call.name} calls <function _host_function")
    assert problem.endswith("which is not a PyTorch operator")
    assert ensures.supported_op(torch.ops.aten.relu.default)
    assert ensures.supported_op(torch.ops.higher_order.cond)
    assert ensures.supported_op(operator.getitem) and ensures.supported_op(torch.sym_max)
    assert not ensures.supported_op(print) and not ensures.supported_op(_host_function)


def test_input_types_the_ipu_takes_after_check_inputs():
    g = export(MLP(), torch.randn(2, 4))
    c = Compilation(SessionOptions(), False)
    x = g.placeholders[-1]
    val = x.meta["val"]
    with val.fake_mode:
        x.meta["val"] = torch.empty(val.shape, dtype=torch.bfloat16)
    assert ensures.ipu_types_and_ops(g, c) == \
        f"placeholder {x.name} has the unsupported dtype torch.bfloat16"


def test_estimated_after_estimate():
    g = export(MLP(), torch.randn(2, 4))
    c = Compilation(SessionOptions(), False)
    assert ensures.estimated(g, c) == "no estimate"
    c = estimate(g, place(g, c).compilation).compilation
    assert ensures.estimated(g, c) is None


def test_verify_raises_what_the_pass_ensures():
    g = export(Double(), torch.randn(2, 3))
    c = Compilation(SessionOptions(), False)
    with pytest.raises(Error, match=r"Graph verification failed after pass "
                                    r"demote_float64: op .* still has torch.float64") as info:
        verify(g, c, after="demote_float64", ensures=ensures.no_float64)
    assert info.value.type == "poptorch_verify_error"
    verify(g, c, after="demote_float64")  # without its promise: a well-formed graph


def test_compile_checks_each_pass_promise(monkeypatch):
    """A ``demote_float64`` that does nothing breaks its promise: ``compile()`` says so
    with ``POPTORCH_VERIFY=1``, and compiles without it."""
    passes = [Pass("demote_float64", lambda graph, c: unchanged(graph), ensures.no_float64)
              if p.name == "demote_float64" else p for p in compiler.PASSES]
    monkeypatch.setenv("POPTORCH_VERIFY", "1")
    with pytest.raises(Error, match=r"after pass demote_float64: op .* still has "
                                    r"torch.float64 in its arguments") as info:
        compiler.compile(export(Double(), torch.randn(2, 3)), SessionOptions(), False,
                         passes=passes)
    assert info.value.__notes__ == ["(in compiler pass demote_float64)"]
    monkeypatch.setenv("POPTORCH_VERIFY", "0")
    compiler.compile(export(Double(), torch.randn(2, 3)), SessionOptions(), False,
                     passes=passes)
