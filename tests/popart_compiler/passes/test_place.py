"""``place`` (passes/placement.py) and the execution-strategy checks it runs: graph
in, placed graph out (docs/semantics.md S-60, S-63, S-64, S-65). Nothing here imports
``poptorch``: the capture's block tags are written by the model itself."""
import pytest
import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from models import MLP, export
from popart_compiler.enums import ExecutionMode
from popart_compiler.errors import Error
from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.placement import (BLOCK_KEY, NO_ACTIVE_BLOCK_KEY, Placement,
                                              place, place_nodes, placement_of,
                                              plan_placement)
from popart_compiler.session_options import SessionOptions, StrategySettings


class Tagged(nn.Module):
    """Three linear layers; ``tags[i]`` is written as the block tag of layer ``i``."""

    def __init__(self, tags):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in tags])
        self.tags = tags

    def forward(self, x):
        for layer, tag in zip(self.layers, self.tags):
            custom = fx_traceback.current_meta.setdefault("custom", {})
            custom.pop(BLOCK_KEY, None)
            custom.pop(NO_ACTIVE_BLOCK_KEY, None)
            custom.update(tag)
            x = torch.relu(layer(x))
        return x


def capture(tags, blocks=None):
    """``Tagged(tags)`` captured as the capture does it: block tags kept in the nodes'
    metadata, ``blocks`` recorded on the graph."""
    with fx_traceback.preserve_node_meta():
        program = torch.export.export(Tagged(tags), (torch.randn(2, 4),), strict=False)
    return Graph(program, blocks=blocks)


BLOCKS = {"a": Placement(0, 0), "b": Placement(1, 1), "c": Placement(0, 2)}


def linears(graph):
    return [n for n in graph.module.graph.nodes if "linear" in str(n.target)]


def test_place_nodes_from_tags():
    graph = capture([{BLOCK_KEY: None}, {BLOCK_KEY: "b"}, {BLOCK_KEY: "c"}])
    place_nodes(graph.module, BLOCKS)
    assert [placement_of(n) for n in linears(graph)] == [Placement(0, 0), Placement(1, 1),
                                                        Placement(0, 2)]
    nodes = list(graph.module.graph.nodes)
    weight_of_layer_1 = nodes[2]  # placeholders: w0, b0, w1, ...
    assert placement_of(weight_of_layer_1) == Placement(1, 1)
    assert placement_of(nodes[-1]) == Placement(0, 2)  # the output node
    assert all("placement" in n.meta for n in nodes)


def test_missing_placement_reads_as_origin():
    node = next(iter(capture([{BLOCK_KEY: None}]).module.graph.nodes))
    assert placement_of(node) == Placement(0, 0, 0)


def test_no_active_block_tag():
    graph = capture([{BLOCK_KEY: "a"}, {NO_ACTIVE_BLOCK_KEY: True}])
    with pytest.raises(Error, match="No active Block, all the ops must belong to a Block"):
        place_nodes(graph.module, BLOCKS)


def test_forward_stage_count_counts_ipu_changes():
    graph = capture([{BLOCK_KEY: "a"}, {BLOCK_KEY: "b"}, {BLOCK_KEY: "c"}])
    plan = plan_placement(graph.module, BLOCKS, graph.parameters, StrategySettings(),
                          training=False, device_iterations=3)
    assert plan.forward_stages == 3 and plan.ipus_per_replica == 2
    assert plan.backward(Placement(0, 0)) == Placement(0, 4)
    assert plan.backward(Placement(0, 2)) == Placement(0, 2)
    assert plan.optimizer("layers.1.weight") == Placement(1, 3)


def test_stage_ordering_error():
    blocks = {"a": Placement(0, 1), "b": Placement(1, 0)}
    graph = capture([{BLOCK_KEY: "a"}, {BLOCK_KEY: "b"}])
    with pytest.raises(Error, match=r"Pipeline stage ordering error: op linear_1 \(block 'b', "
                       r"stage 0\) consumes relu \(block 'a', stage 1\)"):
        plan_placement(graph.module, blocks, graph.parameters, StrategySettings(),
                       training=False, device_iterations=4)


@pytest.mark.parametrize("liveness", [2, 3])
def test_off_chip_liveness_needs_serial_phases(liveness):
    graph = capture([{BLOCK_KEY: "a"}])
    strategy = StrategySettings(ExecutionMode.Phased, serial_phases=False, liveness=liveness)
    with pytest.raises(Error, match="This is only supported for serial phase execution"):
        plan_placement(graph.module, {"a": Placement()}, graph.parameters, strategy, False)


def test_too_many_ipus():
    graph = capture([{BLOCK_KEY: "a"}, {BLOCK_KEY: "b"}])
    blocks = {"a": Placement(0, 0), "b": Placement(31, 1)}
    plan_placement(graph.module, blocks, graph.parameters,
                   StrategySettings(ExecutionMode.Sharded), False, replicas=2)
    with pytest.raises(Error, match=r"Too many IPUs requested \(96\)"):
        plan_placement(graph.module, blocks, graph.parameters,
                       StrategySettings(ExecutionMode.Sharded), False, replicas=3)


def test_place_pass_records_the_plan_and_places_every_node(run_pass, compiler_logs):
    graph = capture([{BLOCK_KEY: "a"}, {BLOCK_KEY: "b"}, {BLOCK_KEY: "c"}], BLOCKS)
    c = Compilation(SessionOptions(device_iterations=3), False)
    code = graph.module.code
    result = run_pass(place, graph, c)
    # metadata only: the graph's ops are those it had
    assert result.graph is graph and result.changed is False and graph.module.code == code
    plan = result.compilation.placement
    assert plan.stages == (0, 1, 2) and plan.forward_stages == 3 and plan.pipelined
    assert plan.ipus_per_replica == 2 and plan.blocks == BLOCKS
    assert [placement_of(n) for n in linears(graph)] == [Placement(0, 0), Placement(1, 1),
                                                        Placement(0, 2)]
    assert all("placement" in n.meta for n in graph.module.graph.nodes)
    assert "Placement (Pipelined, 2 IPU(s) per replica, 3 stage(s))" in compiler_logs.text
    assert "@ ipu 1 stage 1 phase 0" in graph.as_text()


def test_place_pass_without_blocks_puts_everything_on_ipu_0(run_pass):
    graph = export(MLP(), torch.randn(2, 4))
    c = Compilation(SessionOptions(), True)
    c = run_pass(place, graph, c).compilation
    assert c.placement.stages == (0,) and c.placement.ipus_per_replica == 1
    assert not c.placement.pipelined and c.placement.training
    assert {placement_of(n) for n in graph.module.graph.nodes} == {Placement(0, 0, 0)}


def test_place_pass_checks_the_batches_of_a_pipeline():
    graph = capture([{BLOCK_KEY: "a"}, {BLOCK_KEY: "b"}, {BLOCK_KEY: "c"}], BLOCKS)
    with pytest.raises(Error, match=r"poptorch\.Options\(\)\.deviceIterations must be greater "
                                    r"than or equal to the number of pipeline stages \(3\)"):
        place(graph, Compilation(SessionOptions(device_iterations=2), False))
    with pytest.raises(Error, match=r"gradientAccumulation must be greater than or equal to "
                                    r"the number of pipeline stages \(5\)"):
        place(graph, Compilation(SessionOptions(gradient_accumulation=4), True))
