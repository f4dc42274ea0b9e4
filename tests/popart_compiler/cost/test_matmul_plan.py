"""The matmul / convolution plan (issue 21, cause 6): cycles follow from shapes, the tile
count, the AMP block, the partials type, serialisation and the available memory
proportion, not from one efficiency constant."""
import pytest
import torch
import torch.nn as nn

from popart_compiler.cost import matmul_plan
from popart_compiler.cost import op_costs
from popart_compiler.cost import op_plans
from popart_compiler.cost.ipu_model import TARGETS
from popart_compiler.ir import Graph
from popart_compiler.cost.matmul_plan import MatmulProblem, plan
from popart_compiler.cost.matmul_shapes import backward_problems

GC200 = TARGETS["ipu2"]
RATE = op_plans.macs_per_cycle(GC200, True)
XB = op_plans.exchange_bytes_per_cycle(GC200)
TILE = GC200.sram_per_tile


def cycles(problem, tiles=1472, cap=0.6 * TILE, rate=RATE):
    return plan(problem, tiles, rate, XB, cap)


def test_one_tile_pass_follows_the_amp_block():
    """On one tile: ceil(depth / 16) × ceil(cols / 16) AMP passes of 4 cycles per row
    (rows padded to the 6 workers) plus the block's weight load (16 × 16 halves over
    the 64-bit load path) and the loop set-up."""
    p = cycles(MatmulProblem(1, 6, 16, 16, half_partials=True), tiles=1)
    per_pass = 6 * 4 + 16 * 16 * 2 / 8 + matmul_plan.AMP_LOOP_CYCLES
    zero = 6 * (2 + 4)  # the output block's partials zeroed once, 1 row per worker
    assert p.split == (1, 1, 1, 1) and p.compute == per_pass + zero
    # a depth of 17 needs a second pass over the AMP block: padding is not free
    assert cycles(MatmulProblem(1, 6, 17, 16, half_partials=True), tiles=1).compute == \
        2 * per_pass + zero
    # 7 rows use 2 rows per worker on 6 workers
    assert cycles(MatmulProblem(1, 7, 16, 16, half_partials=True), tiles=1).compute == \
        2 * 6 * 4 + per_pass - 6 * 4 + 6 * (2 + 8)


def test_each_workers_run_of_rows_has_poplibs_fixed_cost():
    """PopLibs' 1x1 convolution-partial estimate: 16 + 40 worker cycles for a run's
    first three rows, 4 for each row after, 6 interleaved workers, 17 supervisor
    cycles per pass."""
    assert matmul_plan.AMP_LOOP_CYCLES == 6 * (16 + 40 - 12) + 17 == 281
    one = cycles(MatmulProblem(1, 6, 16, 16, half_partials=True), tiles=1).compute
    many = cycles(MatmulProblem(1, 6 * 64, 16, 16, half_partials=True), tiles=1).compute
    # 64 times the rows in one run cost far less than 64 times the cycles
    assert many < 64 * one / 4
    assert many == 6 * 64 * 4 + 64 + matmul_plan.AMP_LOOP_CYCLES + 6 * (2 + 4 * 64)


def test_small_windowed_products_fill_the_amp_worse_than_one_large_product():
    """Swin's 49-token windows, 32-wide heads (float32): the same MACs as one aligned
    product cost more cycles: the window's rows and columns pad to the workers and the
    AMP block, and every window pays the runs' fixed cost."""
    rate = op_plans.macs_per_cycle(GC200, False, False)
    windows = MatmulProblem(768, 49, 32, 49, exchange_cols=True, half=False)
    aligned = MatmulProblem(1, 768 * 48, 32, 48, exchange_cols=True, half=False)
    padded = MatmulProblem(1, 768 * 49, 32, 49, exchange_cols=True, half=False)
    assert windows.macs == padded.macs
    assert cycles(windows, rate=rate).compute > 1.3 * cycles(padded, rate=rate).compute
    # 49 output columns need 7 AMP blocks of 8 where 48 need 6
    assert cycles(padded, rate=rate).compute > cycles(aligned, rate=rate).compute


