"""popart_compiler/runtime/schedule.py: the pipeline's execution order and a staged
program run micro-batch by micro-batch (compared with the unsplit model)."""
import torch
import torch.fx.traceback as fx_traceback

from popart_compiler import compiler
from popart_compiler.ir import Graph
from popart_compiler.passes.placement import BLOCK_KEY, Placement
from popart_compiler.runtime.schedule import StagedProgram, stage_order
from popart_compiler.session_options import SessionOptions


def test_pipelined_order_runs_micro_batch_t_minus_s_in_stage_s():
    assert stage_order(2, 3, pipelined=True) == [
        (0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (1, 2)]
    assert stage_order(2, 2, pipelined=False) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert stage_order(1, 2, pipelined=True) == [(0, 0), (0, 1)]


class Tagged(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in blocks)
        self.blocks = blocks

    def forward(self, x):
        for layer, block in zip(self.layers, self.blocks):
            fx_traceback.current_meta.setdefault("custom", {})[BLOCK_KEY] = block
            x = torch.relu(layer(x))
        return x


def test_a_staged_program_computes_what_the_model_computes():
    torch.manual_seed(0)
    model = Tagged(["a", "b"])
    with fx_traceback.preserve_node_meta():
        program = torch.export.export(model, (torch.randn(2, 4),), strict=False)
    graph = Graph(program, blocks={"a": Placement(0, 0), "b": Placement(1, 1)})
    exe = compiler.compile(graph, SessionOptions(device_iterations=3), False)
    staged = StagedProgram(exe.stages)
    assert staged.num_stages == 2 and staged.pipelined
    state = [v.detach() for v in exe.graph.state_values().values()]
    xs = [torch.randn(2, 4) for _ in range(3)]
    done = []
    staged.run([[state + [x]] for x in xs], lambda m, rep, outs: done.append((m, rep, outs)))
    assert [(m, rep) for m, rep, _ in done] == [(0, 0), (1, 0), (2, 0)]
    for (m, _, outs), x in zip(done, xs):
        torch.testing.assert_close(outs[0], model(x))
