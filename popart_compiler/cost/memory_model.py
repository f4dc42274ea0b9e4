"""Memory per IPU: what a compiled program needs on each IPU of the IPU Model.

Categories (bytes per IPU; ``R`` = replicas sharding a tensor with replicated tensor
sharding, ``A`` = gradient accumulation):

* **weights**: parameters and buffers read by the IPU's ops; tied names holding one
  tensor count once per IPU that reads it. Off chip
  (``TensorLocations.setWeightLocation``): only the largest one is resident while it
  is used.
* **optimizer state**: per trainable element, the optimizer's state tensors
  (SGD velocity, Adam / LAMB first and second moments, RMSprop accumulators) at their
  accumulation dtypes (docs/semantics.md S-54); the combined SGD variant keeps one tensor, the
  velocity, in the parameter's dtype (it is also the gradient accumulator). Off chip:
  one tensor's worth streams in for its update; the update runs after the pipeline
  has drained, so that buffer reuses the memory of the backward pass's transients
  (gradients, temporaries) and only counts where it is larger. Replicated tensor
  sharding divides it by ``R``.
* **gradient accumulators**: ``A > 1``: one accumulator per trainable weight at
  ``accum_type`` (none for the combined SGD variant). Same location rules.
* **gradients**: the largest weight gradient produced at once (each is consumed by its
  update or its accumulator as soon as it is computed; a serialised product produces
  one slice at a time; look-up tables accumulate their rows directly).
* **activations** and **pipeline stash**: training, per merged pipeline stage
  (:mod:`.activation_memory`): what backward needs of one micro-batch, and the copies
  for the other micro-batches in flight; inference: the peak of the live tensors in
  execution order. The stash goes off chip with ``setActivationLocation``.
* **temporaries**: the backward working set of the largest recomputation segment plus
  the temporaries of the largest matmul / convolution plan (:mod:`.matmul_plan`:
  operand copies and partial sums, capped per tile by the available memory proportion
  of ``set_available_memory`` / ``Options.setAvailableMemoryProportion``, default 0.6).
* **code**: Poplar vertex code per distinct op (ops identical after outlining share
  code): :data:`CODE_BYTES_PER_TILE_PER_OP` on each tile the op spans (tensors are
  spread over tiles in :data:`TILE_GRAIN_BYTES` pieces), three times in training
  (forward and two backward ops), plus :data:`RUNTIME_BYTES_PER_TILE` of control code.
* **exchange**: exchange code and buffers, :data:`EXCHANGE_BYTES_PER_TILE` per tile,
  plus double-buffered host streams and inter-IPU copies at stage boundaries.

The code and exchange constants are estimates (kept from the first version of the
model, not refitted; ``docs/ipu-model-estimates.md``); everything else follows
from shapes, dtypes and options.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from popart_compiler.cost.activation_memory import RECOMPUTE_NONE, stage_memory
from popart_compiler.cost.ipu_model import IpuTarget
from popart_compiler.cost.op_costs import ProgramCosts
from popart_compiler.cost.op_plans import DEFAULT_AVAILABLE_MEMORY, op_plans
from popart_compiler.popart_enums import RecomputationType

__all__ = ["MemorySettings", "Location", "IpuMemory", "IpuParts", "estimate_memory",
           "ipu_parts", "with_stages", "finish", "inference_peak",
           "matmul_temporary", "CATEGORIES", "DEFAULT_AVAILABLE_MEMORY"]

#: Control code, stack and runtime state per tile.
RUNTIME_BYTES_PER_TILE = 8 * 1024
#: Exchange code and buffers per tile.
EXCHANGE_BYTES_PER_TILE = 4 * 1024
#: Vertex code of one op on one tile.
CODE_BYTES_PER_TILE_PER_OP = 768
#: The saved RNG state of one tile (``enableLoadAndOffloadRNGState``): 6 workers × 4
#: 32-bit seed words, kept once on the tile and once in its stream buffer.
RNG_STATE_BYTES_PER_TILE = 2 * 6 * 4 * 4
#: Bytes of a tensor placed on one tile before the tensor spreads to another one.
TILE_GRAIN_BYTES = 2 * 1024

CATEGORIES = ("weights", "optimizer state", "gradient accumulators", "gradients",
              "activations", "pipeline stash", "temporaries", "code", "exchange")


@dataclasses.dataclass
class Location:
    """A ``TensorLocationSettings`` (docs/api-sections.md options §4.3) as the memory model applies
    it."""
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

    def split(self, elements: int, size: float, replicas: int) -> Tuple[float, float]:
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
        optimizer_param_tensors: optimizer-state tensors stored in each parameter's own
            dtype (the combined SGD variant's velocity: 1).
        accumulator_bytes: gradient-accumulator bytes per trainable element (0 when
            ``gradientAccumulation`` is 1, and for the combined SGD variant).
        replicas: replication factor (for replicated tensor sharding).
        auto_recomputation: the ``autoRecomputation`` option (PopART's
            ``RecomputationType``; an integer is converted).
        explicit_recomputation: ``explicitRecomputation``.
        rng_state: ``enableLoadAndOffloadRNGState`` (PopTorch's default): each tile
            keeps a copy of its workers' RNG state (:data:`RNG_STATE_BYTES_PER_TILE`).
        pipelined: pipelined execution (``PipelinedExecution``, the default).
        weight / optimizer / accumulator / activation: tensor locations.
        available_memory: IPU → ``setAvailableMemoryProportion`` value.
        half_partials: float16 partial sums in matmuls
            (``Precision.setPartialsType(torch.half)``).
        conv_half_partials: float16 partial sums in convolutions.
    """
    training: bool = False
    optimizer_bytes: float = 0.0
    optimizer_param_tensors: int = 0
    accumulator_bytes: float = 0.0
    replicas: int = 1
    auto_recomputation: RecomputationType = RECOMPUTE_NONE
    explicit_recomputation: bool = False
    rng_state: bool = False
    pipelined: bool = True
    weight: Location = dataclasses.field(default_factory=Location)
    optimizer: Location = dataclasses.field(default_factory=Location)
    accumulator: Location = dataclasses.field(default_factory=Location)
    activation: Location = dataclasses.field(default_factory=Location)
    available_memory: Dict[int, float] = dataclasses.field(default_factory=dict)
    half_partials: bool = False
    conv_half_partials: bool = False

    def __post_init__(self):
        self.auto_recomputation = RecomputationType(int(self.auto_recomputation))

    def optimizer_bytes_of(self, itemsize: int) -> float:
        """Optimizer-state bytes per element of a parameter of ``itemsize`` bytes."""
        return self.optimizer_bytes + self.optimizer_param_tensors * itemsize

    def proportion(self, op) -> float:
        """Available memory proportion of ``op``: its own, its IPU's, or 0.6."""
        if op.available_memory is not None:
            return op.available_memory
        return self.available_memory.get(op.ipu, DEFAULT_AVAILABLE_MEMORY)

    def partials_half(self, op) -> bool:
        """Whether ``op`` accumulates in float16 (convolutions and matmuls have their
        own options)."""
        return self.conv_half_partials if "conv" in op.op else self.half_partials


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


