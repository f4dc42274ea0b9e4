"""Multi-IPU execution: placement from block annotations, execution strategies and
their rules (docs/api-sections.md api §9; docs/semantics.md S-60, S-63, S-64, S-65)."""
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from popart_compiler.passes.placement import Placement


class Chain(nn.Module):
    """``n`` linear + ReLU layers, with a cross-entropy loss when a target is given."""

    def __init__(self, n=4, width=6):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(n)])

    def forward(self, x, t=None):
        for layer in self.layers:
            x = torch.relu(layer(x))
        if t is None:
            return x
        return x, F.cross_entropy(x, t)


def annotate(model, ipus, names=None):
    for i, (layer, ipu) in enumerate(zip(model.layers, ipus)):
        poptorch.BeginBlock(layer, names[i] if names else f"b{i}", ipu_id=ipu)
    return model


def options(accumulation=1, iterations=1, replicas=1, strategy=None):
    opts = poptorch.Options().deviceIterations(iterations).replicationFactor(replicas)
    opts.Training.gradientAccumulation(accumulation)
    if strategy is not None:
        opts.setExecutionStrategy(strategy)
    return opts


def compiled_inference(model, opts, rows=None):
    wrapper = poptorch.inferenceModel(model, opts)
    factor = opts.device_iterations * opts.replication_factor
    wrapper.compile(torch.randn(rows or 2 * factor, 6))
    return wrapper


def compiled_training(model, opts):
    wrapper = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    n = 2 * opts.device_iterations * opts.replication_factor * \
        opts.Training.gradient_accumulation
    wrapper.compile(torch.randn(n, 6), torch.randint(0, 6, (n,)))
    return wrapper


def layer_placements(wrapper):
    """Placement of each layer's linear op, in layer order."""
    found = {}
    for node in wrapper._state.executable.module.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        if node.op == "call_function" and "linear" in str(node.target) and stack:
            path = list(stack.values())[-1][0]
            found[path] = node.meta["placement"]
    return [found[k] for k in sorted(found)]


# -- placement (docs/semantics.md S-60)
# ----------------------------------------------------------------------

def test_without_annotations_everything_is_on_ipu_0():
    wrapper = compiled_inference(Chain(), options(replicas=2))
    exe = wrapper._state.executable
    assert all(n.meta["placement"] == Placement(0, 0, 0) for n in exe.module.graph.nodes)
    assert exe.num_ipus == 2
    assert not exe.staged


def test_begin_block_places_every_node_and_counts_ipus():
    wrapper = compiled_inference(annotate(Chain(), [0, 1, 2, 3]),
                                 options(iterations=4, replicas=2))
    exe = wrapper._state.executable
    assert layer_placements(wrapper) == [Placement(i, i, 0) for i in range(4)]
    assert all("placement" in n.meta for n in exe.module.graph.nodes)
    # docs/semantics.md S-64: 4 IPUs per replica × 2 replicas.
    assert exe.num_ipus == 8 and wrapper._state.compiled.device.num_ipus == 8


def test_ops_before_the_first_block_go_to_ipu_0():
    class Model(Chain):
        def forward(self, x):
            x = x * 2  # before any block
            with poptorch.Block("a", ipu_id=1):
                x = self.layers[0](x)
            with poptorch.Block("b", ipu_id=2):
                return self.layers[1](x)

    wrapper = compiled_inference(Model(2), options(iterations=3))
    ops = [n for n in wrapper._state.executable.module.graph.nodes if n.op == "call_function"]
    assert ops[0].meta["placement"] == Placement(0, 0, 0)
    assert layer_placements(wrapper) == [Placement(1, 1, 0), Placement(2, 2, 0)]
    assert wrapper._state.executable.num_ipus == 3  # highest ipu_id + 1


def test_no_active_block_after_a_block_scope():
    class Model(Chain):
        def forward(self, x):
            with poptorch.Block("a", ipu_id=0):
                x = self.layers[0](x)
            return x * 2

    with pytest.raises(poptorch.Error, match="No active Block, all the ops must belong "
                       "to a Block"):
        compiled_inference(Model(1), options())


def test_block_start_auto_ids_and_block_function():
    class Model(Chain):
        def forward(self, x):
            poptorch.Block.useAutoId()
            poptorch.Block.start(ipu_id=0)
            x = self.layers[0](x)
            x = self.second(x)
            with poptorch.Block(ipu_id=2):
                return self.layers[2](x)

        @poptorch.BlockFunction(ipu_id=1)
        def second(self, x):
            return self.layers[1](x)

    wrapper = compiled_inference(Model(3), options(iterations=3))
    assert list(wrapper._state.executable.graph.blocks) == ["0", "1", "2"]
    assert layer_placements(wrapper) == [Placement(i, i, 0) for i in range(3)]


