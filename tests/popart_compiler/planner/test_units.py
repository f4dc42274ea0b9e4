"""popart_compiler/planner/units.py: units from the blocks the planning capture starts
at each module, and the errors for models the planner cannot place."""
import pytest
import torch
import torch.nn as nn

from popart_compiler.errors import Error
from popart_compiler.ir import Graph
from popart_compiler.passes.placement import BLOCK_KEY, Placement
from popart_compiler.planner.units import check_blocks, find_units


class Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _graph(blocks):
    """The capture with ops tagged as the planning capture tags them: block ``blocks[k]``
    (stage ``k``) from the ``k``-th linear on."""
    graph = Graph(torch.export.export(Three(), (torch.randn(2, 4),), strict=False))
    ops = [n for n in graph.module.graph.nodes if n.op == "call_function"]
    k = -1
    for n in ops:
        if "linear" in str(n.target) or "addmm" in str(n.target):
            k += 1
        stage = blocks.index(blocks[k])
        n.meta["custom"] = {BLOCK_KEY: blocks[k]}
        n.meta["placement"] = Placement(0, stage, 0)
    return graph, [n.name for n in ops]


def test_one_unit_per_block_in_order():
    graph, names = _graph(["layers.0", "layers.1", "layers.2"])
    units = find_units(graph, names, {"layers.0", "layers.1", "layers.2"},
                       layers={"layers.1", "layers.2"}, markers={names[-1]})
    assert [u.name for u in units] == ["layers.0", "layers.1", "layers.2"]
    assert [u.layer for u in units] == [False, True, True]
    assert units[0].lo == 0 and units[-1].hi == len(names)
    assert all(a.hi == b.lo for a, b in zip(units, units[1:]))
    assert units[-1].markers == (names[-1],) and units[0].markers == ()


def test_a_module_that_runs_again_after_another_is_refused():
    graph, names = _graph(["layers.0", "layers.1", "layers.0"])
    with pytest.raises(Error, match="The module layers.0 runs again after other units"):
        find_units(graph, names, {"layers.0", "layers.1"}, set(), set())


def test_a_block_the_planner_did_not_start_is_refused():
    graph, _ = _graph(["layers.0", "mine", "layers.2"])
    check_blocks(graph, {"layers.0", "mine", "layers.2"})
    with pytest.raises(Error, match="The model starts its own block 'mine' inside forward"):
        check_blocks(graph, {"layers.0", "layers.2"})
