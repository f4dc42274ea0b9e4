"""Cycles and throughput: what a compiled program would take on the IPUs of the target.

Per op (one micro-batch, on the tiles its output spans):

* matmuls, convolutions, attention (FLOPs from ``torch.utils.flop_counter``):
  ``FLOPs / (peak rate × efficiency × tiles used / tiles)`` at the float16 or float32
  peak; efficiency :data:`MATMUL_EFFICIENCY` / :data:`CONV_EFFICIENCY`. A temporary
  capped by the available memory proportion costs an extra
  :data:`EXTRA_PASS_COST` per extra pass; each ``serializedMatMul`` slice beyond the
  first :data:`SERIAL_SLICE_COST`.
* other ops: element operations on the vector units (4 float16 / 2 float32 lanes per
  tile per cycle; transcendental ops count 4 operations per element).
* exchange: operands of matmuls / convolutions are re-laid out over the exchange
  (``in bytes / exchange bandwidth``), plus :data:`SYNC_CYCLES` per op (BSP sync).

Training: backward costs twice the forward; ops that are not kept for backward are
recomputed (forward again). Stages add the IPU-Link copies of their boundary tensors,
the first and last stage the host-link transfer of inputs / outputs (unless
``numIOTiles`` overlaps I/O with compute). The pipeline runs in cycles: ``M``
micro-batches over ``S`` stages (training: ``2N − 1``, the last forward stage merged
with the first backward stage) take ``M + S − 1`` pipeline cycles; in each, every IPU
runs its active stages and the cycle lasts as long as the busiest IPU (ramp-up and
ramp-down have fewer active stages). Sharded (not pipelined) execution runs the stages
one after the other. Each weight update adds the optimizer (vector work over the
weights, streaming of off-chip state at the streaming-memory bandwidth) and the
gradient all-reduce between replicas over the IPU-Links.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Sequence, Tuple

from popart_compiler.cost.ipu_model import IpuTarget
from popart_compiler.cost.memory_model import (TILE_GRAIN_BYTES, MemorySettings,
                                               kept_for_backward, matmul_temporary,
                                               recomputation_active)
from popart_compiler.cost.op_costs import OpCost, ProgramCosts

__all__ = ["CycleSettings", "Stage", "PipelineCycle", "CycleEstimate", "estimate_cycles",
           "pipeline_schedule"]

#: Fraction of the peak FLOP rate matmuls reach (calibrated on BERT-Large, README).
MATMUL_EFFICIENCY = 0.42
#: Fraction of the peak FLOP rate convolutions reach (calibrated on ResNet-50).
CONV_EFFICIENCY = 0.35
#: BSP synchronisation and control per op (cycles).
SYNC_CYCLES = 300
#: Extra cost of each additional pass of a matmul whose temporaries are capped.
EXTRA_PASS_COST = 0.15
#: Extra cost of each additional slice of a serialised matmul.
SERIAL_SLICE_COST = 0.05
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
    """
    memory: MemorySettings
    micro_batch: int = 1
    micro_batches: int = 1
    device_iterations: int = 1
    optimizer: str = "SGD"
    io_tiles: int = 0


@dataclasses.dataclass
class Stage:
    """One pipeline stage: ``forward`` or ``backward`` work of one IPU."""
    name: str
    ipu: int
    cycles: float


@dataclasses.dataclass
class PipelineCycle:
    """One pipeline cycle (or ``repeat`` identical steady-state cycles).

    Attributes:
        cycles: duration of one such cycle.
        repeat: how many identical cycles it stands for.
        work: ``(ipu, stage name, micro-batch, cycles)`` of each active stage.
    """
    cycles: float
    repeat: int
    work: List[Tuple[int, str, int, float]]


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
    """Tiles an op runs on: its output or activation inputs (all operands for matmuls
    and convolutions), whichever is larger, spread over tiles in ``TILE_GRAIN_BYTES``
    pieces."""
    size = max(op.out_bytes, op.in_bytes if op.flops > 0 else op.in_bytes - op.weight_bytes)
    return min(target.tiles, max(1, math.ceil(size / TILE_GRAIN_BYTES)))


def op_forward_cycles(op: OpCost, target: IpuTarget, memory: MemorySettings) -> float:
    """Forward cycles of one op for one micro-batch (see the module docstring)."""
    if op.view:
        return 0.0
    tiles = _tiles_used(op, target)
    share = tiles / target.tiles
    if op.flops > 0:
        rate = (target.fp16_flops if op.half else target.fp32_flops) / target.clock_hz
        efficiency = CONV_EFFICIENCY if "conv" in op.op else MATMUL_EFFICIENCY
        compute = op.flops / (rate * efficiency * share)
        temp, natural = matmul_temporary(op, memory, target.memory_bytes)
        if temp and natural > temp:
            compute *= 1 + EXTRA_PASS_COST * (math.ceil(natural / temp) - 1)
        if op.serialization is not None and op.serialization[0] != "Disabled":
            compute *= 1 + SERIAL_SLICE_COST * (op.serialization[1] - 1)
        exchanged = op.in_bytes
    else:
        lanes = 4 if op.half else 2
        compute = op.vector_ops / (lanes * tiles)
        exchanged = 0.1 * op.in_bytes
    exchange = exchanged / (target.exchange_bytes_per_s / target.clock_hz)
    return compute + exchange + SYNC_CYCLES


