"""The units of a program captured for planning: one per module the capture started a
block at (every repeated layer, and the modules with weights around them), in the order
they run.

The planning capture starts block ``k`` at unit ``k``'s module (``poptorch.BeginBlock``
with ``AutoStage.AutoIncrement`` on one IPU), so the placement pass records each op's
unit as its pipeline stage, exactly as it places the ops of a model with blocks at
those modules: a unit is everything from the start of its module's call to the start
of the next unit's, including the code between modules.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Set

from popart_compiler.errors import backend_error
from popart_compiler.ir import Graph
from popart_compiler.passes.placement import BLOCK_KEY, placement_of
from popart_compiler.planner.problem import Unit

__all__ = ["find_units", "check_blocks"]


def find_units(graph: Graph, op_names: Sequence[str], modules: Set[str], layers: Set[str],
               markers: Set[str]) -> List[Unit]:
    """The units of ``graph``.

    Args:
        graph: the planning capture (with the planner's markers); each block's id is
            its module's path.
        op_names: its costed ops, in execution order.
        modules: the paths of the units' modules (the blocks the planner started).
        layers: the paths of the repeated layers.
        markers: names of the planner's checkpoint markers.

    Returns:
        The units that have ops, in order.

    Raises:
        Error: a unit's ops are not consecutive (a module called again after another
            unit's module started); a block the planner did not start (the model
            starts its own ``poptorch.Block`` inside ``forward``).
    """
    check_blocks(graph, modules)
    stage = {n.name: placement_of(n).stage for n in graph.module.graph.nodes}
    names: Dict[int, str] = {}
    for n in graph.module.graph.nodes:
        block = (n.meta.get("custom") or {}).get(BLOCK_KEY)
        if block is not None:
            names.setdefault(stage[n.name], str(block))
    order: List[int] = [stage.get(name, 0) for name in op_names]
    units: List[Unit] = []
    start = 0
    seen: Dict[int, int] = {}
    for i in range(1, len(order) + 1):
        if i < len(order) and order[i] == order[start]:
            continue
        k = order[start]
        if k in seen:
            raise backend_error(
                f"The module {names.get(k, k)} runs again after other units started (ops "
                f"{op_names[seen[k]]} and {op_names[start]}): the planner places modules "
                "that run once, in order. Plan a model whose layers each run once.")
        seen[k] = start
        name = names.get(k, f"stage {k}")
        mine = tuple(n for n in op_names[start:i] if n in markers)
        units.append(Unit(name, name in layers, start, i, mine))
        start = i
    return units


def check_blocks(graph: Graph, modules: Set[str]) -> None:
    """Every op of the planning capture is in a block the planner started.

    Raises:
        Error: the model starts its own blocks inside ``forward``.
    """
    for n in graph.module.graph.nodes:
        block = (n.meta.get("custom") or {}).get(BLOCK_KEY)
        if block is not None and str(block) not in modules:
            raise backend_error(
                f"The model starts its own block {block!r} inside forward "
                "(poptorch.Block, BlockFunction or Block.start): the planner places the "
                "model's modules itself. Remove the blocks from forward to plan it "
                "(BeginBlock annotations on modules are fine: plan() ignores them and "
                "Plan.apply() replaces them).")
