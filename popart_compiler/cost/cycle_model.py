"""Cycles and throughput: what a compiled program would take on the IPUs of the target.

Per op (one micro-batch):

* matmuls, convolutions, attention: each matrix product is planned on the tiles
  (:mod:`.matmul_plan`: AMP passes, operand exchange, partial-sum reduction,
  synchronisations) with the op's available memory proportion, partials type and
  ``serializedMatMul`` slices; backward plans the two gradient products of each.
* other ops: element operations on the vector units of the tiles their tensors span
  (4 float16 / 2 float32 lanes per tile per cycle; transcendental ops count
  :data:`~.op_costs.TRANSCENDENTAL_OPS` operations per element; every 64-bit word
  of their activation inputs and outputs one load or store), a share of their inputs
  re-laid out over the exchange, and one synchronisation; backward costs
  :data:`BACKWARD_VECTOR_FACTOR` × forward.
* every op: the fixed cost of its compute sets (:mod:`.op_classes`).

Training: ops whose output does not depend on a trainable weight have no backward;
ops that are not kept for backward are recomputed (forward again) as
:mod:`.activation_memory` decides; recomputation checkpoints cost nothing. Stages are
PopART's merged stages; they add the IPU-Link copies of their boundary tensors, the
first and last stage the stream copies of inputs / outputs from the IPU-Gateway
(unless ``numIOTiles`` overlaps I/O with compute, or the data is synthetic); the host
link behind the gateway is host time (:mod:`.host_model`). The pipeline runs in
cycles: ``M`` micro-batches over ``S`` stages (training: ``2N − 1``, the last forward
stage merged with the first backward stage)
take ``M + S − 1`` pipeline cycles; in each, every IPU runs its active stages and the
cycle lasts as long as the busiest IPU (ramp-up and ramp-down have fewer active
stages). Sharded (not pipelined) execution runs the stages one after the other. Each
weight update adds the optimizer (vector work over the weights and its compute sets,
streaming of off-chip state at the streaming-memory bandwidth) and the gradient
all-reduce between replicas over the IPU-Links (GCL's ring,
:func:`allreduce_bytes_per_cycle`); each device iteration its synchronisation with
the host (:data:`~.host_model.STEP_SYNC_SECONDS`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Sequence, Tuple

from popart_compiler.cost.activation_memory import stage_memory
from popart_compiler.cost.host_model import GATEWAY_STREAM_BYTES_PER_S, STEP_SYNC_SECONDS
from popart_compiler.cost.ipu_model import IpuTarget
from popart_compiler.cost.matmul_plan import LOAD_BYTES_PER_CYCLE, SYNC_CYCLES, VECTOR_LANES
from popart_compiler.cost.memory_model import MemorySettings, TILE_GRAIN_BYTES
from popart_compiler.cost.op_classes import (COMPUTE_SET_CYCLES, UPDATE_COMPUTE_SETS,
                                             compute_sets)
from popart_compiler.cost.op_costs import OpCost, ProgramCosts
from popart_compiler.cost.op_plans import exchange_bytes_per_cycle, op_plans
from popart_compiler.enums import OutputMode

__all__ = ["CycleSettings", "Stage", "PipelineCycle", "CycleEstimate", "estimate_cycles",
           "pipeline_schedule", "pipeline_stages", "schedule_cycles", "op_forward_cycles",
           "op_backward_cycles", "weight_update_cycles", "link_bytes_per_cycle",
           "host_bytes_per_cycle", "allreduce_bytes_per_cycle"]

#: Share of a vector op's inputs re-laid out over the exchange.
VECTOR_EXCHANGE_SHARE = 0.1
#: Backward of a vector op over its forward.
BACKWARD_VECTOR_FACTOR = 2.0
#: Vector operations per weight element of one optimizer update.
OPTIMIZER_OPS = {"SGD": 3, "Adam": 12, "AdamW": 13, "RMSprop": 8, "LAMB": 16}


@dataclasses.dataclass
class CycleSettings:
    """What changes cycles besides memory settings.

    Attributes:
        memory: the memory settings (recomputation, locations, proportions).
        micro_batch: samples per micro-batch.
        micro_batches: micro-batches per weight update (training: ``A``) or per run
            (inference: ``D``).
        device_iterations: ``D``.
        optimizer: optimizer type (training).
        io_tiles: ``numIOTiles`` (overlaps host I/O with compute when > 0).
        synthetic: ``enableSyntheticData``: no stream copies from the host.
        ipus_per_replica: IPUs of one replica (the all-reduce's ring).
        output_mode / output_return_period: the user outputs' ``OutputMode`` (an
            integer is converted) and ``EveryN`` period (the host time of a call,
            :mod:`.host_model`).
        accumulation: micro-batches per device iteration and replica (training:
            ``gradientAccumulation``; 1 in inference).
    """
    memory: MemorySettings
    micro_batch: int = 1
    micro_batches: int = 1
    device_iterations: int = 1
    optimizer: str = "SGD"
    io_tiles: int = 0
    synthetic: bool = False
    ipus_per_replica: int = 1
    output_mode: OutputMode = OutputMode.All
    output_return_period: int = 1
    accumulation: int = 1

    def __post_init__(self):
        self.output_mode = OutputMode(self.output_mode)


@dataclasses.dataclass
class Stage:
    """One pipeline stage: ``forward`` and / or ``backward`` work of one IPU.

    Attributes:
        name: ``forward k (IPU i)``, ``forward+backward k (IPU i)`` (the last forward
            stage, which also runs the first backward stage) or ``backward k (IPU i)``.
        ipu: its IPU.
        cycles: cycles per micro-batch.
        forward_cycles: the forward part of ``cycles``.
    """
    name: str
    ipu: int
    cycles: float
    forward_cycles: float = 0.0


@dataclasses.dataclass
class PipelineCycle:
    """One pipeline cycle (or ``repeat`` identical steady-state cycles).

    Attributes:
        cycles: duration of one such cycle.
        repeat: how many identical cycles it stands for.
        work: ``(ipu, stage name, micro-batch, cycles, forward cycles)`` of each active
            stage.
    """
    cycles: float
    repeat: int
    work: List[Tuple[int, str, int, float, float]]


@dataclasses.dataclass
class CycleEstimate:
    """Cycles of one replica.

    Attributes:
        clock_hz: the target's clock.
        op_cycles: ``(op, ipu, forward, backward)`` cycles per micro-batch.
        stages: the pipeline stages in order.
        schedule: the pipeline cycles of one weight update (training) or one run.
        pipeline_cycles: cycles of the schedule.
        update_cycles: optimizer, streaming and all-reduce cycles per weight update.
        run_cycles: cycles of one run (``cycleCount()``).
        samples_per_second: estimated throughput of all replicas.
        efficiency: ``M × steady cycle / pipeline cycles`` (1 for one stage).
        balance: each stage's cycles over the slowest stage's.
    """
    clock_hz: float
    op_cycles: List[Tuple[str, int, float, float]]
    stages: List[Stage]
    schedule: List[PipelineCycle]
    pipeline_cycles: float
    update_cycles: float
    run_cycles: float
    samples_per_second: float
    efficiency: float
    balance: List[float]


def _tiles_used(op: OpCost, target: IpuTarget) -> int:
    """Tiles a vector op runs on: its output or activation inputs, whichever is larger,
    spread over tiles in ``TILE_GRAIN_BYTES`` pieces."""
    size = max(op.out_bytes, op.in_bytes - op.weight_bytes)
    return min(target.tiles, max(1, math.ceil(size / TILE_GRAIN_BYTES)))


def _vector_cycles(op: OpCost, target: IpuTarget) -> float:
    """Element-wise / reduction work of ``op`` on the tiles its tensors span: every
    64-bit word of its activation inputs and outputs is one load or store
    (:data:`~.matmul_plan.LOAD_BYTES_PER_CYCLE`), every element one vector operation
    per lane (transcendental ops :data:`~.op_costs.TRANSCENDENTAL_OPS`); plus the exchange of a
    share of the inputs and one synchronisation."""
    tiles = _tiles_used(op, target)
    moved = (op.in_bytes - op.weight_bytes + op.out_bytes) / LOAD_BYTES_PER_CYCLE
    compute = (moved + op.vector_ops / VECTOR_LANES[op.half]) / tiles
    exchange = VECTOR_EXCHANGE_SHARE * (op.in_bytes - op.weight_bytes) / tiles / \
        exchange_bytes_per_cycle(target)
    return compute + exchange + SYNC_CYCLES


def _plans(op: OpCost, target: IpuTarget, memory: MemorySettings):
    return op_plans(op, target, memory.partials_half(op), memory.proportion(op))


def op_forward_cycles(op: OpCost, target: IpuTarget, memory: MemorySettings) -> float:
    """Forward cycles of one op for one micro-batch (see the module docstring), with
    its compute sets' fixed cost (:mod:`.op_classes`)."""
    if op.view:  # also the recomputation checkpoints: they only mark their input
        return 0.0
    fixed = compute_sets(op) * COMPUTE_SET_CYCLES
    if op.products:
        return _plans(op, target, memory).forward_cycles + fixed
    return _vector_cycles(op, target) + fixed