def test_remove_blocks_puts_everything_back_on_one_ipu():
    model = annotate(Chain(), [0, 1, 2, 3])
    poptorch.removeBlocks(model)
    wrapper = compiled_inference(model, options())
    assert layer_placements(wrapper) == [Placement()] * 4
    assert wrapper._state.executable.num_ipus == 1


def test_explicit_stages_and_stage_ipu_override():
    strategy = poptorch.PipelinedExecution(poptorch.Stage("b0", "b1"),
                                           poptorch.Stage("b2", "b3").ipu(3))
    wrapper = compiled_inference(annotate(Chain(), [0, 0, 1, 1]),
                                 options(iterations=2, strategy=strategy))
    assert layer_placements(wrapper) == [Placement(0, 0), Placement(0, 0),
                                         Placement(3, 1), Placement(3, 1)]
    assert wrapper._state.executable.num_ipus == 4  # highest IPU + 1


def test_auto_increment_and_revisiting_an_ipu():
    """docs/semantics.md S-60 example: IPUs 0, 1, 0 give stages 0, 1, 2 with AutoIncrement;
    returning to
    IPU 0 is a change (docs/semantics.md S-63): F = 3, so training needs gradientAccumulation ≥
        5."""
    strategy = poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)
    model = annotate(Chain(3), [0, 1, 0])
    with pytest.raises(poptorch.Error, match=r"number of pipeline stages \(5\)"):
        compiled_training(model, options(accumulation=4, strategy=strategy))
    wrapper = compiled_training(annotate(Chain(3), [0, 1, 0]),
                                options(accumulation=5, strategy=strategy))
    assert layer_placements(wrapper) == [Placement(0, 0), Placement(1, 1), Placement(0, 2)]
    assert wrapper._state.executable.placement.forward_stages == 3
    assert wrapper._state.executable.num_ipus == 2


def test_same_as_ipu_returning_to_an_earlier_ipu_breaks_stage_ordering():
    with pytest.raises(poptorch.Error, match="Pipeline stage ordering.*AutoIncrement"):
        compiled_inference(annotate(Chain(3), [0, 1, 0]), options(iterations=3))
    # ShardedExecution has no ordering constraint.
    wrapper = compiled_inference(annotate(Chain(3), [0, 1, 0]),
                                 options(strategy=poptorch.ShardedExecution()))
    assert layer_placements(wrapper) == [Placement(0, 0), Placement(1, 1), Placement(0, 0)]


def test_same_as_ipu_needs_an_ipu():
    model = Chain(2)
    poptorch.BeginBlock(model.layers[0], "first")
    with pytest.raises(AssertionError, match="SameAsIpu was selected but no IPU was "
                       "specified for block first"):
        compiled_inference(model, options())


def test_unknown_block():
    strategy = poptorch.PipelinedExecution("b0", "b1")
    with pytest.raises(AssertionError, match=r"Unknown Block 'b2' list of expected "
                       r"Blocks: \['b0', 'b1'\]"):
        compiled_inference(annotate(Chain(3), [0, 1, 2]), options(strategy=strategy))


# -- pipelining constraints (docs/semantics.md S-63)
# -------------------------------------------------------------

@pytest.mark.parametrize("accumulation", [4, 5])
def test_pipelined_training_needs_enough_gradient_accumulation(accumulation):
    with pytest.raises(poptorch.Error, match=r"poptorch.Options\(\).Training."
                       r"gradientAccumulation must be greater than or equal to the "
                       r"number of pipeline stages \(7\)") as info:
        compiled_training(annotate(Chain(), [0, 1, 2, 3]), options(accumulation))
    # PopTorch's wording (issue 22), then the value set
    assert ("Please note that a model with 4 pipeline stages in PopTorch will have an "
            "additional 3 stages when training. Currently it is set to "
            f"{accumulation}.") in str(info.value)


def test_pipelined_inference_needs_enough_device_iterations():
    with pytest.raises(poptorch.Error, match=r"poptorch.Options\(\).deviceIterations must "
                       r"be greater than or equal to the number of pipeline stages \(4\)"):
        compiled_inference(annotate(Chain(), [0, 1, 2, 3]), options(iterations=2))
    compiled_inference(annotate(Chain(), [0, 1, 2, 3]), options(iterations=4))
    compiled_inference(annotate(Chain(), [0, 1, 2, 3]),
                       options(iterations=2, strategy=poptorch.ShardedExecution()))


# -- IPU count (docs/semantics.md S-64)
# ------------------------------------------------------------------------

def test_too_many_ipus_names_the_block():
    with pytest.raises(poptorch.Error, match=r"Too many IPUs requested \(82\).*block 'b1' "
                       r"is on IPU 40"):
        compiled_inference(annotate(Chain(2), [0, 40]),
                           options(iterations=2, replicas=2))


