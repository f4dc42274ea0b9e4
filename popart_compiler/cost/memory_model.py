"""Memory per IPU: what a compiled program needs on each IPU of the IPU Model.

Categories (bytes per IPU; ``W`` = weight elements on the IPU, ``R`` = replicas
sharding a tensor with replicated tensor sharding, ``A`` = gradient accumulation):

* **weights**: parameters and buffers read by the IPU's ops (a tied weight on every
  IPU that reads it). Off chip (``TensorLocations.setWeightLocation``): only the
  largest one is resident while it is used.
* **optimizer state**: per trainable element, the optimizer's state tensors
  (SGD velocity, Adam / LAMB first and second moments, RMSprop accumulators) at their
  accumulation dtypes (S-54). Off chip: one tensor's worth streams in for its update.
  Replicated tensor sharding divides it by ``R``.
* **gradient accumulators**: ``A > 1``: one accumulator per trainable weight at
  ``accum_type``. Same location rules.
* **gradients**: the largest weight gradient (each is consumed by its update or its
  accumulator as soon as it is computed).
* **activations**: training keeps, per micro-batch, what backward needs: every op's
  output without recomputation; only the ``recomputation_checkpoint`` outputs (or,
  with ``autoRecomputation``, the matmul / convolution outputs for ``Standard``, the
  stage inputs for ``Pipeline`` / ``RecomputeAll``) with it. Inference: the peak of
  the live tensors in execution order.
* **pipeline stash**: pipelined training keeps the activations of the micro-batches
  in flight: forward stage ``k`` of ``N`` holds ``2(N − k) − 1`` micro-batches (the
  backward of a micro-batch reaches stage ``k`` that many pipeline cycles after its
  forward, as in PopART's pipelining). Off chip with ``setActivationLocation``.
* **temporaries**: the working set of one backward segment (recomputed activations
  and their gradients) and the largest matmul / convolution temporaries:
  operands re-laid out plus float32 partials, divided by the ``serializedMatMul``
  factor and capped by the available memory proportion (``set_available_memory``,
  ``Options.setAvailableMemoryProportion``; default 0.6) of the IPU's memory.
* **code**: Poplar vertex code per distinct op (ops identical after outlining share
  code): :data:`CODE_BYTES_PER_TILE_PER_OP` on each tile the op spans (tensors are
  spread over tiles in :data:`TILE_GRAIN_BYTES` pieces), three times in training
  (forward and two backward ops), plus :data:`RUNTIME_BYTES_PER_TILE` of control code.
* **exchange**: exchange code and buffers, :data:`EXCHANGE_BYTES_PER_TILE` per tile,
  plus double-buffered host streams and inter-IPU copies at stage boundaries.

The constants are our calibration (README "Memory and cycle estimates"): they make the
published BERT-Large configuration fit and BERT-Large on one IPU fail, as on hardware.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from popart_compiler.cost.ipu_model import IpuTarget
from popart_compiler.cost.op_costs import ProgramCosts
from popart_compiler.errors import backend_error

__all__ = ["MemorySettings", "Location", "IpuMemory", "estimate_memory", "check_fits",
           "out_of_memory_message", "recomputation_active", "kept_for_backward",
           "matmul_temporary", "CATEGORIES"]

#: Control code, stack and runtime state per tile.
RUNTIME_BYTES_PER_TILE = 8 * 1024
#: Exchange code and buffers per tile.
EXCHANGE_BYTES_PER_TILE = 4 * 1024
#: Vertex code of one op on one tile.
CODE_BYTES_PER_TILE_PER_OP = 768
#: Bytes of a tensor placed on one tile before the tensor spreads to another one.
TILE_GRAIN_BYTES = 2 * 1024
#: Default available memory proportion for matmul / convolution temporaries.
DEFAULT_AVAILABLE_MEMORY = 0.6

CATEGORIES = ("weights", "optimizer state", "gradient accumulators", "gradients",
              "activations", "pipeline stash", "temporaries", "code", "exchange")

#: ``autoRecomputation`` values (PopART ``RecomputationType``).
RECOMPUTE_NONE, RECOMPUTE_STANDARD, RECOMPUTE_NORM_ONLY, RECOMPUTE_PIPELINE, \
    RECOMPUTE_ALL = range(5)


@dataclasses.dataclass
class Location:
    """A ``TensorLocationSettings`` (options.md §4.3) as the memory model applies it."""
    on_chip: bool = True
    sharded: bool = False
    min_off_chip: int = 0
    min_sharding: int = 0

    @classmethod
    def from_dict(cls, values: Optional[dict]) -> "Location":
        values = values or {}
        return cls(on_chip=bool(values.get("onChip", 1)),
                   sharded=bool(values.get("useReplicatedTensorSharding", 0)),
                   min_off_chip=int(values.get("minElementsForOffChip", 0)),
                   min_sharding=int(values.get("minElementsForReplicatedTensorSharding", 0)))

    def split(self, elements: int, size: int, replicas: int) -> Tuple[float, float]:
        """``(on-chip bytes, off-chip bytes)`` of a tensor of ``elements`` / ``size``."""
        if self.sharded and replicas > 1 and elements >= self.min_sharding:
            size = size / replicas
        if not self.on_chip and elements >= self.min_off_chip:
            return 0.0, float(size)
        return float(size), 0.0


@dataclasses.dataclass
class MemorySettings:
    """What changes memory, from the session options and the optimizer.

    Attributes:
        training: forward, backward and weight update (else forward only).
        optimizer_bytes: optimizer-state bytes per trainable weight element.
        accumulator_bytes: gradient-accumulator bytes per trainable element (0 when
            ``gradientAccumulation`` is 1).
        replicas: replication factor (for replicated tensor sharding).
        auto_recomputation: PopART ``RecomputationType`` value.
        pipelined: pipelined execution (``PipelinedExecution``, the default).
        weight / optimizer / accumulator / activation: tensor locations.
        available_memory: IPU → ``setAvailableMemoryProportion`` value.
    """
    training: bool = False
    optimizer_bytes: float = 0.0
    accumulator_bytes: float = 0.0
    replicas: int = 1
    auto_recomputation: int = RECOMPUTE_NONE
    pipelined: bool = True
    weight: Location = dataclasses.field(default_factory=Location)
    optimizer: Location = dataclasses.field(default_factory=Location)
    accumulator: Location = dataclasses.field(default_factory=Location)
    activation: Location = dataclasses.field(default_factory=Location)
    available_memory: Dict[int, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class IpuMemory:
    """The estimate for one IPU.

    Attributes:
        ipu: IPU index.
        capacity: bytes of on-chip memory.
        categories: bytes per category of :data:`CATEGORIES`.
        off_chip: bytes kept in streaming memory.
        largest: the largest tensors on the IPU, ``(name, category, bytes)``.
    """
    ipu: int
    capacity: int
    categories: Dict[str, float]
    off_chip: float
    largest: List[Tuple[str, str, float]]

    @property
    def total(self) -> float:
        return sum(self.categories.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def _forward_stage_index(costs: ProgramCosts, ipu: int) -> Tuple[int, int]:
    """``(k, N)``: the IPU's first forward stage among the ``N`` stages."""
    stages = [s for s, _ in costs.stages]
    mine = [s for s, i in costs.stages if i == ipu]
    return (stages.index(min(mine)) if mine else 0), len(stages)