def op_backward_cycles(op: OpCost, target: IpuTarget, memory: MemorySettings) -> float:
    """Backward cycles of one op for one micro-batch (gradient products, or
    :data:`BACKWARD_VECTOR_FACTOR` × the forward of a vector op), with twice the
    forward's compute sets; recomputation is added by the caller."""
    if op.view:
        return 0.0
    fixed = BACKWARD_VECTOR_FACTOR * compute_sets(op) * COMPUTE_SET_CYCLES
    if op.products:
        return _plans(op, target, memory).backward_cycles + fixed
    return BACKWARD_VECTOR_FACTOR * _vector_cycles(op, target) + fixed


def pipeline_schedule(stages: Sequence[Stage], micro_batches: int, pipelined: bool
                      ) -> List[PipelineCycle]:
    """The pipeline cycles of ``micro_batches`` through ``stages``.

    Pipelined: ``M + S − 1`` cycles; micro-batch ``m`` is in stage ``s`` in cycle
    ``m + s``; a cycle lasts as long as its busiest IPU. Identical steady-state cycles
    are merged (``repeat``). Not pipelined: each micro-batch runs the stages in turn.
    """
    s, m = len(stages), micro_batches
    if not pipelined or s == 1:
        work = [(st.ipu, st.name, 0, st.cycles, st.forward_cycles) for st in stages]
        return [PipelineCycle(sum(st.cycles for st in stages), m, work)]
    cycles: List[PipelineCycle] = []
    steady_start, steady_end = s - 1, m - 1  # cycles with every stage active
    c = 0
    while c < m + s - 1:
        work = [(st.ipu, st.name, c - i, st.cycles, st.forward_cycles)
                for i, st in enumerate(stages) if 0 <= c - i < m]
        busy: Dict[int, float] = {}
        for ipu, _name, _mb, cyc, _fwd in work:
            busy[ipu] = busy.get(ipu, 0.0) + cyc
        repeat = steady_end - c + 1 if steady_start <= c <= steady_end else 1
        cycles.append(PipelineCycle(max(busy.values()), repeat, work))
        c += repeat
    return cycles