def test_power_of_two_applies_to_hardware_targets_only(poptorch_logs):
    model = annotate(Chain(3), [0, 1, 2])
    compiled_inference(model, options(iterations=3))  # IPU Model: 3 IPUs are fine
    opts = options(iterations=3).useIpuModel(False)
    with pytest.raises(poptorch.Error, match=r"requests 3 IPUs.*must reserve a power of "
                       r"2.*at least 4 IPUs.*autoRoundNumIPUs\(True\)"):
        compiled_inference(annotate(Chain(3), [0, 1, 2]), opts)
    opts = options(iterations=3).useIpuModel(False).autoRoundNumIPUs(True)
    with pytest.raises(poptorch.Error, match=r"Failed to acquire 4 IPU\(s\)"):
        compiled_inference(annotate(Chain(3), [0, 1, 2]), opts)
    assert "reserving 4, the next power of 2" in poptorch_logs.text


def test_offline_target_rounds_the_ipu_count():
    opts = options(iterations=3).useOfflineIpuTarget()
    with pytest.raises(poptorch.Error, match="must reserve a power of 2"):
        compiled_inference(annotate(Chain(3), [0, 1, 2]), opts)
    compiled_inference(annotate(Chain(3), [0, 1, 2]), opts.clone().autoRoundNumIPUs())


# -- optimum-style misconfigurations ----------------------------------------------------------

def test_block_id_used_on_two_ipus():
    with pytest.raises(poptorch.Error, match="Block 'enc' is started on IPU 0 and again "
                       "on IPU 1.*own user_id"):
        compiled_inference(annotate(Chain(2), [0, 1], names=["enc", "enc"]),
                           options(iterations=2))


def test_strategy_listing_blocks_the_model_never_starts():
    """A layers-per-IPU list longer than the model."""
    strategy = poptorch.PipelinedExecution(["layer0", "layer1"], ["layer2", "layer3"])
    with pytest.raises(poptorch.Error, match=r"Block\(s\) \['layer3'\] listed in "
                       r"PipelinedExecution are never started.*layers per IPU"):
        compiled_inference(annotate(Chain(3), [0, 0, 1], names=["layer0", "layer1",
                                                                "layer2"]),
                           options(iterations=2, strategy=strategy))


@pytest.mark.parametrize("ipu", [-1, "1"])
def test_invalid_ipu_id_names_the_block(ipu):
    model = Chain(2)
    poptorch.BeginBlock(model.layers[1], "head", ipu_id=ipu)
    with pytest.raises(poptorch.Error, match="Block 'head' has ipu_id=.*non-negative "
                       "integer"):
        compiled_inference(model, options(iterations=2))


# -- phased execution (docs/semantics.md S-65)
# --------------------------------------------------------------------

def parallel_phases(second_ipus):
    strategy = poptorch.ParallelPhasedExecution(
        poptorch.Phase(poptorch.Stage("b0"), poptorch.Stage("b1")),
        poptorch.Phase(poptorch.Stage("b2"), poptorch.Stage("b3")))
    strategy.phase(0).ipus(0, 2)
    strategy.phase(1).ipus(*second_ipus)
    return strategy


def test_parallel_phased_parity():
    wrapper = compiled_inference(annotate(Chain(), [0, 0, 0, 0]),
                                 options(strategy=parallel_phases((1, 3))))
    assert layer_placements(wrapper) == [Placement(0, 0, 0), Placement(2, 1, 0),
                                         Placement(1, 2, 1), Placement(3, 3, 1)]
    assert wrapper._state.executable.num_ipus == 4
    with pytest.raises(poptorch.Error, match="When phases are executed in parallel: even "
                       "phases must run on even IPUs and odd phases on odd IPUs"):
        compiled_inference(annotate(Chain(), [0, 0, 0, 0]),
                           options(strategy=parallel_phases((0, 2))))


def test_serial_phased_backward_phases_mirror_forward():
    strategy = poptorch.SerialPhasedExecution(["b0"], ["b1"], ["b2"])
    wrapper = compiled_training(annotate(Chain(3), [0, 1, 0]),
                                options(strategy=strategy))
    plan = wrapper._state.executable.placement
    assert [p.phase for p in layer_placements(wrapper)] == [0, 1, 2]
    assert [plan.backward(Placement(0, 0, p)).phase for p in range(3)] == [4, 3, 2]
    strategy.useSeparateBackwardPhase()
    assert [plan.backward(Placement(0, 0, p)).phase for p in range(3)] == [4, 3, 2]
    joint = wrapper._state.executable.joint_graph()
    phases = {n.meta["placement"].phase for n in joint.graph.nodes
              if n.meta.get("ipu_backward")}
    assert phases == {2, 3, 4}


# -- the placement table ----------------------------------------------------------------------