def pipeline_schedule(stages: Sequence[Stage], micro_batches: int, pipelined: bool
                      ) -> List[PipelineCycle]:
    """The pipeline cycles of ``micro_batches`` through ``stages``.

    Pipelined: ``M + S − 1`` cycles; micro-batch ``m`` is in stage ``s`` in cycle
    ``m + s``; a cycle lasts as long as its busiest IPU. Identical steady-state cycles
    are merged (``repeat``). Not pipelined: each micro-batch runs the stages in turn.
    """
    s, m = len(stages), micro_batches
    if not pipelined or s == 1:
        work = [(st.ipu, st.name, 0, st.cycles) for st in stages]
        return [PipelineCycle(sum(st.cycles for st in stages), m, work)]
    cycles: List[PipelineCycle] = []
    steady_start, steady_end = s - 1, m - 1  # cycles with every stage active
    c = 0
    while c < m + s - 1:
        work = [(st.ipu, st.name, c - i, st.cycles) for i, st in enumerate(stages)
                if 0 <= c - i < m]
        busy: Dict[int, float] = {}
        for ipu, _name, _mb, cyc in work:
            busy[ipu] = busy.get(ipu, 0.0) + cyc
        repeat = steady_end - c + 1 if steady_start <= c <= steady_end else 1
        cycles.append(PipelineCycle(max(busy.values()), repeat, work))
        c += repeat
    return cycles


def _stages(costs: ProgramCosts, target: IpuTarget, settings: CycleSettings
            ) -> Tuple[List[Stage], List[Tuple[str, int, float, float]]]:
    memory = settings.memory
    op_cycles = []
    forward: Dict[Tuple[int, int], float] = {}
    backward: Dict[Tuple[int, int], float] = {}
    recomputing = recomputation_active(costs.ops, memory)
    link = target.ipu_link_bytes_per_s / target.clock_hz
    consumers: Dict[str, set] = {}
    for op in costs.ops:
        for name in op.inputs:
            consumers.setdefault(name, set()).add(op.ipu)
    for op in costs.ops:
        key = (op.stage, op.ipu)
        fwd = op_forward_cycles(op, target, memory)
        bwd = 0.0
        if memory.training and fwd:
            bwd = 2 * fwd + (0.0 if kept_for_backward(op, memory, recomputing) else fwd)
        if consumers.get(op.name, {op.ipu}) - {op.ipu}:
            fwd += op.out_bytes / link
            bwd += op.out_bytes / link if memory.training else 0.0
        forward[key] = forward.get(key, 0.0) + fwd
        backward[key] = backward.get(key, 0.0) + bwd
        op_cycles.append((op.name, op.ipu, fwd, bwd))
    replicas = max(1, memory.replicas)
    boards = math.ceil(replicas * costs.num_ipus / 4)
    host = target.host_link_bytes_per_s * boards / replicas / target.clock_hz
    keys = sorted(forward) or [(0, 0)]
    first, last = keys[0], keys[-1]
    if settings.io_tiles <= 0:
        forward[first] = forward.get(first, 0.0) + costs.input_bytes / host
        forward[last] = forward.get(last, 0.0) + costs.output_bytes / host
    stages = [Stage(f"forward {s} (IPU {i})", i, forward.get((s, i), 0.0)) for s, i in keys]
    if memory.training:
        last_stage = stages.pop()
        s, i = keys[-1]
        stages.append(Stage(f"forward+backward {s} (IPU {i})", i,
                            last_stage.cycles + backward.get(keys[-1], 0.0)))
        stages += [Stage(f"backward {s} (IPU {i})", i, backward.get((s, i), 0.0))
                   for s, i in reversed(keys[:-1])]
    return stages, op_cycles


def _update_cycles(costs: ProgramCosts, target: IpuTarget, settings: CycleSettings) -> float:
    memory = settings.memory
    if not memory.training:
        return 0.0
    replicas = max(1, memory.replicas)
    link = target.ipu_link_bytes_per_s / target.clock_hz
    streaming = target.streaming_bytes_per_s / target.clock_hz
    per_ipu: Dict[int, float] = {}
    for w in costs.weights:
        if not w.trainable:
            continue
        for ipu in w.ipus:
            elements = w.elements / (replicas if memory.optimizer.sharded else 1)
            cycles = elements * OPTIMIZER_OPS.get(settings.optimizer, 8) / \
                (2 * target.tiles)
            for per_element, location in ((memory.optimizer_bytes, memory.optimizer),
                                          (memory.accumulator_bytes, memory.accumulator)):
                off = location.split(w.elements, per_element * w.elements, replicas)[1]
                cycles += 2 * off / streaming
            if replicas > 1:
                cycles += 2 * (replicas - 1) / replicas * w.bytes / link
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
    memory = settings.memory
    stages, op_cycles = _stages(costs, target, settings)
    m = max(1, settings.micro_batches)
    schedule = pipeline_schedule(stages, m, memory.pipelined)
    pipeline = sum(c.cycles * c.repeat for c in schedule)
    update = _update_cycles(costs, target, settings)
    slowest = max((st.cycles for st in stages), default=0.0) or 1.0
    if memory.pipelined and len(stages) > 1:
        steady = max(c.cycles for c in schedule)
        efficiency = m * steady / pipeline if pipeline else 1.0
    else:
        efficiency = 1.0
    if memory.training:
        step = pipeline + update
        run = settings.device_iterations * step
        samples = settings.micro_batch * m * max(1, memory.replicas)
    else:
        step = run = pipeline
        samples = settings.micro_batch * m * max(1, memory.replicas)
    seconds = step / target.clock_hz
    return CycleEstimate(target.clock_hz, op_cycles, stages, schedule, pipeline, update, run,
                         samples / seconds if seconds else 0.0, efficiency,
                         [st.cycles / slowest for st in stages])