def inference_peak(ops, mine: Callable[[object], bool]) -> float:
    """Peak bytes of live tensors produced by the ops ``mine`` selects, in the
    execution order of ``ops`` (views and in-place ops share their input's buffer; a
    tensor lives until its last reader on any IPU)."""
    owner: Dict[str, str] = {}
    last_use: Dict[str, int] = {}
    for index, op in enumerate(ops):
        alias = (op.view or op.inplace) and op.inputs
        owner[op.name] = owner.get(op.inputs[0], op.inputs[0]) if alias else op.name
        last_use[owner[op.name]] = index
        for name in op.inputs:
            if name in owner:
                last_use[owner[name]] = index
    live, peak = 0.0, 0.0
    frees: Dict[int, float] = {}
    for index, op in enumerate(ops):
        if op.memory_bytes and mine(op):
            live += op.memory_bytes
            frees[last_use.get(op.name, index)] = \
                frees.get(last_use.get(op.name, index), 0.0) + op.memory_bytes
        peak = max(peak, live)
        live -= frees.pop(index, 0.0)
    return peak


def matmul_temporary(op, settings: MemorySettings, target: IpuTarget
                     ) -> Tuple[float, float]:
    """``(temporary bytes, bytes without the memory cap)`` of a matmul / convolution:
    the largest of its plans (forward, and backward in training); ``(0, 0)`` for
    other ops."""
    if not op.products:
        return 0.0, 0.0
    plans = op_plans(op, target, settings.partials_half(op), settings.proportion(op))
    return plans.temporary(settings.training)


