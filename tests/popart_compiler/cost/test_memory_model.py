"""popart_compiler/cost/memory_model.py: tensor locations, settings, the inference
peak, finishing an IPU's parts and the whole-program estimate."""
import pytest

from popart_compiler.cost.ipu_model import TARGETS
from popart_compiler.cost.memory_model import (CATEGORIES, IpuMemory, IpuParts, Location,
                                               MemorySettings, estimate_memory, finish,
                                               inference_peak)
from popart_compiler.cost.op_costs import OpCost, ProgramCosts, WeightCost
from popart_compiler.popart_enums import RecomputationType


def test_location_from_tensor_location_settings_and_split():
    loc = Location.from_dict({"onChip": 0, "useReplicatedTensorSharding": 1,
                              "minElementsForOffChip": 10,
                              "minElementsForReplicatedTensorSharding": 100})
    assert loc == Location(on_chip=False, sharded=True, min_off_chip=10, min_sharding=100)
    assert loc.split(1000, 4000.0, replicas=4) == (0.0, 1000.0)  # sharded, then off chip
    assert loc.split(50, 200.0, replicas=4) == (0.0, 200.0)  # too small to shard
    assert loc.split(5, 20.0, replicas=4) == (20.0, 0.0)  # too small to go off chip
    assert Location.from_dict(None).split(1000, 4000.0, 4) == (4000.0, 0.0)


def test_memory_settings_convert_the_recomputation_and_read_proportions():
    s = MemorySettings(auto_recomputation=3, available_memory={1: 0.3})
    assert s.auto_recomputation is RecomputationType.Pipeline
    assert s.proportion(OpCost("a", "mm", ipu=1)) == 0.3
    assert s.proportion(OpCost("a", "mm", ipu=0)) == 0.6
    assert s.proportion(OpCost("a", "mm", ipu=1, available_memory=0.1)) == 0.1
    assert MemorySettings(optimizer_bytes=8.0, optimizer_param_tensors=1
                          ).optimizer_bytes_of(2) == 10.0


def test_inference_peak_frees_a_tensor_after_its_last_reader():
    ops = [OpCost("a", "mm", out_bytes=100), OpCost("b", "relu", out_bytes=50, inputs=("a",)),
           OpCost("v", "view", view=True, inputs=("b",)),
           OpCost("c", "mm", out_bytes=10, inputs=("v",))]
    # a and b live together (150); a is freed after b reads it, b lives (through its
    # view) until c: 50 + 10 then
    assert inference_peak(ops, lambda op: True) == 150.0
    assert inference_peak(ops, lambda op: op.name != "a") == 60.0


def test_finish_adds_the_matmul_temporaries_and_reuses_transients_for_the_update():
    cats = {k: 0.0 for k in CATEGORIES}
    cats.update(weights=100.0, gradients=30.0, temporaries=20.0)
    parts = IpuParts(ipu=1, categories=cats, off_chip=5.0,
                     tensors=[("w", "weights", 100.0), ("g", "gradients", 30.0)], update=80.0)
    m = finish(parts, matmul_temp=10.0, capacity=1000)
    assert m.categories["temporaries"] == 30.0
    assert m.categories["optimizer state"] == 80.0 - 30.0 - 30.0
    assert (m.ipu, m.off_chip, m.largest[0]) == (1, 5.0, ("w", "weights", 100.0))
    assert m.total == 100 + 30 + 30 + 20 and m.fits
    assert not IpuMemory(0, 10, {"weights": 11.0}, 0.0, []).fits


def test_estimate_memory_counts_each_weight_once_per_ipu_that_reads_it():
    target = TARGETS["ipu2"]
    ops = [OpCost("mm", "linear", out_bytes=4096, inputs=("x", "p_w"))]
    weights = [WeightCost("w", 1024, 4096, (0,), True, 4)]
    costs = ProgramCosts(ops, weights, 4096, 4096, 1, [(0, 0)], {"x": 4096}, {"p_w": "w"})
    (ipu,) = estimate_memory(costs, target, MemorySettings())
    assert ipu.categories["weights"] == 4096 and ipu.categories["optimizer state"] == 0
    assert ipu.capacity == target.memory_bytes
    trained = estimate_memory(costs, target, MemorySettings(training=True, optimizer_bytes=8))
    assert trained[0].categories["optimizer state"] >= 8 * 1024
