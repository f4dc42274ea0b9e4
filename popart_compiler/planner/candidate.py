"""A candidate plan: the placement of the units and the knobs, and its estimate as the
whole placed program (the figures a compilation of the applied plan reports)."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from popart_compiler.cost.cost_model import IpuEstimate, estimate_with
from popart_compiler.cost.cycle_model import CycleSettings
from popart_compiler.cost.memory_model import MemorySettings
from popart_compiler.cost.op_costs import ProgramCosts
from popart_compiler.planner.problem import Problem, StageSpec

__all__ = ["Candidate", "assemble", "full_estimate"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A placement of a program's units on the IPUs of a replica, with its knobs.

    Attributes:
        ranges: per IPU, its units ``(first, last)`` (inclusive, consecutive).
        head: the first unit of the head stage, run on IPU 0 after the other IPUs
            (``None``: the last IPU runs the units to the end).
        checkpoints: per forward stage, whether every layer output of the stage is a
            recomputation checkpoint; ``None``: the planner adds no checkpoint.
        proportions: per IPU, its available memory proportion.
        serialization: ``(op name, factor)`` of each serialised head matmul.
        optimizer_on_chip: optimizer state on chip (``None``: as the options say).
    """
    ranges: Tuple[Tuple[int, int], ...]
    head: Optional[int] = None
    checkpoints: Optional[Tuple[bool, ...]] = None
    proportions: Tuple[float, ...] = ()
    serialization: Tuple[Tuple[str, int], ...] = ()
    optimizer_on_chip: Optional[bool] = None

    @property
    def num_ipus(self) -> int:
        return len(self.ranges)

    @property
    def num_stages(self) -> int:
        """Forward pipeline stages (PopART's merged stages)."""
        return self.num_ipus + (self.head is not None)

    def stages(self, num_units: int) -> List[Tuple[int, StageSpec]]:
        """``(ipu, StageSpec)`` of every forward stage, in pipeline order."""
        n = self.num_stages
        marks = self.checkpoints

        def mark(k):
            return None if marks is None else marks[k]
        result = [(ipu, StageSpec(a, b, ipu, n, mark(ipu)))
                  for ipu, (a, b) in enumerate(self.ranges)]
        if self.head is not None:
            result.append((0, StageSpec(self.head, num_units - 1, n - 1, n, mark(n - 1))))
        return result

    def stages_of(self, ipu: int, num_units: int) -> List[StageSpec]:
        """The forward stages of IPU ``ipu``."""
        return [st for i, st in self.stages(num_units) if i == ipu]


def assemble(problem: Problem, candidate: Candidate) -> ProgramCosts:
    """The costed program of ``candidate``: the ops with exactly its checkpoint markers
    and serialisation factors, placed on its IPUs and stages."""
    v = problem.variants
    specs = sorted(candidate.stages(len(problem.units)), key=lambda s: s[1].first)
    present = problem.present([st for _, st in specs])
    factors: Dict[str, int] = dict(candidate.serialization)
    ops = []
    for ipu, st in specs:
        for i in range(problem.units[st.first].lo, problem.units[st.last].hi):
            op = v.op(i, lambda m: m in present)
            if op is None:
                continue
            if op.name in factors:
                op = problem.head_variants[op.name][factors[op.name]]
            ops.append(dataclasses.replace(op, ipu=ipu, stage=st.position))
    readers: Dict[str, set] = {}
    of = problem.costs.weight_of
    for op in ops:
        for name in op.inputs:
            if name in of:
                readers.setdefault(of[name], set()).add(op.ipu)
    weights = [dataclasses.replace(w, ipus=tuple(sorted(readers.get(w.name, {0}))))
               for w in problem.costs.weights]
    stages = sorted({(st.position, ipu) for ipu, st in specs})
    c = problem.costs
    return ProgramCosts(ops, weights, c.input_bytes, c.output_bytes, candidate.num_ipus,
                        stages, c.user_inputs, c.weight_of)


def settings(problem: Problem, candidate: Candidate, micro_batches: int
             ) -> Tuple[MemorySettings, CycleSettings]:
    """The memory and cycle settings of ``candidate`` (proportions per IPU, optimizer
    location, ``micro_batches`` per step)."""
    memory = problem.settings_for(candidate.optimizer_on_chip)
    memory = dataclasses.replace(memory, available_memory=dict(enumerate(candidate.proportions)))
    cycles = dataclasses.replace(problem.cycles, memory=memory, micro_batches=micro_batches)
    return memory, cycles


def full_estimate(problem: Problem, candidate: Candidate, micro_batches: int) -> IpuEstimate:
    """The IPU Model's estimate of the whole placed program of ``candidate``."""
    memory, cycles = settings(problem, candidate, micro_batches)
    return estimate_with(assemble(problem, candidate), problem.target, memory, cycles)
