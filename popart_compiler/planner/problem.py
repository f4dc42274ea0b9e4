"""What the planner searches over: the units of a captured program and the IPU Model's
estimate of one IPU holding some of them, computed from that IPU's ops alone.

A placement puts consecutive :class:`Unit`\\ s on each IPU (one merged pipeline stage
per IPU, and optionally the *head*, the last units, as one more stage on IPU 0). The
IPU Model's memory of an IPU depends only on its own ops, the weights they read, its
stages' positions in the pipeline and which of its tensors other IPUs read; its
stages' cycles likewise (:mod:`popart_compiler.cost`). :class:`Problem` evaluates one
IPU with the cost model's own functions (:func:`~.activation_memory.one_stage`,
:func:`~.memory_model.ipu_parts` / :func:`~.memory_model.finish`,
:func:`~.cycle_model.op_forward_cycles`, ...), for every available memory proportion at
once, so that the search (:mod:`.search`) can combine IPUs without re-costing the
program. Tests check that the IPUs of a placement add up to the estimate of the whole
placed program.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from popart_compiler.cost.activation_memory import (one_stage, owners,
                                                    recomputation_active,
                                                    stage_input)
from popart_compiler.cost.cycle_model import (CycleSettings, host_bytes_per_cycle,
                                              link_bytes_per_cycle, op_backward_cycles,
                                              op_forward_cycles, weight_update_cycles)
from popart_compiler.cost.ipu_model import IpuTarget
from popart_compiler.cost.memory_model import (Location, MemorySettings, finish,
                                               inference_peak, ipu_parts,
                                               matmul_temporary, with_stages)
from popart_compiler.cost.op_costs import OpCost, ProgramCosts
from popart_compiler.planner.variants import Variants

__all__ = ["Unit", "StageSpec", "IpuEval", "Problem", "DEFAULT_PROPORTIONS"]

#: Available memory proportions the planner tries on each IPU.
DEFAULT_PROPORTIONS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.8)


@dataclasses.dataclass(frozen=True)
class Unit:
    """A unit of placement: the ops from the start of one module's call to the start
    of the next unit's.

    Attributes:
        name: the module's path (``model.bert.encoder.layer.3``).
        layer: one of the repeated layers (its outputs may be checkpointed).
        lo / hi: its ops are ``Variants.ops[lo:hi]``.
        markers: the planner's checkpoint markers on its outputs.
    """
    name: str
    layer: bool
    lo: int
    hi: int
    markers: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One forward stage of an IPU.

    Attributes:
        first / last: its units ``units[first..last]``.
        position / count: its index among the ``count`` forward stages.
        checkpoint: ``None`` without planner checkpoints; else whether every layer
            output of the stage is checkpointed (``False``: only the stage's last
            layer output, which costs nothing: the stage recomputes from its input).
    """
    first: int
    last: int
    position: int
    count: int
    checkpoint: Optional[bool] = None

    @property
    def final(self) -> bool:
        return self.position == self.count - 1


@dataclasses.dataclass
class IpuEval:
    """One IPU's estimate for every available memory proportion (``P`` values).

    Attributes:
        totals: bytes needed, ``[P]``.
        forward / backward: cycles per micro-batch of each of its stages, ``[P]`` each.
        update: weight-update cycles per step.
    """
    totals: np.ndarray
    forward: List[np.ndarray]
    backward: List[np.ndarray]
    update: float


@dataclasses.dataclass
class _Stage:
    """One stage's ops, the bytes other IPUs read from it, its cycles per proportion
    (``[P]``; without host I/O), its largest matmul temporaries and its memory."""
    ops: List[OpCost]
    crossing: float
    forward: np.ndarray
    backward: np.ndarray
    temp: np.ndarray
    memory: object