def test_placement_summary_table_and_debug_log(poptorch_logs):
    wrapper = compiled_training(annotate(Chain(2), [0, 1]), options(accumulation=3))
    text = wrapper.placementSummary()
    lines = text.splitlines()
    assert lines[0] == "Placement (Pipelined, 2 IPU(s) per replica, 3 stage(s))"
    assert lines[1].split() == ["IPU", "stage", "phase", "fwd", "ops", "bwd", "ops",
                                "params", "param", "bytes"]
    rows = {tuple(int(v) for v in line.split()[:3]): [int(v) for v in line.split()[3:]]
            for line in lines[2:]}
    # Forward: linear + relu on each IPU, the loss on IPU 1; each layer's weight and
    # bias (2 × (36 + 6) floats) are updated in their backward stage.
    assert rows[(0, 0, 0)][0] == 2 and rows[(1, 1, 0)][0] >= 3
    assert rows[(0, 2, 0)][2:] == [2, 168] and rows[(1, 1, 0)][2:] == [2, 168]
    assert rows[(0, 2, 0)][1] > 0 and rows[(1, 1, 0)][1] > 0  # backward ops
    assert "Placement (Pipelined, 2 IPU(s) per replica, 3 stage(s))" in poptorch_logs.text
    assert wrapper.placementSummary(backward=False).splitlines()[3].split()[4] == "-"


def test_placement_summary_needs_a_compiled_model():
    wrapper = poptorch.inferenceModel(Chain())
    with pytest.raises(poptorch.Error):
        wrapper.placementSummary()


def test_block_started_inside_an_annotate_scope_outlives_it():
    """A nested ``torch.fx.traceback.annotate`` scope restores the metadata it found
    when it exits; the block started inside it stays active (BeginBlock never ends
    implicitly, docs/semantics.md S-60)."""
    class Model(Chain):
        def forward(self, x):
            with torch.fx.traceback.annotate({"name_scope": "enc"}):
                x = self.layers[0](x)  # BeginBlock "b0" starts here
            return self.layers[1](x * 2)  # still in block "b0"... until "b1" starts

    model = Model(2)
    poptorch.BeginBlock(model.layers[0], "b0", ipu_id=1)
    poptorch.BeginBlock(model.layers[1], "b1", ipu_id=2)
    wrapper = compiled_inference(model, options(iterations=3))
    mul = next(n for n in wrapper._state.executable.module.graph.nodes if "mul" in str(n.target))
    assert mul.meta["placement"] == Placement(1, 1, 0)
    assert layer_placements(wrapper) == [Placement(1, 1, 0), Placement(2, 2, 0)]


def test_phase_and_stage_indices_beyond_the_strategy():
    strategy = poptorch.SerialPhasedExecution(["b0"], ["b1"])
    with pytest.raises(poptorch.Error, match="Phase 2 does not exist: SerialPhasedExecution "
                       r"has 2 phase\(s\)"):
        strategy.phase(2)
    with pytest.raises(poptorch.Error, match=r"Stage 1 does not exist: this phase has 1 "
                       r"stage\(s\)"):
        strategy.phase(0).stage(1)


class PoolByIds(nn.Module):
    """CLIP's text pooling: after the last block, an argmax over the user's ids (the
    ids converted with ``.to``, which the tracer checks with an assert carrying the
    metadata of the ids' view, made before the first block) picks each row's output."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6)
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        poptorch.BeginBlock(self.layers[1], "last", ipu_id=1)

    def forward(self, ids):
        flat = ids.view(-1, ids.shape[-1])
        x = self.layers[1](torch.relu(self.layers[0](self.emb(flat))))
        pick = flat.to(dtype=torch.int32).argmax(dim=-1)
        return x[torch.arange(x.shape[0]), pick]


def test_op_after_the_last_block_reading_only_inputs_stays_in_that_block():
    """PopTorch's rule: an op belongs to the block in force when it runs. The argmax
    over the ids (and the tracer's check of their conversion) run after the last
    BeginBlock: IPU 1, so the pipeline has 2 stages (not 4: IPU 0, 1, 0, 1)."""
    torch.manual_seed(0)
    model = PoolByIds()
    reference = copy.deepcopy(model)
    wrapper = poptorch.inferenceModel(model, options(
        iterations=2, strategy=poptorch.PipelinedExecution()))
    ids = torch.randint(0, 20, (4, 5))
    torch.testing.assert_close(wrapper(ids), reference(ids))
    exe = wrapper._state.executable
    ops = [n for n in exe.module.graph.nodes if n.op == "call_function"]
    last = max(i for i, n in enumerate(ops) if "linear" in str(n.target))
    assert all(n.meta["placement"] == Placement(1, 1, 0) for n in ops[last:])
    assert any("_assert" in str(n.target) for n in ops[last:])
    assert wrapper._state.executable.placement.forward_stages == 2
