"""Matmul and convolution cycles from shapes: a tile-level plan in the manner of poplin.

Poplar's matmul / convolution planner (poplin) splits a product of a ``rows × depth``
operand and a ``depth × cols`` operand (``groups`` times) over the tiles: each tile
computes a block of ``g × m × n`` outputs over ``k`` of the depth, on its AMP unit;
operands that are not already where the plan wants them cross the exchange; when the
depth is split, the partial sums are exchanged and added. :func:`plan` searches those
splits the same way (splits of each dimension by powers of two, and of rows and
columns also by 3, 5 or 7 times a power of two, that fit on the tiles) and keeps the
fastest one whose temporary memory per tile fits in the available memory proportion;
when none fits, the product is split serially (more passes), as poplin does. Nothing
in it is fitted to a model: the figures are the IPU's.

Figures (public; see ``shared/docs/ipu-hardware.md`` and the poplibs sources):

* AMP rate (the caller's ``macs_per_cycle``, :func:`.op_plans.macs_per_cycle`): the
  spec's peak float16 and float32 FLOP/s divided by tiles × clock: 64 half or 16
  float multiply-accumulates per tile per cycle on GC200 / Bow, 32 half on GC2; half
  of the half rate with float32 partials on GC200 / Bow.
* AMP block: :data:`AMP_DEPTH` input channels (16 half, 8 float) by ``rate × 4 /
  depth`` output channels, 4 cycles per output row (poplibs' AMP vertices); weights
  of a block are loaded through the tile's 64-bit load path (8 bytes per cycle); each
  worker's run of rows in a pass has a fixed cost (:data:`AMP_LOOP_CYCLES`, PopLibs'
  own vertex cycle estimates), so small or thin products (attention heads, Swin's
  windows) fill the AMP badly, and the first pass of an output block zeroes it.
* 6 worker threads per tile (docs/ipu-hardware.md): rows are shared between them, so a tile's rows
  are padded to a multiple of 6.
* Exchange (the caller's ``exchange_bytes_per_cycle``): GC200's 8 TB/s over 1472
  tiles at 1.33 GHz, about 4 bytes per tile per cycle, of which a product achieves
  :data:`.op_plans.EXCHANGE_EFFICIENCY` (the one constant fitted to published
  throughputs).
* Vector unit: 64 bits per cycle (4 half / 2 float lanes) for adding partial sums and
  casting them to the output type.
* BSP: each compute set and each exchange phase ends with a synchronisation of all
  tiles (:data:`SYNC_CYCLES`, an estimate, not fitted).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Tuple

import numpy as np

__all__ = ["MatmulProblem", "MatmulPlan", "plan", "SYNC_CYCLES", "AMP_DEPTH",
           "WORKERS", "LOAD_BYTES_PER_CYCLE", "AMP_LOOP_CYCLES",
           "AMP_WORKER_RUN_CYCLES", "AMP_ZERO_CYCLES"]

#: Input channels one AMP block consumes: 16 half / 8 float (poplibs' AMP vertices).
AMP_DEPTH = {True: 16, False: 8}
#: Cycles per output row of one AMP block (poplibs' AMP vertices).
AMP_ROW_CYCLES = 4
#: Worker threads per tile (spec: 6 threads per tile).
WORKERS = 6
#: Bytes a tile loads per cycle (64-bit load path): loading an AMP block's weights.
LOAD_BYTES_PER_CYCLE = 8
#: Fixed worker cycles of one worker's run of rows in one AMP pass (PopLibs' cycle
#: estimate of its 1x1 convolution-partial vertex, ``PerformanceEstimation.hpp``:
#: 16 cycles to load the work-list pointers and 40 for a run's first three rows, 4 for
#: each row after: the AMP pipeline fills and drains once per run), so ``4 r + 44``
#: worker cycles for ``r`` rows. Workers are interleaved (a worker issues every
#: :data:`WORKERS` th cycle), so a pass costs ``WORKERS`` times its slowest worker.
AMP_WORKER_RUN_CYCLES = 16 + 40 - 3 * 4
#: The supervisor's cycles per AMP pass besides the weight load (the same estimate:
#: 6 per output pass and 11 per output-channel group).
AMP_SUPERVISOR_CYCLES = 6 + 11
#: Fixed tile cycles per AMP pass besides the weight load: the workers' run overhead
#: and the supervisor's (not fitted: PopLibs' published vertex estimates).
AMP_LOOP_CYCLES = WORKERS * AMP_WORKER_RUN_CYCLES + AMP_SUPERVISOR_CYCLES
#: Worker cycles of zeroing a run's partial sums in its first input-channel pass: 2,
#: and 4 per row (the same estimate's ``outputZeroing`` term).
AMP_ZERO_CYCLES = 2
#: Synchronisation of all tiles at the end of a compute set or exchange phase (an
#: estimate, not fitted).
SYNC_CYCLES = 150
#: Vector lanes per tile per cycle (64-bit vector unit).
VECTOR_LANES = {True: 4, False: 2}


@dataclasses.dataclass(frozen=True)
class MatmulProblem:
    """One product to plan: ``groups`` independent ``[rows × depth] @ [depth × cols]``.

    Attributes:
        groups: independent products (batched matmul, grouped convolution).
        rows: output rows (matmul: the rows of the left operand; convolution: batch ×
            output positions).
        depth: the reduced dimension (convolution: input channels × kernel positions).
        cols: output columns (output channels).
        kernel: kernel positions of a convolution (``depth = channels × kernel``): the
            input is exchanged once for all positions; 1 for a matmul.
        exchange_rows: the left operand crosses the exchange (an activation laid out by
            the op that produced it).
        exchange_cols: the right operand crosses the exchange too (an activation, or a
            weight gradient's operand); weights stay where the plan keeps them.
        half: float16 operands (else float32).
        half_partials: float16 partial sums (``setPartialsType(torch.half)``).
        row_reuse: the left operand's rows are ``row_reuse`` shifted views of the
            same data (a convolution's weight gradient: its rows are input channels
            × kernel positions): its data crosses the exchange once, not once per
            view.
    """
    groups: int
    rows: int
    depth: int
    cols: int
    kernel: int = 1
    exchange_rows: bool = True
    exchange_cols: bool = False
    half: bool = True
    half_partials: bool = False
    row_reuse: int = 1

    @property
    def macs(self) -> int:
        return self.groups * self.rows * self.depth * self.cols


@dataclasses.dataclass(frozen=True)
class MatmulPlan:
    """The plan of a :class:`MatmulProblem`.

    Attributes:
        cycles: cycles of the whole product (all serial passes, syncs included).
        compute / exchange / reduce: cycles of the AMP phase, of the operand exchange
            and of exchanging and adding partial sums (one serial pass).
        serial: serial passes (1 unless the memory cap forced more).
        split: tiles per dimension ``(groups, rows, depth, cols)``.
        temp_bytes: temporary memory of the product (all tiles): operand copies and
            partial sums of one pass.
        natural_temp_bytes: temporary memory of the fastest plan without a cap.
    """
    cycles: float
    compute: float
    exchange: float
    reduce: float
    serial: int
    split: Tuple[int, int, int, int]
    temp_bytes: float
    natural_temp_bytes: float


def _splits(size: int, tiles: int, odd: Tuple[int, ...] = (1,)) -> np.ndarray:
    """Tiles a dimension of ``size`` may be split over: ``d × 2^i`` for ``d`` in
    ``odd`` below ``size``, and ``size`` itself, none above ``tiles``."""
    values = {1}
    for d in odd:
        p = d
        while p < size and p <= tiles:
            values.add(p)
            p *= 2
    if size <= tiles:
        values.add(size)
    return np.array(sorted(values), dtype=np.float64)


#: Rows and columns may also be split by 3, 5 or 7 times a power of two, so that plans
#: can use most of a tile count that is not a power of two (1472 = 23 × 64).
_FINE = (1, 3, 5, 7)


def _ceil(a, b):
    return np.ceil(a / b)


@functools.lru_cache(maxsize=4096)
def _best(problem: MatmulProblem, tiles: int, macs_per_cycle: float,
          exchange_bytes_per_cycle: float, cap: float) -> Tuple:
    """The fastest single-pass split whose temporary bytes per tile are ``≤ cap``
    (``cap <= 0``: no limit), as ``(cycles, compute, exchange, reduce, split,
    temp per tile, tiles used)``; ``None`` when nothing fits."""
    p = problem
    half = p.half
    in_bytes = 2 if half else 4
    partial_bytes = 2 if (half and p.half_partials) else 4
    amp_depth = AMP_DEPTH[half]
    amp_cols = max(1, int(round(macs_per_cycle * AMP_ROW_CYCLES / amp_depth)))
    block_load = amp_depth * amp_cols * in_bytes / LOAD_BYTES_PER_CYCLE
    lanes = VECTOR_LANES[half and p.half_partials]
    channels = max(1, p.depth // max(1, p.kernel))
    kernel = max(1, p.kernel)
    if channels < amp_depth and kernel > 1:
        # poplin's expandDims: kernel positions folded into the input channels (the
        # input is exchanged once per folded position)
        channels, kernel = channels * kernel, 1
    pg = _splits(p.groups, tiles)[:, None, None, None]
    pm = _splits(p.rows, tiles, _FINE)[None, :, None, None]
    pk = _splits(channels, tiles)[None, None, :, None]
    pn = _splits(p.cols, tiles, _FINE)[None, None, None, :]
    used = pg * pm * pk * pn
    g = _ceil(p.groups, pg)
    m = _ceil(p.rows, pm)
    c = _ceil(channels, pk)          # input channels per tile
    n = _ceil(p.cols, pn)
    rows_per_worker = _ceil(m, WORKERS)
    out_blocks = g * _ceil(n, amp_cols)
    passes = out_blocks * _ceil(c, amp_depth) * kernel
    # each pass: every worker's run of rows, the block's weight load and the loop's
    # fixed cycles; the first pass of each output block also zeroes its partials
    compute = passes * (rows_per_worker * WORKERS * AMP_ROW_CYCLES + block_load +
                        AMP_LOOP_CYCLES) + \
        out_blocks * WORKERS * (AMP_ZERO_CYCLES + AMP_ROW_CYCLES * rows_per_worker)
    received = 0.0
    if p.exchange_rows:
        received = received + g * m * c * in_bytes / max(1, p.row_reuse)
    if p.exchange_cols:
        received = received + g * c * kernel * n * in_bytes
    partials = g * m * n * partial_bytes
    exchange = received / exchange_bytes_per_cycle
    split_depth = pk > 1
    reduce = np.where(split_depth,
                      partials * (1 - 1 / pk) / exchange_bytes_per_cycle +
                      g * m * n / lanes, 0.0)
    syncs = (1 + (received > 0)) + 2 * split_depth
    cycles = compute + exchange + reduce + syncs * SYNC_CYCLES
    temp = received + partials
    valid = used <= tiles
    if cap > 0:
        valid &= temp <= cap
    if not valid.any():
        return None
    cycles = np.where(valid, cycles, np.inf)
    index = np.unravel_index(int(np.argmin(cycles)), cycles.shape)
    split = (int(pg.flat[index[0]]), int(pm.flat[index[1]]), int(pk.flat[index[2]]),
             int(pn.flat[index[3]]))
    pick = lambda a: float(np.broadcast_to(a, cycles.shape)[index])  # noqa: E731
    return (pick(cycles), pick(compute), pick(exchange), pick(reduce), split,
            pick(temp), pick(used))


def _serial_part(problem: MatmulProblem, passes: int) -> MatmulProblem:
    """One of ``passes`` serial slices: the columns are split first (as poplin's
    output-channel serial split), then the rows."""
    cols = math.ceil(problem.cols / passes)
    if cols >= 1 and passes <= problem.cols:
        return dataclasses.replace(problem, cols=cols)
    rows = math.ceil(problem.rows / math.ceil(passes / problem.cols))
    return dataclasses.replace(problem, cols=1, rows=max(1, rows))


def plan(problem: MatmulProblem, tiles: int, macs_per_cycle: float,
         exchange_bytes_per_cycle: float, available_bytes_per_tile: float) -> MatmulPlan:
    """Plan ``problem`` on ``tiles`` tiles.

    Args:
        problem: the product.
        tiles: tiles of the IPU.
        macs_per_cycle: AMP multiply-accumulates per tile per cycle for the operand type.
        exchange_bytes_per_cycle: bytes a tile receives per cycle.
        available_bytes_per_tile: the available memory proportion × tile memory: the
            cap on the plan's temporary bytes per tile.

    Returns:
        The fastest :class:`MatmulPlan` within the cap (serial passes when needed).
    """
    free = _best(problem, tiles, macs_per_cycle, exchange_bytes_per_cycle, 0.0)
    natural = free[5] * free[6]
    passes = 1
    while True:
        part = _serial_part(problem, passes) if passes > 1 else problem
        best = _best(part, tiles, macs_per_cycle, exchange_bytes_per_cycle,
                     available_bytes_per_tile)
        if best is not None or (part.cols == 1 and part.rows == 1):
            break
        passes *= 2
    if best is None:  # not even one row and column fits: the smallest slice anyway
        best = _best(part, tiles, macs_per_cycle, exchange_bytes_per_cycle, 0.0)
    cycles, compute, exchange, reduce, split, temp, used = best
    return MatmulPlan(cycles * passes, compute, exchange, reduce, passes, split,
                      temp * used, natural)