def _code(mine, target: IpuTarget, training: bool, rng_state: bool = False) -> float:
    signatures = {op.signature: op for op in mine if not op.view}
    per_op = sum(min(target.tiles, max(1, math.ceil(op.out_bytes / TILE_GRAIN_BYTES)))
                 for op in signatures.values()) * CODE_BYTES_PER_TILE_PER_OP
    runtime = RUNTIME_BYTES_PER_TILE + (RNG_STATE_BYTES_PER_TILE if rng_state else 0)
    return per_op * (3 if training else 1) + runtime * target.tiles


def _state(weights, settings: MemorySettings, replicas: int, cat: Dict[str, float],
           tensors: List[Tuple[str, str, float]]) -> Tuple[float, float]:
    """Add the resident weights, optimizer state and accumulators to ``cat``; return
    ``(off-chip bytes, bytes streamed in for the weight update)``."""
    off_chip = 0.0
    for w in weights:
        on, off = settings.weight.split(w.elements, w.bytes, replicas)
        cat["weights"] += on
        off_chip += off
        tensors.append((w.name, "weights", float(w.bytes)))
        if not settings.training or not w.trainable:
            continue
        for key, per_element, location in (
                ("optimizer state", settings.optimizer_bytes_of(w.itemsize),
                 settings.optimizer),
                ("gradient accumulators", settings.accumulator_bytes,
                 settings.accumulator)):
            size = per_element * w.elements
            on, off = location.split(w.elements, size, replicas)
            cat[key] += on
            off_chip += off
            if size:
                tensors.append((w.name, key, size))
    # off-chip tensors stream in one at a time: the largest is resident while used
    # (weights: in every pass; optimizer state and accumulators: in the update)
    update = 0.0
    for key, location, state in (("weights", settings.weight, False),
                                 ("optimizer state", settings.optimizer, True),
                                 ("gradient accumulators", settings.accumulator, True)):
        streamed = [w for w in weights if not location.on_chip
                    and w.elements >= location.min_off_chip
                    and (not state or (w.trainable and settings.training))]
        if not streamed:
            continue
        biggest = max(streamed, key=lambda w: w.elements)
        size = biggest.bytes if not state else biggest.elements * (
            settings.optimizer_bytes_of(biggest.itemsize) if key == "optimizer state"
            else settings.accumulator_bytes)
        size = location.split(biggest.elements, size, replicas)[1]
        if state:
            update += size
        else:
            cat[key] += size
    return off_chip, update


@dataclasses.dataclass
class IpuParts:
    """One IPU's memory before the matmul / convolution temporaries are added (they
    depend on the available memory proportion; :func:`finish` adds them).

    Attributes:
        ipu: IPU index.
        categories: bytes per category; ``temporaries`` holds the backward working
            set only.
        off_chip: bytes kept in streaming memory.
        update: optimizer state and accumulators streamed in for the weight update.
        tensors: ``(name, category, bytes)`` of its tensors (for ``largest``).
    """
    ipu: int
    categories: Dict[str, float]
    off_chip: float
    update: float
    tensors: List[Tuple[str, str, float]]