def _inference_peak(ops, ipu: int) -> float:
    """Peak bytes of live tensors produced on ``ipu`` in execution order."""
    owner: Dict[str, str] = {}
    last_use: Dict[str, int] = {}
    for index, op in enumerate(ops):
        owner[op.name] = owner.get(op.inputs[0], op.inputs[0]) if op.view and op.inputs \
            else op.name
        last_use[owner[op.name]] = index
        for name in op.inputs:
            if name in owner:
                last_use[owner[name]] = index
    live, peak = 0.0, 0.0
    frees: Dict[int, float] = {}
    for index, op in enumerate(ops):
        if op.ipu == ipu and not op.view:
            live += op.out_bytes
            frees[last_use.get(op.name, index)] = \
                frees.get(last_use.get(op.name, index), 0.0) + op.out_bytes
        peak = max(peak, live)
        live -= frees.pop(index, 0.0)
    return peak


def recomputation_active(ops, settings: MemorySettings) -> bool:
    """Whether backward recomputes forward ops (checkpoints or ``autoRecomputation``)."""
    return settings.training and (settings.auto_recomputation != RECOMPUTE_NONE or
                                  any(op.checkpoint for op in ops))


def kept_for_backward(op, settings: MemorySettings, recomputing: bool) -> bool:
    """Whether ``op``'s output is stored for backward (not recomputed)."""
    if not recomputing:
        return True
    mode = settings.auto_recomputation
    if mode in (RECOMPUTE_PIPELINE, RECOMPUTE_ALL):
        return False
    return op.checkpoint or (mode == RECOMPUTE_STANDARD and op.flops > 0) or \
        (mode == RECOMPUTE_NORM_ONLY and "norm" not in op.op)


