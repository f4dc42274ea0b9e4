"""The costed ops of a program with any subset of the planner's recomputation
checkpoints, from two costings of one capture.

The planner captures the model once with a ``recomputation_checkpoint`` on the output
of every repeated layer (program *A*) and removes those markers from the captured graph
(program *B*); :func:`~popart_compiler.cost.op_costs.collect` costs both. A program with
only some of the markers differs from *B* only around each marker present: the marker
itself (a view), the op whose buffer it checkpoints (``checkpoint``), the marked tensor
(``saved``) and the ops reading the marker (``inputs``; ``inplace``: an op never runs in
place on a marker). :class:`Variants` takes those ops from *A* and every other op from
*B*, so that the ops of a placement with markers ``present`` are those
:func:`collect` gives for the model with exactly these markers (tests compare them with
a capture of the applied plan).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Set

from popart_compiler.cost.activation_memory import owners
from popart_compiler.cost.op_costs import OpCost, ProgramCosts

__all__ = ["Variants"]


class Variants:
    """The ops of program *A* (every planner marker) and *B* (none), merged on demand.

    Args:
        a: the costs of program *A*.
        b: the costs of program *B* (the same ops, without the markers ``markers``).
        markers: names of the planner's marker ops in ``a``.

    Attributes:
        ops: the ops of *A* in execution order (the index of an op is its position).
        index: op name → index in ``ops``.
        marked: marker name → the name of the tensor it marks.
        consumers: op name → indices of the ops of *A* that read it.
    """

    def __init__(self, a: ProgramCosts, b: ProgramCosts, markers: Sequence[str]):
        self.ops: List[OpCost] = list(a.ops)
        self.index = {op.name: i for i, op in enumerate(self.ops)}
        self.b: Dict[str, OpCost] = {op.name: op for op in b.ops}
        self.markers: Set[str] = set(markers)
        self.marked = {m: self.ops[self.index[m]].inputs[0] for m in self.markers}
        owner = owners(self.ops)
        self.consumers: Dict[str, List[int]] = {}
        for i, op in enumerate(self.ops):
            for name in op.inputs:
                self.consumers.setdefault(name, []).append(i)
        affected: Dict[str, Set[str]] = {}
        for m in self.markers:
            names = {self.marked[m], owner.get(self.marked[m], self.marked[m])}
            names |= {self.ops[i].name for i in self.consumers.get(m, [])}
            for name in names:
                affected.setdefault(name, set()).add(m)
        #: op name → the planner markers that change it
        self.affected = affected

    def op(self, index: int, present: Callable[[str], bool]) -> Optional[OpCost]:
        """Op ``index`` of the program with the markers ``present`` selects (``None``:
        an absent marker)."""
        op = self.ops[index]
        if op.name in self.markers:
            return op if present(op.name) else None
        marks = self.affected.get(op.name)
        if not marks:
            return op
        absent = [m for m in marks if not present(m)]
        if len(absent) == len(marks):
            return self.b[op.name]
        if not absent:
            return op
        renamed = tuple(self.marked[n] if n in absent else n for n in op.inputs)
        return dataclasses.replace(op, inputs=renamed)

    def consumers_of(self, name: str, present: Callable[[str], bool]) -> List[int]:
        """Indices of the ops reading ``name`` in the program with the markers
        ``present`` selects (an absent marker's readers read the tensor it marks)."""
        result: List[int] = []
        for i in self.consumers.get(name, []):
            reader = self.ops[i].name
            if reader in self.markers and not present(reader):
                result += self.consumers_of(reader, present)
            else:
                result.append(i)
        return result
