"""popart_compiler/cost/activation_memory.py: recomputation rules, buffer owners, stage
inputs and the stash depth of pipeline stages."""
from popart_compiler.cost.activation_memory import (RECOMPUTE_NONE, RECOMPUTE_NORM_ONLY,
                                                    RECOMPUTE_PIPELINE, RECOMPUTE_STANDARD,
                                                    kept_for_backward, owners,
                                                    recomputation_active, stage_input,
                                                    stage_memory)
from popart_compiler.cost.op_costs import OpCost
from popart_compiler.popart_enums import RecomputationType


def test_the_recomputation_constants_are_poparts_members():
    assert RECOMPUTE_PIPELINE is RecomputationType.Pipeline and RECOMPUTE_PIPELINE == 3
    assert RECOMPUTE_NONE is getattr(RecomputationType, "None")


def test_pipeline_recomputation_acts_only_in_a_pipeline_when_training():
    assert recomputation_active([], RECOMPUTE_PIPELINE, training=True, pipeline=True)
    assert not recomputation_active([], RECOMPUTE_PIPELINE, training=True, pipeline=False)
    assert recomputation_active([], RECOMPUTE_STANDARD, training=True, pipeline=False)
    assert not recomputation_active([], RECOMPUTE_STANDARD, training=False)
    assert not recomputation_active([], RECOMPUTE_NONE, training=True)


def test_what_each_recomputation_mode_keeps():
    mm = OpCost("mm", "linear", flops=10.0)
    norm = OpCost("n", "layer_norm")
    mark = OpCost("c", "relu", checkpoint=True)
    assert kept_for_backward(mm, RECOMPUTE_NONE, recomputing=False)
    assert not kept_for_backward(mm, RECOMPUTE_PIPELINE, recomputing=True)
    assert kept_for_backward(mark, RECOMPUTE_PIPELINE, recomputing=True)
    assert kept_for_backward(mm, RECOMPUTE_STANDARD, True)
    assert not kept_for_backward(norm, RECOMPUTE_STANDARD, True)
    assert kept_for_backward(mm, RECOMPUTE_NORM_ONLY, True)
    assert not kept_for_backward(norm, RECOMPUTE_NORM_ONLY, True)


def test_views_and_in_place_ops_share_their_inputs_buffer():
    ops = [OpCost("a", "mm", out_bytes=8), OpCost("v", "view", view=True, inputs=("a",)),
           OpCost("r", "relu", inplace=True, inputs=("v",)), OpCost("b", "mm", inputs=("r",))]
    assert owners(ops) == {"a": "a", "v": "a", "r": "a", "b": "b"}


def test_stage_input_counts_each_received_buffer_once():
    ops = [OpCost("b", "mm", inputs=("x", "v")), OpCost("c", "add", inputs=("a", "x"))]
    owner = {"a": "a", "v": "a"}
    total = stage_input(ops, outside=lambda n: n in ("a", "v"), user_inputs={"x": 16},
                        sizes={"a": 100}, owner=owner)
    assert total == 16 + 100


def test_earlier_pipeline_stages_stash_more_micro_batches():
    ops = [OpCost(f"op{k}", "mm", stage=k, ipu=k, out_bytes=1000, flops=1.0,
                  inputs=(f"op{k - 1}",) if k else ("x",)) for k in range(3)]
    stages = [(0, 0), (1, 1), (2, 2)]
    mem = stage_memory(ops, stages, {"x": 10}, RECOMPUTE_NONE, pipelined=True)
    # forward stage k of N = 3 holds 2 (N - 1 - k) + 1 copies; the last one stashes none
    assert [m.depth for m in mem] == [5, 3, 1]
    assert mem[0].stash == mem[0].saved * 4 and mem[2].stash == 0
    flat = stage_memory(ops, stages, {"x": 10}, RECOMPUTE_NONE, pipelined=False)
    assert [m.depth for m in flat] == [1, 1, 1]