def _saved_for_backward(mine, settings: MemorySettings, stage_input: float
                        ) -> Tuple[float, float]:
    """``(saved bytes per micro-batch, working bytes of the largest segment)``;
    ``stage_input``: bytes the IPU receives per micro-batch."""
    produced = [op for op in mine if not op.view]
    recomputing = recomputation_active(mine, settings)
    if not recomputing:
        largest_op = max((op.in_bytes - op.weight_bytes + op.out_bytes for op in produced),
                         default=0)
        return float(sum(op.out_bytes for op in produced)), 2.0 * largest_op
    if settings.auto_recomputation in (RECOMPUTE_PIPELINE, RECOMPUTE_ALL):
        return stage_input, 2.0 * sum(op.out_bytes for op in produced)
    saved, segment, largest = stage_input, 0.0, 0.0
    for op in produced:
        keep = kept_for_backward(op, settings, True)
        if keep:
            saved += op.out_bytes
        if op.checkpoint:
            largest, segment = max(largest, segment), 0.0
        elif not keep:
            segment += op.out_bytes
    return saved, 2.0 * max(largest, segment)


def matmul_temporary(op, settings: MemorySettings, capacity: int) -> Tuple[float, float]:
    """``(temporary bytes, bytes it would take unconstrained)`` of a matmul /
    convolution: operands re-laid out plus float32 partials, divided by the
    ``serializedMatMul`` factor, capped by the available memory proportion."""
    if op.flops <= 0:
        return 0.0, 0.0
    natural = op.in_bytes + op.elements * 4.0
    if op.serialization is not None and op.serialization[0] != "Disabled":
        natural /= op.serialization[1]
    proportion = op.available_memory if op.available_memory is not None else \
        settings.available_memory.get(op.ipu, DEFAULT_AVAILABLE_MEMORY)
    return min(natural, proportion * capacity), natural


def _matmul_temporaries(mine, settings: MemorySettings, capacity: int) -> float:
    """The largest matmul / convolution temporary on the IPU."""
    return max((matmul_temporary(op, settings, capacity)[0] for op in mine), default=0.0)


def _code(mine, target: IpuTarget, training: bool) -> float:
    signatures = {op.signature: op for op in mine if not op.view}
    per_op = sum(min(target.tiles, max(1, math.ceil(op.out_bytes / TILE_GRAIN_BYTES)))
                 for op in signatures.values()) * CODE_BYTES_PER_TILE_PER_OP
    return per_op * (3 if training else 1) + RUNTIME_BYTES_PER_TILE * target.tiles


def estimate_memory(costs: ProgramCosts, target: IpuTarget, settings: MemorySettings
                    ) -> List[IpuMemory]:
    """Estimate the memory of each IPU of one replica.

    Args:
        costs: the costed program (one micro-batch).
        target: the IPU (its tiles × SRAM per tile is the capacity).
        settings: options that change memory.

    Returns:
        One :class:`IpuMemory` per IPU, in IPU order.
    """
    capacity = target.memory_bytes
    result = []
    read_on: Dict[str, set] = {}
    for op in costs.ops:
        for name in op.inputs:
            read_on.setdefault(name, set()).add(op.ipu)
    replicas = settings.replicas
    for ipu in range(costs.num_ipus):
        mine = [op for op in costs.ops if op.ipu == ipu]
        cat = dict.fromkeys(CATEGORIES, 0.0)
        off_chip = 0.0
        tensors: List[Tuple[str, str, float]] = []
        weights = [w for w in costs.weights if ipu in w.ipus]
        largest_weight = max((w.bytes for w in weights), default=0)
        for w in weights:
            on, off = settings.weight.split(w.elements, w.bytes, replicas)
            cat["weights"] += on
            off_chip += off
            tensors.append((w.name, "weights", float(w.bytes)))
            if not settings.training or not w.trainable:
                continue
            for key, per_element, location in (
                    ("optimizer state", settings.optimizer_bytes, settings.optimizer),
                    ("gradient accumulators", settings.accumulator_bytes,
                     settings.accumulator)):
                size = per_element * w.elements
                on, off = location.split(w.elements, size, replicas)
                cat[key] += on
                off_chip += off
                if size:
                    tensors.append((w.name, key, size))
        for key, location, per_element in (
                ("weights", settings.weight, None),
                ("optimizer state", settings.optimizer, settings.optimizer_bytes),
                ("gradient accumulators", settings.accumulator, settings.accumulator_bytes)):
            streamed = [w for w in weights if not location.on_chip
                        and w.elements >= location.min_off_chip
                        and (per_element is None or w.trainable)]
            if streamed and (per_element is None or settings.training):
                biggest = max(streamed, key=lambda w: w.elements)
                size = biggest.bytes if per_element is None else per_element * biggest.elements
                cat[key] += location.split(biggest.elements, size, replicas)[1]
        if settings.training:
            cat["gradients"] = float(largest_weight)
            by_name = {op.name: op for op in costs.ops}
            received = {name for op in mine for name in op.inputs
                        if name in by_name and by_name[name].ipu != ipu}
            stage_input = sum(by_name[n].out_bytes for n in received) + \
                (costs.input_bytes if ipu == 0 else 0)
            saved, working = _saved_for_backward(mine, settings, stage_input)
            cat["activations"] = saved
            k, n = _forward_stage_index(costs, ipu)
            depth = 2 * (n - k) - 1 if settings.pipelined and n > 1 else 1
            stash = saved * (depth - 1)
            on, off = settings.activation.split(int(stash), stash, 1)
            cat["pipeline stash"] = on
            off_chip += off
        else:
            cat["activations"] = _inference_peak(costs.ops, ipu)
            working = 0.0
        temp = _matmul_temporaries(mine, settings, capacity)
        cat["temporaries"] = working + temp
        cat["code"] = float(_code(mine, target, settings.training))
        boundary = sum(op.out_bytes for op in mine if read_on.get(op.name, {ipu}) - {ipu})
        host = (costs.input_bytes if ipu == 0 else 0) + \
            (costs.output_bytes if ipu == costs.num_ipus - 1 else 0)
        cat["exchange"] = float(EXCHANGE_BYTES_PER_TILE * target.tiles + 2 * host +
                                2 * boundary)
        for op in mine:
            if op.out_bytes:
                tensors.append((op.name, "activations", float(op.out_bytes)))
        tensors.sort(key=lambda t: -t[2])
        result.append(IpuMemory(ipu, capacity, cat, off_chip, tensors[:10]))
    return result


