"""Branch and bound over the placements of a :class:`~.problem.Problem`.

A placement splits the units into consecutive ranges, one per IPU (optionally the last
units, the *head*, as one more stage on IPU 0), and chooses per IPU an available memory
proportion, per stage whether every layer output is checkpointed, the serialisation
factor of head matmuls, and for the whole program whether the planner checkpoints at
all and where the optimizer state lives. Each IPU's estimate depends only on its own
choices (:meth:`Problem.evaluate`), so the search enumerates, IPU by IPU, the options
that fit and are not slower on every stage than another option of the same range
(Pareto front), and prunes with a lower bound: a pipeline of ``M`` micro-batches over
``S`` stages runs ``M − S + 1`` cycles with every stage busy, each as long as the
busiest IPU, so ``(M − S + 1) × max(load of the IPUs placed, least max-load of the
rest)`` bounds every completion (the rest by a min-max dynamic programme over range
loads that ignores memory). Leaves are scored with the cycle model's own schedule
(:func:`~popart_compiler.cost.cycle_model.schedule_cycles`), so the result is the
optimum of the estimate over this space.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple


from popart_compiler.cost.cycle_model import pipeline_stages, schedule_cycles
from popart_compiler.planner.candidate import Candidate
from popart_compiler.planner.problem import Problem, StageSpec

__all__ = ["Space", "Scored", "search", "score", "closest", "evaluate"]


@dataclasses.dataclass(frozen=True)
class Space:
    """The choices the search may make.

    Attributes:
        num_ipus: IPUs per replica.
        micro_batches: micro-batches per step (gradient accumulation in training,
            device iterations in inference).
        heads: first units the head stage on IPU 0 may start at (empty: never).
        checkpoint_modes: ``False``: without planner checkpoints; ``True``: with
            (per stage: every layer output, or only the stage input).
        optimizer_on_chip: optimizer-state locations to try (``None``: the options').
        serialization: head op name → serialisation factors to try.
    """
    num_ipus: int
    micro_batches: int
    heads: Tuple[int, ...] = ()
    checkpoint_modes: Tuple[bool, ...] = (False, True)
    optimizer_on_chip: Tuple[Optional[bool], ...] = (None,)
    serialization: Tuple[Tuple[str, Tuple[int, ...]], ...] = ()


@dataclasses.dataclass
class Scored:
    """A candidate with the search's figures.

    Attributes:
        candidate: the placement and knobs.
        step_cycles: cycles of one step (pipeline and weight update).
        samples_per_second: estimated throughput of all replicas.
        totals: bytes needed on each IPU.
        fits: every IPU fits.
    """
    candidate: Candidate
    step_cycles: float
    samples_per_second: float
    totals: Tuple[float, ...]
    fits: bool = True


@dataclasses.dataclass
class _Option:
    """One way to run a range of units on an IPU: the choices and their figures."""
    checkpoint: Tuple[Optional[bool], ...]
    serialization: Tuple[Tuple[str, int], ...]
    proportion: float
    forward: Tuple[float, ...]
    backward: Tuple[float, ...]
    update: float
    total: float

    @property
    def load(self) -> float:
        return sum(self.forward) + sum(self.backward)


def _pareto(options: List[_Option]) -> List[_Option]:
    """Options no other option beats on every stage (fastest total load first)."""
    options = sorted(options, key=lambda o: (o.load, o.total))
    kept: List[_Option] = []
    for o in options:
        cycles = o.forward + o.backward
        if not any(all(a <= b for a, b in zip(k.forward + k.backward, cycles))
                   and k.update <= o.update for k in kept):
            kept.append(o)
    return kept


class _Layout:
    """The search of one layout (head start, checkpoint mode, optimizer location)."""

    def __init__(self, problem: Problem, space: Space, head: Optional[int], planned: bool,
                 on_chip: Optional[bool], deadline: float):
        self.p = problem
        self.space = space
        self.head = head
        self.planned = planned
        self.on_chip = on_chip
        self.n_ipus = space.num_ipus
        self.end = head if head is not None else len(problem.units)
        self.count = self.n_ipus + (head is not None)
        self.deadline = deadline
        self.capacity = problem.target.memory_bytes
        self.options: Dict[Tuple[int, int, int], List[_Option]] = {}
        self.fitting: Dict[Tuple[int, int, int], List[_Option]] = {}

    # -- options of one IPU ------------------------------------------------------------

    def _specs(self, ipu: int, a: int, b: int, check: Optional[bool]) -> List[StageSpec]:
        specs = [StageSpec(a, b, ipu, self.count, check)]
        if ipu == 0 and self.head is not None:
            specs.append(StageSpec(self.head, len(self.p.units) - 1, self.count - 1,
                                   self.count, False if self.planned else None))
        return specs

    def _serial_choices(self, specs: Sequence[StageSpec]) -> Iterable[Tuple[Tuple[str, int], ...]]:
        names = []
        for name, factors in self.space.serialization:
            i = self.p.variants.index[name]
            if any(self.p.units[st.first].lo <= i < self.p.units[st.last].hi for st in specs):
                names.append([(name, f) for f in factors])
        return itertools.product(*names)

    def all_options(self, ipu: int, a: int, b: int) -> List[_Option]:
        """Every choice for units ``a..b`` on ``ipu``, fitting or not."""
        key = (ipu, a, b)
        if key in self.options:
            return self.options[key]
        found: List[_Option] = []
        checks = (True, False) if self.planned else (None,)
        for check in checks:
            specs = self._specs(ipu, a, b, check)
            for serial in self._serial_choices(specs):
                ev = self.p.evaluate(ipu, self.n_ipus, specs, dict(serial), self.on_chip)
                found += [_Option(tuple(st.checkpoint for st in specs), tuple(serial),
                                  proportion, tuple(float(f[j]) for f in ev.forward),
                                  tuple(float(bw[j]) for bw in ev.backward), ev.update,
                                  float(ev.totals[j]))
                          for j, proportion in enumerate(self.p.proportions)]
        self.options[key] = found
        return found

    def ipu_options(self, ipu: int, a: int, b: int) -> List[_Option]:
        """The choices for units ``a..b`` on ``ipu`` that fit, Pareto front first by
        load."""
        key = (ipu, a, b)
        if key not in self.fitting:
            self.fitting[key] = _pareto([o for o in self.all_options(ipu, a, b)
                                         if o.total <= self.capacity])
        return self.fitting[key]

    def min_load(self, ipu: int, a: int, b: int) -> float:
        """Least load of units ``a..b`` on ``ipu`` among the options that fit."""
        options = self.ipu_options(ipu, a, b)
        return options[0].load if options else math.inf

    # -- the search --------------------------------------------------------------------

    def _ranges(self, ipu: int, a: int) -> range:
        """Ends ``b`` the range of ``ipu`` starting at ``a`` may take."""
        left = self.n_ipus - 1 - ipu  # IPUs after this one, one unit at least each
        if left == 0:
            return range(self.end - 1, self.end)
        return range(a, self.end - left)

    def rest_bounds(self) -> List[Dict[int, float]]:
        """``rest[i][a]``: least max-load of units ``a..`` on IPUs ``i..`` (fitting)."""
        rest: List[Dict[int, float]] = [dict() for _ in range(self.n_ipus + 1)]
        rest[self.n_ipus][self.end] = 0.0
        for ipu in reversed(range(self.n_ipus)):
            starts = [0] if ipu == 0 else range(ipu, self.end)
            for a in starts:
                best = math.inf
                for b in self._ranges(ipu, a):
                    after = rest[ipu + 1].get(b + 1, math.inf)
                    if after >= best:
                        continue
                    best = min(best, max(self.min_load(ipu, a, b), after))
                rest[ipu][a] = best
        return rest

    def run(self, best: Optional[Scored]) -> Optional[Scored]:
        m = self.space.micro_batches
        s = 2 * self.count - 1 if self.p.training else self.count
        steady = max(1, m - s + 1)
        rest = self.rest_bounds()
        if not math.isfinite(rest[0].get(0, math.inf)):
            return best
        chosen: List[Tuple[Tuple[int, int], _Option]] = []

        def dfs(ipu: int, a: int, load: float, update: float):
            nonlocal best
            if best is not None and time.perf_counter() > self.deadline:
                return  # out of time: keep the best found
            if ipu == self.n_ipus:
                scored = self._score(chosen)
                if (best is None or scored.step_cycles < best.step_cycles) and \
                        self.p.valid([st for _, st in
                                      scored.candidate.stages(len(self.p.units))]):
                    best = scored
                return
            ends = sorted(self._ranges(ipu, a),
                          key=lambda b: max(self.min_load(ipu, a, b),
                                            rest[ipu + 1].get(b + 1, math.inf)))
            for b in ends:
                after = rest[ipu + 1].get(b + 1, math.inf)
                for option in self.ipu_options(ipu, a, b):
                    bound = steady * max(load, option.load, after) + max(update, option.update)
                    if best is not None and bound >= best.step_cycles:
                        break  # options are sorted by load: the rest bound no lower
                    chosen.append(((a, b), option))
                    dfs(ipu + 1, b + 1, max(load, option.load), max(update, option.update))
                    chosen.pop()
        dfs(0, 0, 0.0, 0.0)
        return best

    def _score(self, chosen) -> Scored:
        ranges = tuple(r for r, _ in chosen)
        options = [o for _, o in chosen]
        forward: Dict[int, float] = {}
        backward: Dict[int, float] = {}
        keys = [(k, k) for k in range(self.n_ipus)]
        for k, o in enumerate(options):
            forward[k], backward[k] = o.forward[0], o.backward[0]
        checks = [o.checkpoint[0] for o in options]
        if self.head is not None:
            keys.append((self.n_ipus, 0))
            forward[self.n_ipus] = options[0].forward[1]
            backward[self.n_ipus] = options[0].backward[1]
            checks.append(options[0].checkpoint[1])
        stages = pipeline_stages(keys, forward, backward, self.p.training)
        step, samples = score(self.p, stages, max(o.update for o in options),
                              self.space.micro_batches)
        candidate = Candidate(
            ranges, self.head, tuple(checks) if self.planned else None,
            tuple(o.proportion for o in options),
            tuple(sorted(x for o in options for x in o.serialization)), self.on_chip)
        totals = tuple(o.total for o in options)
        return Scored(candidate, step, samples, totals,
                      all(t <= self.capacity for t in totals))

    def least_memory(self) -> Optional[Scored]:
        """The placement whose fullest IPU needs the least memory (a min-max dynamic
        programme over the ranges' smallest options)."""
        def smallest(ipu, a, b):
            return min(self.all_options(ipu, a, b), key=lambda o: (o.total, o.load))
        rest: List[Dict[int, Tuple[float, Optional[int]]]] = \
            [dict() for _ in range(self.n_ipus + 1)]
        rest[self.n_ipus][self.end] = (0.0, None)
        for ipu in reversed(range(self.n_ipus)):
            for a in ([0] if ipu == 0 else range(ipu, self.end)):
                best = (math.inf, None)
                for b in self._ranges(ipu, a):
                    after = rest[ipu + 1].get(b + 1, (math.inf, None))[0]
                    value = max(smallest(ipu, a, b).total, after)
                    if value < best[0]:
                        best = (value, b)
                rest[ipu][a] = best
        if rest[0][0][1] is None:
            return None
        chosen, a = [], 0
        for ipu in range(self.n_ipus):
            b = rest[ipu][a][1]
            chosen.append(((a, b), smallest(ipu, a, b)))
            a = b + 1
        return self._score(chosen)


def score(problem: Problem, stages, update: float, micro_batches: int
          ) -> Tuple[float, float]:
    """``(cycles per step, samples per second)`` of pipeline ``stages`` with ``update``
    cycles of weight update per step."""
    cycles = dataclasses.replace(problem.cycles, micro_batches=micro_batches)
    estimate = schedule_cycles(stages, update, problem.target, cycles)
    step = estimate.pipeline_cycles + (estimate.update_cycles if problem.training else 0.0)
    return step, estimate.samples_per_second


def search(problem: Problem, space: Space, time_limit: float = math.inf
           ) -> Optional[Scored]:
    """The fastest placement in ``space`` that fits (``None`` when nothing fits).

    Args:
        problem: the costed program.
        space: the choices.
        time_limit: seconds (the search stops with the best found so far).
    """
    deadline = time.perf_counter() + time_limit
    best: Optional[Scored] = None
    for head, planned, on_chip in _layouts(problem, space):
        best = _Layout(problem, space, head, planned, on_chip, deadline).run(best)
    return best

def _layouts(problem: Problem, space: Space
             ) -> Iterable[Tuple[Optional[int], bool, Optional[bool]]]:
    heads = [None] + [h for h in space.heads if space.num_ipus > 1]
    modes = space.checkpoint_modes if problem.training else (False,)
    for head, planned, on_chip in itertools.product(heads, modes, space.optimizer_on_chip):
        count = space.num_ipus + (head is not None)
        if problem.training and space.num_ipus > 1 and space.micro_batches < 2 * count - 1:
            continue  # PopTorch needs gradientAccumulation >= 2 x stages - 1
        if not problem.training and space.micro_batches < count:
            continue
        if space.num_ipus > (head if head is not None else len(problem.units)):
            continue
        yield head, planned, on_chip


def closest(problem: Problem, space: Space) -> Optional[Scored]:
    """When nothing fits: the placement whose fullest IPU needs the least memory."""
    best: Optional[Scored] = None
    for head, planned, on_chip in _layouts(problem, space):
        found = _Layout(problem, space, head, planned, on_chip, math.inf).least_memory()
        if found is not None and (best is None or max(found.totals) < max(best.totals)):
            best = found
    return best


def evaluate(problem: Problem, candidate: Candidate, micro_batches: int) -> Scored:
    """The search's figures for ``candidate`` (each IPU estimated on its own, as the
    search does): equal to the estimate of the whole placed program
    (:func:`~.candidate.full_estimate`) up to float rounding."""
    n = len(problem.units)
    per_ipu = {}
    for ipu in range(candidate.num_ipus):
        specs = candidate.stages_of(ipu, n)
        serial = {name: f for name, f in candidate.serialization
                  if any(problem.units[st.first].lo <= problem.variants.index[name]
                         < problem.units[st.last].hi for st in specs)}
        per_ipu[ipu] = (specs, problem.evaluate(ipu, candidate.num_ipus, specs, serial,
                                                candidate.optimizer_on_chip))
    forward: Dict[int, float] = {}
    backward: Dict[int, float] = {}
    totals = []
    for ipu, (specs, ev) in per_ipu.items():
        j = problem.proportions.index(candidate.proportions[ipu])
        totals.append(float(ev.totals[j]))
        for st, f, b in zip(specs, ev.forward, ev.backward):
            forward[st.position], backward[st.position] = float(f[j]), float(b[j])
    keys = sorted((st.position, ipu) for ipu, (specs, _) in per_ipu.items() for st in specs)
    stages = pipeline_stages(keys, forward, backward, problem.training)
    step, samples = score(problem, stages, max(ev.update for _, ev in per_ipu.values()),
                          micro_batches)
    capacity = problem.target.memory_bytes
    return Scored(candidate, step, samples, tuple(totals), all(t <= capacity for t in totals))
