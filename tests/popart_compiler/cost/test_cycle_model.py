"""popart_compiler/cost/cycle_model.py: the pipeline schedule, stage lists, link rates
and per-weight update cycles."""
import pytest

from popart_compiler.cost.cycle_model import (CycleSettings, OPTIMIZER_OPS, Stage,
                                              allreduce_bytes_per_cycle,
                                              host_bytes_per_cycle, link_bytes_per_cycle,
                                              pipeline_schedule, pipeline_stages,
                                              weight_update_cycles)
from popart_compiler.cost.host_model import GATEWAY_STREAM_BYTES_PER_S
from popart_compiler.cost.ipu_model import TARGETS
from popart_compiler.cost.memory_model import MemorySettings
from popart_compiler.cost.op_classes import COMPUTE_SET_CYCLES, UPDATE_COMPUTE_SETS
from popart_compiler.cost.op_costs import WeightCost
from popart_compiler.enums import OutputMode

IPU2 = TARGETS["ipu2"]


def test_a_pipeline_of_s_stages_takes_m_plus_s_minus_1_cycles():
    stages = [Stage("forward 0 (IPU 0)", 0, 10.0, 10.0), Stage("forward 1 (IPU 1)", 1, 30.0,
                                                                30.0)]
    schedule = pipeline_schedule(stages, micro_batches=4, pipelined=True)
    assert sum(c.repeat for c in schedule) == 4 + 2 - 1
    # ramp-up (stage 0 alone), 3 steady cycles at the slower stage's pace, ramp-down
    assert [(c.cycles, c.repeat) for c in schedule] == [(10.0, 1), (30.0, 3), (30.0, 1)]
    assert [w[:3] for w in schedule[0].work] == [(0, "forward 0 (IPU 0)", 0)]
    assert [w[2] for w in schedule[1].work] == [1, 0]  # micro-batch m in stage s at m + s


def test_stages_on_one_ipu_add_up_in_a_pipeline_cycle():
    stages = [Stage("a", 0, 5.0), Stage("b", 1, 7.0), Stage("c", 0, 4.0)]
    steady = pipeline_schedule(stages, 3, True)[2]
    assert steady.cycles == 9.0  # IPU 0 runs a and c: 5 + 4 > 7


def test_without_pipelining_each_micro_batch_runs_every_stage_in_turn():
    stages = [Stage("a", 0, 10.0), Stage("b", 1, 30.0)]
    (only,) = pipeline_schedule(stages, micro_batches=4, pipelined=False)
    assert (only.cycles, only.repeat) == (40.0, 4)


def test_training_stages_end_with_the_backward_of_earlier_stages_in_reverse():
    keys = [(0, 0), (1, 1), (2, 0)]
    fwd, bwd = {0: 1.0, 1: 2.0, 2: 3.0}, {0: 10.0, 1: 20.0, 2: 30.0}
    stages = pipeline_stages(keys, fwd, bwd, training=True)
    assert [(s.name, s.cycles, s.forward_cycles) for s in stages] == [
        ("forward 0 (IPU 0)", 1.0, 1.0), ("forward 1 (IPU 1)", 2.0, 2.0),
        ("forward+backward 2 (IPU 0)", 33.0, 3.0),
        ("backward 1 (IPU 1)", 20.0, 0.0), ("backward 0 (IPU 0)", 10.0, 0.0)]
    assert [s.name for s in pipeline_stages(keys, fwd, bwd, training=False)] == [
        "forward 0 (IPU 0)", "forward 1 (IPU 1)", "forward 2 (IPU 0)"]


def test_link_rates_per_cycle():
    assert link_bytes_per_cycle(IPU2) == pytest.approx(320e9 / 1.33e9)
    assert host_bytes_per_cycle(IPU2, replicas=8) == pytest.approx(
        GATEWAY_STREAM_BYTES_PER_S / 1.33e9)
    # 2 of the 10 links, both directions: a fifth of the IPU's link bandwidth
    assert allreduce_bytes_per_cycle(IPU2, 4) == pytest.approx(320e9 / 5 / 1.33e9)


def test_weight_update_cycles_add_the_ring_all_reduce_with_replicas():
    w = WeightCost("w", elements=1_000_000, bytes=4_000_000, ipus=(0,), trainable=True,
                   itemsize=4)
    one = CycleSettings(MemorySettings(training=True), optimizer="Adam")
    vector = 1_000_000 * OPTIMIZER_OPS["Adam"] / (2 * IPU2.tiles)
    assert weight_update_cycles(w, IPU2, one) == pytest.approx(
        vector + UPDATE_COMPUTE_SETS["Adam"] * COMPUTE_SET_CYCLES)
    four = CycleSettings(MemorySettings(training=True, replicas=4), optimizer="Adam")
    ring = 2 * 3 / 4 * 4_000_000 / allreduce_bytes_per_cycle(IPU2, 4)
    assert weight_update_cycles(w, IPU2, four) == pytest.approx(
        weight_update_cycles(w, IPU2, one) + ring)


def test_cycle_settings_convert_an_integer_output_mode():
    assert CycleSettings(MemorySettings(), output_mode=1).output_mode is OutputMode.EveryN
    assert CycleSettings(MemorySettings()).output_mode is OutputMode.All