def _mb(size: float) -> str:
    return f"{size / 1e6:,.1f} MB"


def out_of_memory_message(memory: Sequence[IpuMemory], target: IpuTarget,
                          settings: MemorySettings, micro_batch: Optional[int] = None) -> str:
    """The text of the out-of-memory error for the IPUs that do not fit."""
    lines = []
    over = [m for m in memory if not m.fits]
    for m in over:
        ranked = sorted(m.categories.items(), key=lambda kv: -kv[1])
        consumers = ", ".join(f"{k} {_mb(v)}" for k, v in ranked[:4] if v > 0)
        tensors = ", ".join(f"{n} ({c}, {_mb(b)})" for n, c, b in m.largest[:3])
        lines.append(
            f"Out of memory on IPU {m.ipu}: the program needs {int(m.total):,} bytes "
            f"({_mb(m.total)}) but an IPU of the {target.name} IPU Model has "
            f"{m.capacity:,} bytes ({_mb(m.capacity)}: {target.tiles} tiles × "
            f"{target.sram_per_tile // 1024} KiB). Largest consumers: {consumers}. "
            f"Largest tensors: {tensors}.")
    worst = over[0].categories if over else {}
    helps = ["place the model on more IPUs (poptorch.BeginBlock / Block with "
             "Options.setExecutionStrategy)"]
    if settings.training and worst.get("activations", 0) + worst.get("pipeline stash", 0):
        helps.append("recomputation (poptorch.recomputationCheckpoint, or "
                     "Options._Popart.set(\"autoRecomputation\", 3))")
    if worst.get("optimizer state", 0) or worst.get("gradient accumulators", 0):
        helps.append("optimizer state and accumulators off chip (Options.TensorLocations."
                     "setOptimizerLocation(poptorch.TensorLocationSettings()."
                     "useOnChipStorage(False)), with useReplicatedTensorSharding(True) "
                     "when replicated)")
    if worst.get("temporaries", 0):
        helps.append("serialised matmuls (poptorch.serializedMatMul) or a lower "
                     "available memory proportion (Options.setAvailableMemoryProportion, "
                     "poptorch.set_available_memory)")
    if worst.get("activations", 0) or worst.get("pipeline stash", 0):
        helps.append("a smaller micro-batch" +
                     (f" (now {micro_batch})" if micro_batch else ""))
    lines.append("Options that would help: " + "; ".join(helps) + ".")
    return "\n".join(lines)


def check_fits(memory: Sequence[IpuMemory], target: IpuTarget, settings: MemorySettings,
               micro_batch: Optional[int] = None) -> None:
    """Raise the out-of-memory error when an IPU does not fit.

    Raises:
        Error: ``type == "poplar_out_of_memory"``; the message names each IPU that does
            not fit, the bytes needed and available, the largest consumers and tensors,
            and the options that would help.
    """
    if all(m.fits for m in memory):
        off = sum(m.off_chip for m in memory)
        if off > target.streaming_memory_bytes * max(1, len(memory)):
            raise backend_error(
                f"Out of streaming memory: {int(off):,} bytes are placed off chip but the "
                f"{target.name} IPU Model has {target.streaming_memory_bytes:,} bytes of "
                "streaming memory per IPU. Keep these tensors on chip "
                "(TensorLocationSettings().useOnChipStorage(True)).",
                type="poplar_out_of_memory")
        return
    raise backend_error(out_of_memory_message(memory, target, settings, micro_batch),
                        type="poplar_out_of_memory")

