"""The plans of an op's matrix products: forward, and backward when training.

Shared by the memory model (the temporaries of the largest product) and the cycle
model (cycles per product). Each product of :mod:`.matmul_shapes` is planned by
:func:`.matmul_plan.plan` on the target's tiles with the available memory proportion
of the op (``set_available_memory``) or of its IPU
(``Options.setAvailableMemoryProportion``; Poplar's default 0.6) and the partials type
of ``Options.Precision.setPartialsType``.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from popart_compiler.cost.ipu_model import IpuTarget
from popart_compiler.cost.matmul_plan import MatmulPlan, plan
from popart_compiler.cost.matmul_shapes import backward_problems

__all__ = ["OpPlans", "op_plans", "DEFAULT_AVAILABLE_MEMORY", "macs_per_cycle",
           "exchange_bytes_per_cycle"]

#: Poplar's default available memory proportion for matmuls and convolutions.
DEFAULT_AVAILABLE_MEMORY = 0.6


@dataclasses.dataclass(frozen=True)
class OpPlans:
    """Plans of one op, each with the number of times it runs per micro-batch.

    Attributes:
        forward: ``(plan, repeat)`` of the forward products.
        backward: ``(plan, repeat)`` of the gradient products.
    """
    forward: Tuple[Tuple[MatmulPlan, int], ...]
    backward: Tuple[Tuple[MatmulPlan, int], ...]

    @property
    def forward_cycles(self) -> float:
        return sum(p.cycles * n for p, n in self.forward)

    @property
    def backward_cycles(self) -> float:
        return sum(p.cycles * n for p, n in self.backward)

    def temporary(self, training: bool) -> Tuple[float, float]:
        """``(temporary bytes, bytes without the memory cap)`` of its largest plan."""
        plans = [p for p, _ in self.forward + (self.backward if training else ())]
        if not plans:
            return 0.0, 0.0
        return (max(p.temp_bytes for p in plans), max(p.natural_temp_bytes for p in plans))


#: Pipeline depth of an AMP unit: with the tile's 64-bit store path (2 float32 per
#: cycle) it bounds the units usable with float32 partials to 8 (see
#: ``IpuTarget.amp_units``).
AMP_PIPELINE_DEPTH = 4


def macs_per_cycle(target: IpuTarget, half: bool, half_partials: bool = True) -> float:
    """AMP multiply-accumulates per tile per cycle: the published peak FLOP/s over tiles ×
    clock × 2 (64 half / 16 float on GC200 and Bow); float32 partials of float16
    inputs run on ``min(amp_units, AMP_PIPELINE_DEPTH × 2)`` of the ``amp_units``
    units (32 on GC200 and Bow, unchanged on GC2)."""
    peak = target.fp16_flops if half else target.fp32_flops
    rate = peak / 2.0 / (target.tiles * target.clock_hz)
    if half and not half_partials:
        rate *= min(target.amp_units, 2 * AMP_PIPELINE_DEPTH) / target.amp_units
    return rate


#: Share of the exchange's peak bandwidth a product's operand exchange achieves:
#: fitted to the calibration set's published throughputs (``bench/calibration.py``)
#: together with :data:`~.op_classes.COMPUTE_SET_CYCLES` (fitted on one case of the
#: validation set; ``docs/ipu-model-estimates.md``). It also stands in for what the
#: model leaves out: Poplar's re-layout copies and the exchange's message overheads.
EXCHANGE_EFFICIENCY = 0.9


def exchange_bytes_per_cycle(target: IpuTarget) -> float:
    """Bytes one tile receives per cycle over the exchange (× :data:`EXCHANGE_EFFICIENCY`)."""
    return EXCHANGE_EFFICIENCY * target.exchange_bytes_per_s / (target.tiles * target.clock_hz)


def op_plans(op, target: IpuTarget, half_partials: bool, proportion: float,
             tiles: Optional[int] = None) -> OpPlans:
    """Plan every product of ``op`` (an :class:`~.op_costs.OpCost`).

    Args:
        op: the op; its ``products`` give the shapes.
        target: the IPU.
        half_partials: float16 partial sums.
        proportion: available memory proportion (cap on temporaries per tile).
        tiles: tiles to plan on (default: the target's).
    """
    tiles = tiles or target.tiles
    cap = proportion * target.sram_per_tile
    xb = exchange_bytes_per_cycle(target)
    forward: List[Tuple[MatmulPlan, int]] = []
    backward: List[Tuple[MatmulPlan, int]] = []
    for product in op.products:
        problem = dataclasses.replace(product.problem, half_partials=half_partials)
        rate = macs_per_cycle(target, problem.half, problem.half_partials)
        forward.append((plan(problem, tiles, rate, xb, cap), product.repeat))
        for grad in backward_problems(dataclasses.replace(product, problem=problem)):
            backward.append((plan(grad, tiles, rate, xb, cap), product.repeat))
    return OpPlans(tuple(forward), tuple(backward))