def link_bytes_per_cycle(target: IpuTarget) -> float:
    """Bytes an IPU sends over its IPU-Links per cycle (a stage boundary's copy)."""
    return target.ipu_link_bytes_per_s / target.clock_hz


def host_bytes_per_cycle(target: IpuTarget, replicas: int = 1, num_ipus: int = 1) -> float:
    """Bytes per cycle an IPU's stream copies receive from the IPU-Gateway (PCIe Gen4
    x8 per IPU, :data:`~.host_model.GATEWAY_STREAM_BYTES_PER_S`); the 100 GbE host link
    that feeds the gateway is host time (:mod:`.host_model`). ``replicas`` and
    ``num_ipus`` are kept for callers: each IPU has its own gateway link."""
    del replicas, num_ipus
    return GATEWAY_STREAM_BYTES_PER_S / target.clock_hz


def _stages(costs: ProgramCosts, target: IpuTarget, settings: CycleSettings
            ) -> Tuple[List[Stage], List[Tuple[str, int, float, float]]]:
    memory = settings.memory
    op_cycles = []
    forward: Dict[int, float] = {}
    backward: Dict[int, float] = {}
    recomputed = {name for st in stage_memory(
        costs.ops, costs.stages, costs.user_inputs, memory.auto_recomputation,
        memory.pipelined, memory.explicit_recomputation)
        for name in st.recomputed} if memory.training else set()
    link = link_bytes_per_cycle(target)
    consumers: Dict[str, set] = {}
    for op in costs.ops:
        for name in op.inputs:
            consumers.setdefault(name, set()).add(op.ipu)
    for op in costs.ops:
        fwd = op_forward_cycles(op, target, memory)
        bwd = 0.0
        if memory.training and fwd:
            bwd = op_backward_cycles(op, target, memory) if op.requires_grad else 0.0
            if op.name in recomputed:
                bwd += fwd
        if consumers.get(op.name, {op.ipu}) - {op.ipu}:
            fwd += op.out_bytes / link
            bwd += op.out_bytes / link if memory.training else 0.0
        forward[op.stage] = forward.get(op.stage, 0.0) + fwd
        backward[op.stage] = backward.get(op.stage, 0.0) + bwd
        op_cycles.append((op.name, op.ipu, fwd, bwd))
    host = host_bytes_per_cycle(target, memory.replicas, costs.num_ipus)
    keys = costs.stages or [(0, 0)]
    first, last = keys[0][0], keys[-1][0]
    if settings.io_tiles <= 0 and not settings.synthetic:
        forward[first] = forward.get(first, 0.0) + costs.input_bytes / host
        forward[last] = forward.get(last, 0.0) + costs.output_bytes / host
    return pipeline_stages(keys, forward, backward, memory.training), op_cycles