def test_never_faster_than_the_peak_and_faster_on_more_tiles():
    problem = MatmulProblem(1, 1024, 1024, 4096, half_partials=True)
    full = cycles(problem)
    assert full.cycles > problem.macs / (RATE * 1472)
    assert cycles(problem, tiles=368).cycles > full.cycles
    assert full.split[0] * full.split[1] * full.split[2] * full.split[3] <= 1472
    # a wide product fills the AMP better than a thin one with the same MACs
    thin = MatmulProblem(1, 1024 * 64, 1024, 64, half_partials=True)
    assert thin.macs == problem.macs // 1 and cycles(thin).cycles > full.cycles


def test_float_partials_halve_the_amp_rate_on_gc200_not_on_gc2():
    problem = MatmulProblem(1, 1024, 1024, 4096)
    half = dataclass_replace(problem, half_partials=True)
    rate_float = op_plans.macs_per_cycle(GC200, True, False)
    assert rate_float == pytest.approx(RATE / 2)
    slow, fast = cycles(problem, rate=rate_float), cycles(half)
    # the AMP phase takes about twice as long (the planner may pick another split)
    assert slow.compute > 1.7 * fast.compute and slow.cycles > 1.5 * fast.cycles
    gc2 = TARGETS["ipu1"]
    assert op_plans.macs_per_cycle(gc2, True, False) == op_plans.macs_per_cycle(gc2, True)


def dataclass_replace(problem, **changes):
    import dataclasses
    return dataclasses.replace(problem, **changes)


def test_the_available_memory_proportion_caps_temporaries_with_serial_passes():
    problem = MatmulProblem(1, 4096, 4096, 4096, half_partials=True)
    free = cycles(problem, cap=0.6 * TILE)
    tight = cycles(problem, cap=0.02 * TILE)
    assert tight.temp_bytes <= 0.02 * TILE * 1472
    assert tight.serial > 1 or tight.temp_bytes < free.temp_bytes
    assert tight.cycles > free.cycles
    assert tight.natural_temp_bytes == free.natural_temp_bytes


def test_backward_products_of_a_linear_layer():
    graph = Graph(torch.export.export(nn.Linear(512, 256), (torch.randn(64, 512),),
                                      strict=False))
    costs = op_costs.collect(graph)
    linear = next(op for op in costs.ops if op.op == "linear")
    (product,) = linear.products
    assert (product.problem.rows, product.problem.depth, product.problem.cols) == \
        (64, 512, 256)
    assert not product.problem.exchange_cols  # the weight stays where the plan wants it
    # the input is a user input: only the weight gradient, Xᵀ @ dY with both operands
    # crossing the exchange
    (wu,) = backward_problems(product)
    assert (wu.rows, wu.depth, wu.cols, wu.exchange_cols) == (512, 64, 256, True)


def test_convolution_products_and_few_input_channels():
    conv = nn.Conv2d(3, 64, 7, 2, 3, bias=False).half()
    graph = Graph(torch.export.export(conv, (torch.randn(2, 3, 224, 224).half(),),
                                      strict=False))
    op = next(op for op in op_costs.collect(graph).ops if op.products)
    (product,) = op.products
    p = product.problem
    assert (p.groups, p.rows, p.depth, p.cols, p.kernel) == (1, 2 * 112 * 112, 147, 64, 49)
    # 3 input channels fill 3 of the AMP's 16: the kernel positions are folded into the
    # channels (poplin's expandDims), so it costs no more than a 147-deep product
    folded = MatmulProblem(1, p.rows, 147, 64, half_partials=True)
    assert cycles(dataclass_replace(p, half_partials=True)).compute <= \
        cycles(folded).compute * 1.01
