"""``split_stages`` and ``split_by_stage`` (passes/split_stages.py): a program placed on
several pipeline stages is cut into one submodule per run of consecutive ops of a stage
(``stages``, returned on the compilation); every segment computes what its ops compute
in the unsplit graph."""
import torch
import torch.fx.traceback as fx_traceback

from models import MLP, export
from popart_compiler.enums import ExecutionMode
from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.placement import BLOCK_KEY, Placement, place, place_nodes
from popart_compiler.passes.split_stages import split_by_stage, split_stages
from popart_compiler.runtime.schedule import StagedProgram
from popart_compiler.session_options import SessionOptions, StrategySettings
from popart_compiler.stages import StagedGraph


class Tagged(torch.nn.Module):
    """Linear + ReLU layers; layer ``i`` is tagged with block ``blocks[i]``. Its forward
    writes ``torch.fx.traceback.current_meta``, which only ``preserve_node_meta`` (the
    capture) restores: never call it outside :func:`capture`."""

    def __init__(self, blocks):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in blocks])
        self.blocks = blocks

    def forward(self, x):
        for layer, block in zip(self.layers, self.blocks):
            fx_traceback.current_meta.setdefault("custom", {})[BLOCK_KEY] = block
            x = torch.relu(layer(x))
        return x


BLOCKS = {"a": Placement(0, 0), "b": Placement(1, 1), "c": Placement(0, 2)}


def capture(blocks):
    model = Tagged(blocks)
    with fx_traceback.preserve_node_meta():
        program = torch.export.export(model, (torch.randn(2, 4),), strict=False)
    return model, Graph(program, blocks=BLOCKS)


def placed(blocks, options):
    model, graph = capture(blocks)
    return model, graph, place(graph, Compilation(options, False)).compilation


def test_several_stages_give_a_staged_graph(run_pass):
    model, graph, c = placed(["a", "b", "c"], SessionOptions(device_iterations=3))
    before = graph.module.code
    result = run_pass(split_stages, graph, c)
    assert result.graph is graph and result.changed is False and graph.module.code == before
    staged = result.compilation.stages
    assert isinstance(staged, StagedGraph)
    assert staged.segment_stages == [0, 1, 2] and staged.pipelined
    assert staged.units() == [0, 1, 2]
    assert [name for name, _ in staged.split.named_children()] == \
        ["submod_0", "submod_1", "submod_2"]
    x = torch.randn(2, 4)
    state = [p.detach() for p in model.parameters()]
    expected = x
    for layer in model.layers:  # not model(x): its forward writes fx's global metadata
        expected = torch.relu(layer(expected))
    torch.testing.assert_close(staged.split(*state, x)[0], expected.detach())
    assert "submod_1: stage 1, 2 ops" in staged.as_text()


def test_consecutive_blocks_of_one_stage_share_a_segment(run_pass):
    """Sharded: blocks a and b on two IPUs in stage 0, c in stage 1; one unit per segment."""
    blocks = {"a": Placement(0, 0), "b": Placement(1, 0), "c": Placement(0, 1)}
    model, graph = capture(["a", "b", "c"])
    graph.blocks = blocks
    c = Compilation(SessionOptions(strategy=StrategySettings(ExecutionMode.Sharded)),
                    False)
    c = place(graph, c).compilation
    c = run_pass(split_stages, graph, c).compilation
    assert c.stages.segment_stages == [0, 1] and not c.stages.pipelined
    assert c.stages.units() == [0, 1]


def test_one_stage_is_not_split(run_pass):
    graph = export(MLP(), torch.randn(2, 4))
    c = Compilation(SessionOptions(), False)
    c = place(graph, c).compilation
    result = run_pass(split_stages, graph, c)
    assert result.changed is False and result.compilation.stages is None


def test_unplaced_graph_is_not_split(run_pass):
    c = Compilation(SessionOptions(), False)
    result = run_pass(split_stages, export(MLP(), torch.randn(2, 4)), c)
    assert result.changed is False and result.compilation.stages is None


def test_staged_program_runs_like_the_graph():
    _, graph = capture(["a", "b", "c"])
    place_nodes(graph.module, BLOCKS)
    state = [graph.state_values()[n] for n in graph.parameters]
    xs = [torch.randn(2, 4) for _ in range(3)]
    for pipelined in (True, False):
        staged = StagedProgram(StagedGraph(*split_by_stage(graph.module), pipelined))
        assert staged.num_stages == 3
        outs = {}
        staged.run([[[*state, x]] for x in xs], lambda m, r, o: outs.setdefault(m, o[0]))
        for m, x in enumerate(xs):
            torch.testing.assert_close(outs[m], graph.module(*state, x)[0])