def pipeline_stages(keys: Sequence[Tuple[int, int]], forward: Dict[int, float],
                    backward: Dict[int, float], training: bool) -> List[Stage]:
    """The pipeline stages of merged forward stages ``keys`` (``(stage, ipu)``) with
    their forward and backward cycles: forward stages in order, the last one also
    running its backward, then the backward stages in reverse (training)."""
    stages = [Stage(f"forward {s} (IPU {i})", i, forward.get(s, 0.0), forward.get(s, 0.0))
              for s, i in keys]
    if training:
        s, i = keys[-1]
        stages[-1] = Stage(f"forward+backward {s} (IPU {i})", i,
                           forward.get(s, 0.0) + backward.get(s, 0.0), forward.get(s, 0.0))
        stages += [Stage(f"backward {s} (IPU {i})", i, backward.get(s, 0.0))
                   for s, i in reversed(keys[:-1])]
    return stages


def weight_update_cycles(w, target: IpuTarget, settings: CycleSettings) -> float:
    """Cycles of the weight update of trainable weight ``w`` on each IPU holding it:
    the optimizer's vector work, streaming its off-chip state in and out, and the
    gradient all-reduce between replicas."""
    memory = settings.memory
    replicas = max(1, memory.replicas)
    link = link_bytes_per_cycle(target)
    streaming = target.streaming_bytes_per_s / target.clock_hz
    elements = w.elements / (replicas if memory.optimizer.sharded else 1)
    cycles = elements * OPTIMIZER_OPS.get(settings.optimizer, 8) / (2 * target.tiles) + \
        UPDATE_COMPUTE_SETS.get(settings.optimizer, 4) * COMPUTE_SET_CYCLES
    for per_element, location in ((memory.optimizer_bytes_of(w.itemsize), memory.optimizer),
                                  (memory.accumulator_bytes, memory.accumulator)):
        off = location.split(w.elements, per_element * w.elements, replicas)[1]
        cycles += 2 * off / streaming
    if replicas > 1:
        cycles += 2 * (replicas - 1) / replicas * w.bytes / \
            allreduce_bytes_per_cycle(target, replicas, settings.ipus_per_replica)
    return cycles