def ipu_parts(ipu: int, mine: Sequence, weights: Sequence, stages: Sequence,
              boundary: float, host: float, target: IpuTarget, settings: MemorySettings,
              inference_activations: float = 0.0, tensors: bool = True) -> IpuParts:
    """What IPU ``ipu`` holds, but its matmul temporaries (see :func:`estimate_memory`).

    Args:
        ipu: the IPU.
        mine: its ops.
        weights: the weights its ops read (``WeightCost``).
        stages: its forward stages' :class:`~.activation_memory.StageMemory` (training).
        boundary: bytes of its op outputs read on other IPUs.
        host: bytes of host inputs / outputs it streams per micro-batch.
        target / settings: the IPU and the memory settings.
        inference_activations: inference: its peak of live tensors.
        tensors: also list its tensors (for the ``largest`` of :func:`finish`).
    """
    cat = dict.fromkeys(CATEGORIES, 0.0)
    listed: List[Tuple[str, str, float]] = []
    off_chip, update = _state(weights, settings, settings.replicas, cat, listed)
    if settings.training:
        cat["gradients"] = float(max((op.weight_grad_bytes for op in mine), default=0))
    else:
        cat["activations"] = inference_activations
    cat["code"] = float(_code(mine, target, settings.training, settings.rng_state))
    cat["exchange"] = float(EXCHANGE_BYTES_PER_TILE * target.tiles + 2 * host + 2 * boundary)
    if tensors:
        listed += [(op.name, "activations", float(op.out_bytes)) for op in mine
                   if op.out_bytes]
    return with_stages(IpuParts(ipu, cat, off_chip, update, listed if tensors else []),
                       stages, settings)


def with_stages(parts: IpuParts, stages: Sequence, settings: MemorySettings) -> IpuParts:
    """``parts`` (of an IPU without its stages) with the activations, pipeline stash
    and backward working set of its forward ``stages`` added (training)."""
    if not settings.training or not stages:
        return parts
    cat = dict(parts.categories)
    off_chip = parts.off_chip
    working = cat["temporaries"]
    for st in stages:
        cat["activations"] += st.saved
        on, off = settings.activation.split(int(st.stash), st.stash, 1)
        cat["pipeline stash"] += on
        off_chip += off
        working = max(working, st.working)
    cat["temporaries"] = working
    return IpuParts(parts.ipu, cat, off_chip, parts.update, parts.tensors)


def finish(parts: IpuParts, matmul_temp: float, capacity: int) -> IpuMemory:
    """The :class:`IpuMemory` of ``parts`` with ``matmul_temp`` bytes of matmul /
    convolution temporaries (the largest plan of its ops)."""
    cat = dict(parts.categories)
    cat["temporaries"] += matmul_temp
    # the weight update runs after the pipeline has drained: state streamed in for
    # it reuses the memory of the backward pass's transients
    cat["optimizer state"] += max(0.0, parts.update - cat["temporaries"] - cat["gradients"])
    largest = sorted(parts.tensors, key=lambda t: -t[2])[:10]
    return IpuMemory(parts.ipu, capacity, cat, parts.off_chip, largest)


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
    read_on: Dict[str, set] = {}
    for op in costs.ops:
        for name in op.inputs:
            read_on.setdefault(name, set()).add(op.ipu)
    stages = stage_memory(costs.ops, costs.stages, costs.user_inputs,
                          settings.auto_recomputation, settings.pipelined,
                          settings.explicit_recomputation) \
        if settings.training else []
    result = []
    for ipu in range(costs.num_ipus):
        mine = [op for op in costs.ops if op.ipu == ipu]
        boundary = sum(op.out_bytes for op in mine if read_on.get(op.name, {ipu}) - {ipu})
        host = (costs.input_bytes if ipu == 0 else 0) + \
            (costs.output_bytes if ipu == costs.num_ipus - 1 else 0)
        peak = 0.0 if settings.training else \
            inference_peak(costs.ops, lambda op, i=ipu: op.ipu == i)
        parts = ipu_parts(ipu, mine, [w for w in costs.weights if ipu in w.ipus],
                          [st for st in stages if st.ipu == ipu], boundary, host, target,
                          settings, peak)
        temp = max((matmul_temporary(op, settings, target)[0] for op in mine), default=0.0)
        result.append(finish(parts, temp, target.memory_bytes))
    return result