class Problem:
    """The units of one captured program and the per-IPU estimate of any placement.

    Args:
        variants: the program's ops with and without the planner's markers.
        units: the units, in order, covering ``variants.ops``.
        costs: the costs of the program without markers (weights, I/O bytes).
        target: the IPU.
        memory: memory settings of the options (proportions and optimizer location
            are replaced per candidate).
        cycles: cycle settings of the options.
        head_variants: op name → serialisation factor → the op costed with it.
        proportions: the available memory proportions to try.
    """

    def __init__(self, variants: Variants, units: Sequence[Unit], costs: ProgramCosts,
                 target: IpuTarget, memory: MemorySettings, cycles: CycleSettings,
                 head_variants: Optional[Dict[str, Dict[int, OpCost]]] = None,
                 proportions: Sequence[float] = DEFAULT_PROPORTIONS):
        self.variants = variants
        self.units = list(units)
        self.costs = costs
        self.target = target
        self.memory = memory
        self.cycles = cycles
        self.proportions = tuple(proportions)
        self.head_variants = head_variants or {}
        self.training = memory.training
        ops = variants.ops
        self.sizes = {op.name: op.out_bytes for op in ops}
        self.owner = owners(ops)
        self.unit_of = np.zeros(len(ops), dtype=np.int64)
        for k, unit in enumerate(self.units):
            self.unit_of[unit.lo:unit.hi] = k
        self._tables()
        self._cache: Dict[Tuple, IpuEval] = {}
        self._stages: Dict[Tuple, _Stage] = {}
        self._updates: Dict[Tuple, float] = {}
        self._statics: Dict[Tuple, Tuple] = {}
        of = costs.weight_of
        self._unit_weights = [{of[name] for op in variants.ops[u.lo:u.hi]
                               for name in op.inputs if name in of} for u in self.units]

    # -- per-op tables --------------------------------------------------------------

    def _settings(self, proportion: float, ipu: int = 0) -> MemorySettings:
        return dataclasses.replace(self.memory, available_memory={ipu: proportion})

    def _op_row(self, op: OpCost) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        fwd, bwd, temp = [], [], []
        for p in self.proportions:
            s = self._settings(p, op.ipu)
            f = op_forward_cycles(op, self.target, s)
            fwd.append(f)
            bwd.append(op_backward_cycles(op, self.target, s)
                       if self.training and f and op.requires_grad else 0.0)
            temp.append(matmul_temporary(op, s, self.target)[0])
        return np.array(fwd), np.array(bwd), np.array(temp)

    def _tables(self) -> None:
        n, p = len(self.variants.ops), len(self.proportions)
        self.fwd = np.zeros((n, p))
        self.bwd = np.zeros((n, p))
        self.temp = np.zeros((n, p))
        for i, op in enumerate(self.variants.ops):
            self.fwd[i], self.bwd[i], self.temp[i] = self._op_row(op)
        self.cum_fwd = np.vstack([np.zeros(p), np.cumsum(self.fwd, axis=0)])
        self.cum_bwd = np.vstack([np.zeros(p), np.cumsum(self.bwd, axis=0)])
        self.head_rows = {name: {f: self._op_row(op) for f, op in factors.items()}
                          for name, factors in self.head_variants.items()}

    # -- which planner markers a placement has --------------------------------------

    def present(self, stages: Sequence[StageSpec]):
        """The planner markers of a placement (``None`` checkpoint: none): every layer
        output of a checkpointed stage, and the last layer output of every stage but
        the final one (recomputation then starts from each stage's input)."""
        on = set()
        for st in stages:
            if st.checkpoint is None:
                continue
            for k in range(st.first, st.last + 1):
                unit = self.units[k]
                if unit.layer and (st.checkpoint or (k == st.last and not st.final)):
                    on.update(unit.markers)
        return on

    def recomputes(self, count: int) -> bool:
        """Whether the program recomputes with ``count`` forward stages: its
        ``autoRecomputation`` acts (PopTorch's implicit ``Pipeline`` only in a pipeline
        of several stages; without it PopART ignores checkpoints, the user's and the
        planner's alike)."""
        return recomputation_active((), self.memory.auto_recomputation, self.training,
                                    self.memory.pipelined and count > 1)

    def valid(self, stages: Sequence[StageSpec]) -> bool:
        """Whether a placement's stages are what the per-IPU estimate assumes: planner
        checkpoints only where the program recomputes (else they change nothing: the
        same program as without them)."""
        planned = any(st.checkpoint is not None for st in stages)
        return not planned or all(self.recomputes(st.count) for st in stages)

    def _present_around(self, stages: Sequence[StageSpec]):
        """Markers as :meth:`present` for ``stages`` of one IPU; a marker of another
        IPU's unit counts as present when the placement has planner checkpoints (the
        unit before a stage ends the previous stage, whose last layer output is always
        marked)."""
        own = self.present(stages)
        mine = {m for st in stages for k in range(st.first, st.last + 1)
                for m in self.units[k].markers}
        planned = any(st.checkpoint is not None for st in stages)
        return lambda m: m in own if m in mine else planned

    # -- one IPU ----------------------------------------------------------------------

    def evaluate(self, ipu: int, num_ipus: int, stages: Sequence[StageSpec],
                 serialization: Optional[Dict[str, int]] = None,
                 optimizer_on_chip: Optional[bool] = None) -> IpuEval:
        """The estimate of IPU ``ipu`` of ``num_ipus`` holding ``stages``.

        Args:
            ipu / num_ipus: the IPU and the IPUs of a replica.
            stages: its forward stages (one, or two on IPU 0 with the head).
            serialization: serialisation factor of head ops it holds.
            optimizer_on_chip: optimizer state on chip (``None``: as the options).
        """
        serialization = serialization or {}
        key = (ipu, num_ipus, tuple(stages), tuple(sorted(serialization.items())),
               optimizer_on_chip)
        if key not in self._cache:
            self._cache[key] = self._evaluate(ipu, num_ipus, list(stages), serialization,
                                              optimizer_on_chip)
        return self._cache[key]

    def settings_for(self, optimizer_on_chip: Optional[bool]) -> MemorySettings:
        """The memory settings with the optimizer state on or off chip (replicated
        tensor sharding with replicas)."""
        if optimizer_on_chip is None:
            return self.memory
        location = Location(on_chip=optimizer_on_chip, sharded=self.memory.replicas > 1)
        return dataclasses.replace(self.memory, optimizer=location)

    def _evaluate(self, ipu: int, num_ipus: int, stages: List[StageSpec],
                  serialization: Dict[str, int], optimizer_on_chip: Optional[bool]
                  ) -> IpuEval:
        settings = self.settings_for(optimizer_on_chip)
        intervals = tuple((self.units[st.first].lo, self.units[st.last].hi) for st in stages)
        serial = tuple(sorted(serialization.items()))
        parts = [self._stage(st, intervals, serial) for st in stages]
        mine = [op for part in parts for op in part.ops]
        memories = []
        forward, backward = [], []
        host = host_bytes_per_cycle(self.target, settings.replicas, num_ipus)
        for st, part in zip(stages, parts):
            if part.memory is not None:
                piped = settings.pipelined and st.count > 1
                depth = 2 * (st.count - 1 - st.position) + 1 if piped else 1
                memories.append(dataclasses.replace(part.memory, depth=depth))
            fwd = part.forward
            if self.cycles.io_tiles <= 0:
                if st.position == 0:
                    fwd = fwd + self.costs.input_bytes / host
                if st.final:
                    fwd = fwd + self.costs.output_bytes / host
            forward.append(fwd)
            backward.append(part.backward)
        boundary = sum(part.crossing for part in parts)
        key = (ipu == 0, ipu == num_ipus - 1, intervals, serial, optimizer_on_chip,
               boundary, tuple(st.checkpoint for st in stages))
        if key not in self._statics:
            weights = self._weights(stages, ipu)
            host_bytes = (self.costs.input_bytes if ipu == 0 else 0) + \
                (self.costs.output_bytes if ipu == num_ipus - 1 else 0)
            peak = 0.0
            if not self.training:
                names = {op.name for op in mine}
                present = self._present_around(stages)
                ops = [op for op in (self.variants.op(i, present)
                                     for i in range(len(self.variants.ops))) if op is not None]
                peak = inference_peak(ops, lambda op: op.name in names)
            update = sum(self._update(w, optimizer_on_chip) for w in weights
                         if w.trainable) if self.training else 0.0
            self._statics[key] = (ipu_parts(ipu, mine, weights, [], boundary, host_bytes,
                                            self.target, settings, peak, tensors=False),
                                  update)
        static, update = self._statics[key]
        ipu_memory = with_stages(static, memories, settings)
        temp = np.max([part.temp for part in parts], axis=0)
        totals = np.array([finish(ipu_memory, t, self.target.memory_bytes).total
                           for t in temp])
        return IpuEval(totals, forward, backward, update)

    def _update(self, weight, optimizer_on_chip: Optional[bool]) -> float:
        key = (weight.name, optimizer_on_chip)
        if key not in self._updates:
            cycles = dataclasses.replace(self.cycles,
                                         memory=self.settings_for(optimizer_on_chip))
            self._updates[key] = weight_update_cycles(weight, self.target, cycles)
        return self._updates[key]

    def _stage(self, st: StageSpec, intervals: Tuple[Tuple[int, int], ...],
               serial: Tuple[Tuple[str, int], ...]) -> "_Stage":
        """One stage's ops and figures (all but its depth and host I/O), cached."""
        piped = self.memory.pipelined and st.count > 1
        v = self.variants
        lo, hi = self.units[st.first].lo, self.units[st.last].hi
        serial = tuple((n, f) for n, f in serial if lo <= v.index[n] < hi)
        key = (st.first, st.last, st.checkpoint, st.final, piped, intervals, serial)
        if key in self._stages:
            return self._stages[key]
        present = self._present_around([st])
        factors = dict(serial)
        ops: List[OpCost] = []
        crossing = 0.0
        for i in range(lo, hi):
            op = v.op(i, present)
            if op is None:
                continue
            if op.name in factors:
                op = self.head_variants[op.name][factors[op.name]]
            ops.append(op)
            if self._crosses(op.name, present, intervals):
                crossing += op.out_bytes
        fwd = self.cum_fwd[hi] - self.cum_fwd[lo]
        bwd = self.cum_bwd[hi] - self.cum_bwd[lo]
        temp = self.temp[lo:hi].max(axis=0) if hi > lo else np.zeros(len(self.proportions))
        for name, factor in serial:
            i = v.index[name]
            row = self.head_rows[name][factor]
            fwd, bwd = fwd - self.fwd[i] + row[0], bwd - self.bwd[i] + row[1]
            others = np.delete(self.temp[lo:hi], i - lo, axis=0)
            temp = np.max([row[2]] + ([others.max(axis=0)] if len(others) else []), axis=0)
        memory = None
        link = link_bytes_per_cycle(self.target)
        if self.training:
            recomputing = self.recomputes(st.count)
            local = {op.name for op in ops}
            received = stage_input(ops, lambda name: name in v.index and name not in local,
                                   self.costs.user_inputs, self.sizes, self.owner)
            memory = one_stage(ops, st.position, st.count, received,
                               self.memory.auto_recomputation, recomputing,
                               self.memory.pipelined)
            for name in memory.recomputed:
                i = v.index[name]
                fwd_row = self.head_rows[name][factors[name]][0] if name in factors \
                    else self.fwd[i]
                bwd = bwd + fwd_row
            bwd = bwd + crossing / link
        fwd = fwd + crossing / link
        result = _Stage(ops, crossing, fwd, bwd, temp, memory)
        self._stages[key] = result
        return result

    def _crosses(self, name: str, present, intervals) -> bool:
        """Whether an op of another IPU reads ``name``."""
        for c in self.variants.consumers_of(name, present):
            if not any(lo <= c < hi for lo, hi in intervals):
                return True
        return False

    def _weights(self, stages: Sequence[StageSpec], ipu: int):
        """The weights the ops of ``stages`` read, in the program's order (weights no
        op reads live on IPU 0)."""
        read = set()
        for st in stages:
            for k in range(st.first, st.last + 1):
                read |= self._unit_weights[k]
        if ipu == 0:
            read |= self._unread()
        return [w for w in self.costs.weights if w.name in read]

    def _unread(self):
        if not hasattr(self, "_unread_cache"):
            of = self.costs.weight_of
            read = {of[name] for op in self.variants.ops for name in op.inputs if name in of}
            self._unread_cache = {w.name for w in self.costs.weights} - read
        return self._unread_cache