#: IPU-Links one hop of GCL's ring of replicas uses (of the 10 of an IPU: the
#: IPU-M2000 and Bow-2000 bring 2 per IPU out to the next machine, and a ring over
#: several machines runs at the pace of those). GCL runs two rings in opposite
#: directions, each with half the data, so both directions of the links carry it.
RING_LINKS = 2
#: IPU-Links per IPU: the published bandwidth (docs/ipu-hardware.md) is that of all of
#: them, both directions.
LINKS_PER_IPU = 10


def allreduce_bytes_per_cycle(target: IpuTarget, replicas: int, ipus_per_replica: int = 1
                              ) -> float:
    """Bytes per cycle each IPU sends in the ring all-reduce of replicated gradients
    (GCL's ring: ``2 (R − 1) / R`` of the gradient's bytes leave each IPU): both
    directions of the :data:`RING_LINKS` links to its ring neighbours. ``replicas``
    and ``ipus_per_replica`` are kept for callers (every hop runs at the same pace)."""
    del replicas, ipus_per_replica
    per_link = target.ipu_link_bytes_per_s / LINKS_PER_IPU
    return per_link * RING_LINKS / target.clock_hz


def _update_cycles(costs: ProgramCosts, target: IpuTarget, settings: CycleSettings) -> float:
    if not settings.memory.training:
        return 0.0
    settings = dataclasses.replace(settings, ipus_per_replica=costs.num_ipus)
    per_ipu: Dict[int, float] = {}
    for w in costs.weights:
        if not w.trainable:
            continue
        cycles = weight_update_cycles(w, target, settings)
        for ipu in w.ipus:
            per_ipu[ipu] = per_ipu.get(ipu, 0.0) + cycles
    return max(per_ipu.values(), default=0.0)


def estimate_cycles(costs: ProgramCosts, target: IpuTarget, settings: CycleSettings
                    ) -> CycleEstimate:
    """Estimate cycles and throughput of one replica.

    Args:
        costs: the costed program (one micro-batch).
        target: the IPU.
        settings: batching, optimizer and memory settings.

    Returns:
        The :class:`CycleEstimate`.
    """
    stages, op_cycles = _stages(costs, target, settings)
    return schedule_cycles(stages, _update_cycles(costs, target, settings), target,
                           settings, op_cycles)


def schedule_cycles(stages: Sequence[Stage], update: float, target: IpuTarget,
                    settings: CycleSettings,
                    op_cycles: Sequence[Tuple[str, int, float, float]] = ()
                    ) -> CycleEstimate:
    """The :class:`CycleEstimate` of ``stages`` run over ``settings.micro_batches``
    micro-batches (:func:`pipeline_schedule`), plus ``update`` cycles per weight update
    (training)."""
    memory = settings.memory
    stages = list(stages)
    m = max(1, settings.micro_batches)
    schedule = pipeline_schedule(stages, m, memory.pipelined)
    pipeline = sum(c.cycles * c.repeat for c in schedule)
    slowest = max((st.cycles for st in stages), default=0.0) or 1.0
    if memory.pipelined and len(stages) > 1:
        steady = max(c.cycles for c in schedule)
        efficiency = m * steady / pipeline if pipeline else 1.0
    else:
        efficiency = 1.0
    sync = STEP_SYNC_SECONDS * target.clock_hz  # each device iteration's host sync
    if memory.training:
        step = pipeline + update + sync
        run = settings.device_iterations * step
    else:
        update = 0.0
        step = run = pipeline + settings.device_iterations * sync
    samples = settings.micro_batch * m * max(1, memory.replicas)
    seconds = step / target.clock_hz
    return CycleEstimate(target.clock_hz, list(op_cycles), stages, schedule, pipeline,
                         update, run, samples / seconds if seconds else 0.0, efficiency,
                         [st.cycles / slowest for st in stages])
