"""The IPU Model's cost model on small captured graphs: targets, per-op costs, memory per
IPU by category, the options that change it, cycles and the pipeline schedule."""
import logging
import math

import pytest
import torch
import torch.nn as nn

from popart_compiler.cost import cost_model
from popart_compiler.cost import cycle_model, host_model, op_classes
from popart_compiler.cost import memory_model
from popart_compiler.cost import op_costs
from popart_compiler.cost import op_plans
from popart_compiler.errors import Error
from popart_compiler.cost.ipu_model import TARGETS, target_for
from popart_compiler.ir import Graph
from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.popart_options import PopartOptions
from popart_compiler.session_options import SessionOptions


# Steering ops as the IPU Model sees them (matched by op name, contract B), defined in a
# test namespace so that these tests do not depend on poptorch.ops.
@torch.library.custom_op("poptorch_test::recomputation_checkpoint", mutates_args=())
def checkpoint(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


checkpoint.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op("poptorch_test::set_available_memory", mutates_args=())
def set_available_memory(x: torch.Tensor, proportion: float) -> torch.Tensor:
    return x.clone()


set_available_memory.register_fake(lambda x, proportion: torch.empty_like(x))


@torch.library.custom_op("poptorch_test::serialized_matmul", mutates_args=())
def serialized_matmul(a: torch.Tensor, b: torch.Tensor, mode: str, factor: int
                      ) -> torch.Tensor:
    return a @ b


serialized_matmul.register_fake(lambda a, b, mode, factor: a @ b)


def capture(module, *inputs):
    return Graph(torch.export.export(module, inputs, strict=False))


class Mlp(nn.Module):
    def __init__(self, width=64, depth=3, checkpoints=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.checkpoints = checkpoints

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
            if self.checkpoints:
                x = checkpoint(x)
        return x.sum()


ADAM = OptimizerDescription("Adam", {}, [], {})
MB = 1e6


def memory(graph, training=True, optimizer=ADAM, target="ipu2", **options):
    raw = options.pop("raw", {})
    opts = SessionOptions(raw=raw, popart=PopartOptions.from_raw(raw), **options)
    return cost_model.estimate(graph, opts, training, target_for(target), optimizer)


# -- targets -------------------------------------------------------------------------


def test_targets_follow_the_hardware_figures():
    assert (TARGETS["ipu1"].tiles, TARGETS["ipu2"].tiles, TARGETS["ipu21"].tiles) == \
        (1216, 1472, 1472)
    assert TARGETS["ipu2"].memory_bytes == 1472 * 624 * 1024  # ≈ 900 MB
    assert TARGETS["ipu21"].clock_hz == 1.85e9 and TARGETS["ipu21"].fp16_flops == 350e12
    assert TARGETS["ipu2"].ipu_link_bytes_per_s == 320e9
    assert TARGETS["ipu21"].ipu_link_bytes_per_s == 10 * 512e9 / 8
    assert TARGETS["ipu2"].host_link_bytes_per_s == 64e9
    assert TARGETS["ipu2"].exchange_bytes_per_s == 8e12
    small = target_for("ipu21", small=True)
    assert small.tiles == 4 and small.memory_bytes == 4 * 624 * 1024
    assert small.clock_hz == TARGETS["ipu21"].clock_hz
    with pytest.raises(Error, match="Invalid IPU model version"):
        target_for("ipu3")


# -- per-op costs ----------------------------------------------------------------------


def test_op_costs_come_from_shapes_and_the_flop_counter():
    graph = capture(nn.Linear(32, 16), torch.randn(8, 32))
    costs = op_costs.collect(graph)
    linear = next(op for op in costs.ops if op.op == "linear")
    assert linear.flops == 2 * 8 * 32 * 16
    assert linear.out_bytes == 8 * 16 * 4 and linear.elements == 8 * 16
    assert linear.in_bytes == (8 * 32 + 16 * 32 + 16) * 4
    assert {w.name: w.bytes for w in costs.weights} == {"weight": 16 * 32 * 4,
                                                        "bias": 16 * 4}
    assert costs.input_bytes == 8 * 32 * 4 and costs.output_bytes == 8 * 16 * 4
    assert costs.num_ipus == 1 and costs.stages == [(0, 0)]


def test_counting_flops_registers_no_process_wide_module_hooks(monkeypatch):
    """FlopCounterMode's module tracker registered global module hooks while the cost
    model counted, and another thread's training backward failed on them (seen in
    the full suite, tests/poptorch/test_threads.py, under load)."""
    import torch.utils.module_tracker as module_tracker
    registered = []
    monkeypatch.setattr(module_tracker, "register_module_forward_pre_hook",
                        lambda hook: registered.append(hook))
    graph = capture(nn.Linear(32, 16), torch.randn(8, 32))
    linear = next(op for op in op_costs.collect(graph).ops if op.op == "linear")
    assert linear.flops == 2 * 8 * 32 * 16
    assert registered == []


def test_placement_metadata_is_read_per_node():
    class Placement:  # contract A: only the attributes are read
        def __init__(self, ipu, stage):
            self.ipu, self.stage = ipu, stage

    graph = capture(Mlp(), torch.randn(4, 64))
    calls = [n for n in graph.module.graph.nodes if n.op == "call_function"]
    for i, node in enumerate(calls):
        node.meta["placement"] = Placement(1 if i >= len(calls) // 2 else 0,
                                           1 if i >= len(calls) // 2 else 0)
    costs = op_costs.collect(graph, layers_per_ipu=[3])  # metadata wins
    assert costs.num_ipus == 2 and costs.stages == [(0, 0), (1, 1)]
    assert {op.ipu for op in costs.ops} == {0, 1}


def test_layer_placement_from_a_layers_per_ipu_list():
    graph = capture(Mlp(depth=4), torch.randn(4, 64))
    costs = op_costs.collect(graph, layers_per_ipu=[1, 3])
    ipus = {w.name: w.ipus for w in costs.weights}
    assert ipus["layers.0.weight"] == (0,) and ipus["layers.3.weight"] == (1,)
    assert costs.stages == [(0, 0), (1, 1)]
    with pytest.raises(Error, match=r"places 3 layers but the model has 4"):
        op_costs.collect(graph, layers_per_ipu=[1, 2])


# -- memory --------------------------------------------------------------------------


def test_weights_optimizer_state_and_accumulators():
    graph = capture(nn.Linear(64, 32), torch.randn(8, 64))
    elements = 64 * 32 + 32
    est = memory(graph, gradient_accumulation=4)
    cat = est.memory[0].categories
    assert cat["weights"] == elements * 4
    assert cat["optimizer state"] == elements * 8  # Adam: two float32 moments
    assert cat["gradient accumulators"] == elements * 4
    assert cat["gradients"] == 64 * 32 * 4  # the largest weight's gradient
    half = OptimizerDescription("Adam", {}, [], {}, first_order_type=torch.float16,
                                accum_type=torch.float16)
    cat = memory(graph, optimizer=half, gradient_accumulation=4).memory[0].categories
    assert cat["optimizer state"] == elements * 6
    assert cat["gradient accumulators"] == elements * 2
    inference = memory(graph, training=False).memory[0].categories
    assert inference["optimizer state"] == inference["gradient accumulators"] == 0
    assert memory(graph, gradient_accumulation=1).memory[0].categories[
        "gradient accumulators"] == 0
    sgd = OptimizerDescription("SGD", {"momentum": 0.0}, [], {}, constant={"momentum"})
    assert memory(graph, optimizer=sgd).memory[0].categories["optimizer state"] == 0


def test_off_chip_optimizer_state_and_replicated_tensor_sharding():
    graph = capture(nn.Linear(256, 256), torch.randn(8, 256))
    on = memory(graph).memory[0]
    off_chip = {"onChip": 0}
    off = memory(graph, raw={"location_optimizer": off_chip}).memory[0]
    state = (256 * 256 + 256) * 8
    assert on.categories["optimizer state"] == state and on.off_chip == 0
    assert off.off_chip == state
    # only the largest tensor's state streams in for its update, after the pipeline has
    # drained: it reuses the backward pass's transients and counts beyond them only
    streamed = 256 * 256 * 8
    transients = off.categories["gradients"] + off.categories["temporaries"]
    assert off.categories["optimizer state"] == max(0.0, streamed - transients)
    sharded = memory(graph, replication_factor=4,
                     raw={"location_optimizer": {"onChip": 0,
                                                 "useReplicatedTensorSharding": 1}}).memory[0]
    assert sharded.off_chip == state / 4
    big_only = memory(graph, raw={"location_optimizer": {
        "onChip": 0, "minElementsForOffChip": 1000}}).memory[0]
    assert big_only.off_chip == 256 * 256 * 8
    assert big_only.categories["optimizer state"] == 256 * 8 + max(
        0.0, streamed - big_only.categories["gradients"] -
        big_only.categories["temporaries"])
    weights_off = memory(graph, raw={"location_weight": off_chip}).memory[0]
    assert weights_off.categories["weights"] == 256 * 256 * 4  # the largest, streamed


def test_recomputation_keeps_only_checkpoints():
    x = torch.randn(64, 256)
    plain = memory(capture(Mlp(256, 4), x)).memory[0].categories
    activation = 64 * 256 * 4
    # Without recomputation the input, every linear output (the relus run in place on
    # them) and the scalar sum are kept.
    assert plain["activations"] == activation + 4 * activation + 4
    # On one IPU PopTorch leaves recomputation off: PopART ignores the checkpoints
    ignored = memory(capture(Mlp(256, 4, checkpoints=True), x)).memory[0].categories
    assert ignored["activations"] == plain["activations"]
    # With recomputation on (ResNet-50's RecomputeAll + explicitRecomputation) only
    # the input and the checkpoints that later ops of the stage read are kept (all
    # four: the last one feeds the sum) ...
    explicit = {"autoRecomputation": 4, "explicitRecomputation": True}
    checkpointed = memory(capture(Mlp(256, 4, checkpoints=True), x),
                          raw=explicit).memory[0].categories
    assert checkpointed["activations"] == activation + 4 * activation
    # ... and without checkpoints only the stage input
    everything = memory(capture(Mlp(256, 4), x), raw=explicit).memory[0].categories
    assert everything["activations"] == activation
    # implicit recomputation keeps what follows the last checkpoint (PopART's
    # allCheckpointAfterLastCheckpoint): here the scalar sum
    implicit = memory(capture(Mlp(256, 4, checkpoints=True), x),
                      raw={"autoRecomputation": 4}).memory[0].categories
    assert implicit["activations"] == activation + 4 * activation + 4


def test_pipeline_stash_holds_the_micro_batches_in_flight():
    graph = capture(Mlp(256, 3, checkpoints=True), torch.randn(64, 256))
    costs = op_costs.collect(graph, layers_per_ipu=[1, 1, 1])
    settings = cost_model.memory_settings(SessionOptions(gradient_accumulation=8), True,
                                          ADAM)
    ipus = memory_model.estimate_memory(costs, TARGETS["ipu2"], settings)
    saved = [m.categories["activations"] for m in ipus]
    stash = [m.categories["pipeline stash"] for m in ipus]
    # forward stage k of N = 3 holds 2(N - k) - 1 micro-batches: 5, 3, 1
    assert stash == [4 * saved[0], 2 * saved[1], 0]
    sharded = memory_model.MemorySettings(**{**settings.__dict__, "pipelined": False})
    assert all(m.categories["pipeline stash"] == 0
               for m in memory_model.estimate_memory(costs, TARGETS["ipu2"], sharded))
    off = memory_model.MemorySettings(**{**settings.__dict__, "activation":
                                         memory_model.Location(on_chip=False)})
    first = memory_model.estimate_memory(costs, TARGETS["ipu2"], off)[0]
    assert first.categories["pipeline stash"] == 0 and first.off_chip >= stash[0]


class BigMatmul(nn.Module):
    def __init__(self, proportion=None, serial=None):
        super().__init__()
        self.w = nn.Parameter(torch.randn(1024, 1024))
        self.proportion, self.serial = proportion, serial

    def forward(self, x):
        if self.serial:
            y = serialized_matmul(x, self.w, "OutputChannels", self.serial)
        else:
            y = x @ self.w
        if self.proportion is not None:
            y = set_available_memory(y, self.proportion)
        return y


def temporaries_and_cycles(module, **options):
    est = memory(capture(module, torch.randn(512, 1024)), training=False, **options)
    return est.memory[0].categories["temporaries"], est.cycles.run_cycles


def test_available_memory_proportion_and_serialisation_change_temporaries():
    temp, cycles = temporaries_and_cycles(BigMatmul())
    tile = TARGETS["ipu2"].sram_per_tile
    tiles = TARGETS["ipu2"].tiles
    assert 0 < temp <= 0.6 * tile * tiles  # Poplar's default proportion
    capped, slower = temporaries_and_cycles(
        BigMatmul(), raw={"available_memory_proportion": {0: 0.005}})
    assert capped <= 0.005 * tile * tiles and capped < temp and slower > cycles
    op_capped, op_slower = temporaries_and_cycles(BigMatmul(proportion=0.005))
    assert (op_capped, op_slower) == (capped, slower)  # set_available_memory, per op
    serial, serial_cycles = temporaries_and_cycles(BigMatmul(serial=4))
    assert serial < temp and serial_cycles > cycles


def test_out_of_memory_message_names_ipu_bytes_consumers_and_fixes(compiler_logs):
    graph = capture(nn.Linear(1024, 1024), torch.randn(16, 1024))
    opts = SessionOptions(gradient_accumulation=2)
    est = cost_model.estimate(graph, opts, True, target_for("ipu2", small=True), ADAM)
    assert not est.fits
    with pytest.raises(Error) as info:
        cost_model.check(est, strict=True)
    text = str(info.value.message)
    m = est.memory[0]
    assert info.value.type == "poplar_out_of_memory"
    assert f"Out of memory on IPU 0: the program needs {int(m.total):,} bytes" in text
    assert f"has {m.capacity:,} bytes" in text and "4 tiles" in text
    assert "Largest consumers: optimizer state" in text and "weight (weights" in text
    for fix in ("more IPUs", "recomputation", "off chip", "smaller micro-batch"):
        assert fix in text
    # without the strict mode (and with debug.allowOutOfMemory) the same text is a
    # warning, as on Poplar's IPU Model
    cost_model.check(est)
    cost_model.check(est, strict=True, allow_out_of_memory=True)
    logged = [r.getMessage() for r in compiler_logs.records if r.levelno == logging.WARNING]
    assert len(logged) == 2 and all(text in message for message in logged)


# -- cycles ------------------------------------------------------------------------------


def test_op_cycles_follow_the_target_rates():
    graph = capture(nn.Linear(2048, 2048).half(), torch.randn(512, 2048).half())
    costs = op_costs.collect(graph)
    linear = next(op for op in costs.ops if op.op == "linear")
    settings = memory_model.MemorySettings()
    ipu2 = cycle_model.op_forward_cycles(linear, TARGETS["ipu2"], settings)
    plans = op_plans.op_plans(linear, TARGETS["ipu2"], False, 0.6)
    # the plan, and the fixed cost of the product's compute sets (op_classes.py)
    assert ipu2 == plans.forward_cycles + 3 * op_classes.COMPUTE_SET_CYCLES
    # never faster than the AMP peak: 64 half multiply-accumulates per tile per cycle
    # with float16 partials, 32 with float32 partials on GC200
    assert op_plans.macs_per_cycle(TARGETS["ipu2"], True) == pytest.approx(64, rel=3e-3)
    assert op_plans.macs_per_cycle(TARGETS["ipu2"], True, False) == pytest.approx(32, rel=3e-3)
    assert op_plans.macs_per_cycle(TARGETS["ipu1"], True, False) == pytest.approx(32, rel=3e-3)
    macs = 512 * 2048 * 2048
    assert ipu2 > macs / (32 * 1472)
    half = memory_model.MemorySettings(half_partials=True)
    assert cycle_model.op_forward_cycles(linear, TARGETS["ipu2"], half) < ipu2
    # the same op in seconds is faster on Bow (higher clock and FP16 rate)
    bow = cycle_model.op_forward_cycles(linear, TARGETS["ipu21"], settings)
    assert bow / 1.85e9 < ipu2 / 1.33e9


def test_pipeline_schedule_ramp_up_steady_state_and_ramp_down():
    stages = [cycle_model.Stage(f"s{i}", i, 100.0) for i in range(3)]
    schedule = cycle_model.pipeline_schedule(stages, 8, pipelined=True)
    assert sum(c.repeat for c in schedule) == 8 + 3 - 1
    assert [len(c.work) for c in schedule] == [1, 2, 3, 2, 1]
    assert schedule[2].repeat == 6
    total = sum(c.cycles * c.repeat for c in schedule)
    assert total == 100.0 * (8 + 3 - 1)
    assert 8 * 100.0 / total == pytest.approx(8 / (8 + 3 - 1))  # M / (M + S - 1)
    # an unbalanced stage sets the pace of every cycle it is active in
    slow = [cycle_model.Stage("a", 0, 100.0), cycle_model.Stage("b", 1, 300.0)]
    schedule = cycle_model.pipeline_schedule(slow, 4, pipelined=True)
    assert [c.cycles for c in schedule] == [100.0, 300.0, 300.0]
    assert sum(c.cycles * c.repeat for c in schedule) == 100 + 3 * 300 + 300
    sequential = cycle_model.pipeline_schedule(slow, 4, pipelined=False)
    assert sum(c.cycles * c.repeat for c in sequential) == 4 * 400


def test_training_cycles_throughput_and_efficiency():
    graph = capture(Mlp(256, 4), torch.randn(32, 256))
    opts = SessionOptions(gradient_accumulation=16, device_iterations=2)
    one = cost_model.estimate(graph, opts, True, TARGETS["ipu2"], ADAM)
    piped = cost_model.estimate(graph, opts, True, TARGETS["ipu2"], ADAM,
                                layers_per_ipu=[2, 2])
    c = one.cycles
    assert [s.name for s in piped.cycles.stages] == [
        "forward 0 (IPU 0)", "forward+backward 1 (IPU 1)", "backward 0 (IPU 0)"]
    # each device iteration: the pipeline, the weight update and the host sync
    sync = host_model.STEP_SYNC_SECONDS * 1.33e9
    assert c.run_cycles == pytest.approx(2 * (c.pipeline_cycles + c.update_cycles + sync))
    seconds = (c.pipeline_cycles + c.update_cycles + sync) / 1.33e9
    assert c.samples_per_second == pytest.approx(32 * 16 / seconds)
    assert 0 < piped.cycles.efficiency < 1 and c.efficiency == 1
    assert max(piped.cycles.balance) == 1.0
    summary = piped.summary()
    assert summary["cycles"]["run"] == int(piped.cycles.run_cycles)
    assert [m["ipu"] for m in summary["memory"]] == [0, 1]
    assert math.isclose(summary["cycles"]["pipeline_efficiency"],
                        round(piped.cycles.efficiency, 4))
    # the host time and what it was computed from (bench/validation.py re-runs it)
    settings = dict(summary["host"]["settings"])
    assert settings["micro_batches"] == 16 and settings["device_iterations"] == 2
    assert settings["input_bytes"] == 32 * 256 * 4 and settings["host_processes"] == 1
    settings["output_mode"] = host_model.OutputMode(settings["output_mode"])
    again = host_model.host_time(summary["host"]["device"], summary["micro_batch"],
                                 host_model.HostSettings(**settings))
    assert again.total == pytest.approx(summary["host"]["seconds_per_call"])


def test_links_and_streaming_memory_cost_cycles():
    graph = capture(Mlp(256, 2), torch.randn(32, 256))

    def cycles(**options):
        return memory(graph, gradient_accumulation=4, **options).cycles

    base = cycles()
    # host-link transfers overlap with compute on IO tiles
    assert cycles(raw={"numIOTiles": 32}).pipeline_cycles < base.pipeline_cycles
    # off-chip optimizer state streams in and out at each weight update
    off = cycles(raw={"location_optimizer": {"onChip": 0}})
    state = sum(w.numel() for w in Mlp(256, 2).parameters()) * 8
    streamed = 2 * state / (TARGETS["ipu2"].streaming_bytes_per_s / 1.33e9)
    assert off.update_cycles == pytest.approx(base.update_cycles + streamed)
    # replicas all-reduce their gradients over the IPU-Links: GCL's two rings over 2
    # of the 10 links, both directions (64 GB/s on GC200)
    replicated = cycles(replication_factor=4)
    weights = state / 2
    reduce = 2 * 3 / 4 * weights / (320e9 / 10 * 2 / 1.33e9)
    assert replicated.update_cycles == pytest.approx(base.update_cycles + reduce)
    # a tensor crossing a stage boundary crosses the IPU-Links, forward and backward
    opts = SessionOptions(gradient_accumulation=4)
    split = cost_model.estimate(graph, opts, True, TARGETS["ipu2"], ADAM, layers_per_ipu=[1, 1])
    ipu_of = {op.name: op.ipu for op in split.costs.ops}
    crossing = [op for op in split.costs.ops
                if any(ipu_of.get(i) != op.ipu for o in split.costs.ops if op.name in o.inputs
                       for i in [o.name])]
    assert len(crossing) == 1
    one = {name: (f, b) for name, _, f, b in base.op_cycles}
    two = {name: (f, b) for name, _, f, b in split.cycles.op_cycles}
    link = crossing[0].out_bytes / (320e9 / 1.33e9)
    f1, b1 = one[crossing[0].name]
    # over 2 IPUs PopTorch recomputes by default (autoRecomputation = Pipeline): the
    # first stage's op runs its forward again in backward
    assert two[crossing[0].name] == pytest.approx((f1 + link, b1 + f1 + link))
