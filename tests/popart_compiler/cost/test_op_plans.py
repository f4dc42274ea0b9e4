"""popart_compiler/cost/op_plans.py: AMP rates, exchange bandwidth and the plans of an
op's products."""
import pytest

from popart_compiler.cost.ipu_model import TARGETS
from popart_compiler.cost.matmul_plan import MatmulProblem
from popart_compiler.cost.matmul_shapes import Product
from popart_compiler.cost.op_costs import OpCost
from popart_compiler.cost.op_plans import (EXCHANGE_EFFICIENCY, exchange_bytes_per_cycle,
                                           macs_per_cycle, op_plans)

IPU2, IPU1 = TARGETS["ipu2"], TARGETS["ipu1"]


def test_macs_per_cycle_follow_the_peak_flops():
    # GC200: 250 TFLOP/s half, 62.5 float over 1472 tiles at 1.33 GHz: 64 and 16 MACs
    assert macs_per_cycle(IPU2, half=True) == pytest.approx(250e12 / 2 / (1472 * 1.33e9))
    assert macs_per_cycle(IPU2, half=True) == pytest.approx(63.85, abs=0.01)
    assert macs_per_cycle(IPU2, half=False) == pytest.approx(
        macs_per_cycle(IPU2, half=True) / 4)
    # float32 partials of float16 inputs: 8 of GC200's 16 AMP units, all 8 of GC2's
    assert macs_per_cycle(IPU2, True, half_partials=False) == pytest.approx(
        macs_per_cycle(IPU2, True) / 2)
    assert macs_per_cycle(IPU1, True, half_partials=False) == macs_per_cycle(IPU1, True)


def test_exchange_bytes_per_cycle_is_the_efficient_share_per_tile():
    assert exchange_bytes_per_cycle(IPU2) == pytest.approx(
        EXCHANGE_EFFICIENCY * 8e12 / (1472 * 1.33e9))
    assert 3.6 < exchange_bytes_per_cycle(IPU2) < 3.7


def test_op_plans_plan_the_forward_and_both_gradients_of_each_product():
    product = Product(MatmulProblem(1, 256, 512, 1024), repeat=3)
    op = OpCost("mm", "linear", products=(product,))
    plans = op_plans(op, IPU2, half_partials=True, proportion=0.6)
    assert len(plans.forward) == 1 and len(plans.backward) == 2
    assert all(repeat == 3 for _, repeat in plans.forward + plans.backward)
    assert plans.forward_cycles == pytest.approx(3 * plans.forward[0][0].cycles)
    assert plans.backward_cycles > plans.forward_cycles  # two products of equal MACs
    inference, _ = plans.temporary(training=False)
    training, _ = plans.temporary(training=True)
    assert 0 < inference <= training
    none = op_plans(OpCost("relu", "relu"), IPU2, True, 0.6)
    assert (none.forward, none.backward, none.temporary(True)) == ((), (), (0.0, 0.0))


def test_a_lower_proportion_never_raises_the_temporary_bytes():
    op = OpCost("mm", "linear", products=(Product(MatmulProblem(1, 4096, 4096, 4096)),))
    low = op_plans(op, IPU2, True, 0.05).temporary(False)[0]
    high = op_plans(op, IPU2, True, 0.6).temporary(False)[0]
    assert low <= high
    assert low <= 0.05 * IPU2.sram_per_tile * IPU2.tiles
