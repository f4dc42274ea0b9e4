"""The IPU Model's memory of pipelined and recomputed training, on small graphs with
exact byte figures (issue 21, causes 1-5): PopART's stage merging and stash sizes, a
head on IPU 0 as the last forward stage, tied weights once per IPU, the backward
working set of a recomputation segment, the combined SGD variant's one tensor."""
import pytest
import torch
import torch.nn as nn

from popart_compiler.cost import activation_memory
from popart_compiler.cost import cost_model
from popart_compiler.cost import op_costs
from popart_compiler.cost.ipu_model import TARGETS
from popart_compiler.ir import Graph
from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.session_options import SessionOptions


@torch.library.custom_op("poptorch_test_pipeline::recomputation_checkpoint",
                         mutates_args=())
def checkpoint(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


checkpoint.register_fake(lambda x: torch.empty_like(x))

ACT = 64 * 256 * 4  # one [64, 256] float32 activation
LAYER = (256 * 256 + 256) * 4  # one Linear(256, 256) in float32
ADAM = OptimizerDescription("Adam", {}, [], {})


class Placement:  # contract A: only the attributes are read
    def __init__(self, ipu, stage):
        self.ipu, self.stage = ipu, stage


class Layers(nn.Module):
    """``depth`` checkpointed layers and a scalar loss."""

    def __init__(self, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(torch.relu(layer(x)))
        return x.sum()


def capture(module, *inputs):
    return Graph(torch.export.export(module, inputs, strict=False))


def place(graph, stage_and_ipu):
    """Place the ops of layer ``i`` at ``stage_and_ipu(i)`` (the loss with the last)."""
    current = (0, 0)
    for node in graph.module.graph.nodes:
        if node.op != "call_function":
            continue
        key = op_costs._layer_key(node)
        if key:
            current = stage_and_ipu(int(key.rsplit(".", 1)[1]))
        node.meta["placement"] = Placement(current[1], current[0])
    return graph


def train(graph, accumulation=8, optimizer=ADAM, **options):
    opts = SessionOptions(gradient_accumulation=accumulation, **options)
    return cost_model.estimate(graph, opts, True, TARGETS["ipu2"], optimizer)


def test_stages_on_one_ipu_merge_as_in_popart():
    assert op_costs.merge_stages([(0, 0), (1, 0), (2, 1), (3, 0), (1, 0)]) == {
        (0, 0): 0, (1, 0): 0, (2, 1): 1, (3, 0): 2}
    assert op_costs.merge_stages([(0, 0), (1, 1), (2, 2)]) == {
        (0, 0): 0, (1, 1): 1, (2, 2): 2}


def test_one_block_per_layer_stashes_per_merged_stage():
    """The input that failed: one BeginBlock per layer under AutoIncrement made every
    layer a stage, so IPU 0 stashed for 7 stages in flight instead of 3."""
    graph = place(capture(Layers(), torch.randn(64, 256)), lambda i: (i, i // 2))
    est = train(graph)
    assert est.costs.stages == [(0, 0), (1, 1)]
    first, last = (m.categories for m in est.memory)
    # stage 0 keeps the input and layer 0's checkpoint (layer 1 reads it on IPU 0;
    # layer 1's checkpoint only crosses to IPU 1 and is not stashed) ...
    assert first["activations"] == 2 * ACT
    # ... for the 2 micro-batches in flight between its forward and its backward
    assert first["pipeline stash"] == 2 * 2 * ACT
    # the last stage runs forward and backward in one pipeline cycle: no stash; it
    # keeps what it receives, the checkpoints it reads and the scalar loss
    assert last["pipeline stash"] == 0
    assert last["activations"] == 3 * ACT + 4
    assert [s.name for s in est.cycles.stages] == [
        "forward 0 (IPU 0)", "forward+backward 1 (IPU 1)", "backward 0 (IPU 0)"]


def test_stash_depth_follows_the_stages_between_stash_and_restore():
    graph = place(capture(Layers(), torch.randn(64, 256)), lambda i: (i, i))
    stages = activation_memory.stage_memory(
        op_costs.collect(graph).ops, [(k, k) for k in range(4)], {"x": ACT},
        activation_memory.RECOMPUTE_PIPELINE, True)
    assert [s.depth for s in stages] == [7, 5, 3, 1]
    # each stage keeps what it receives (its checkpoints only cross to the next IPU)
    assert [s.saved for s in stages[:3]] == [ACT, ACT, ACT]
    assert [s.stash for s in stages] == [6 * ACT, 4 * ACT, 2 * ACT, 0]
    sharded = activation_memory.stage_memory(
        op_costs.collect(graph).ops, [(k, k) for k in range(4)], {"x": ACT},
        activation_memory.RECOMPUTE_PIPELINE, False)
    assert [s.depth for s in sharded] == [1, 1, 1, 1]


class WithHead(nn.Module):
    """Embedding-like layer on IPU 0, layers, and a head that reads IPU 0's weight."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(1000, 256))
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(2))

    def forward(self, ids):
        x = nn.functional.embedding(ids, self.table)
        for layer in self.layers:
            x = checkpoint(torch.relu(layer(x)))
        logits = x @ self.table.t()
        return nn.functional.cross_entropy(logits, ids)


def test_a_head_on_ipu_0_is_the_last_stage_and_is_not_stashed():
    graph = capture(WithHead(), torch.zeros(64, dtype=torch.int64))
    est = cost_model.estimate(graph, SessionOptions(gradient_accumulation=8), True,
                              TARGETS["ipu2"], ADAM, layers_per_ipu=[1, 1], head_ipu=0)
    assert est.costs.stages == [(0, 0), (1, 1), (2, 0)]
    stages = activation_memory.stage_memory(est.costs.ops, est.costs.stages,
                                            est.costs.user_inputs,
                                            activation_memory.RECOMPUTE_PIPELINE, True)
    head = stages[-1]
    assert (head.stage, head.ipu, head.depth, head.stash) == (2, 0, 1, 0)
    # the head keeps its outputs once: the [64, 1000] logits and the loss, plus the
    # checkpoint it receives from IPU 1 and the labels; nothing of it is recomputed
    logits, labels = 64 * 1000 * 4, 64 * 8
    assert head.saved == ACT + labels + logits + 4 and head.recomputed == frozenset()
    first = stages[0]
    assert first.depth == 5  # 2 × (3 − 1 − 0) + 1
    ipu0 = est.memory[0].categories
    assert ipu0["pipeline stash"] == first.stash
    assert ipu0["activations"] == first.saved + head.saved


def test_a_tied_weight_counts_once_per_ipu():
    graph = capture(WithHead(), torch.zeros(64, dtype=torch.int64))
    table = 1000 * 256 * 4
    one = train(graph, accumulation=2)
    weights = [w for w in one.costs.weights if w.elements == 1000 * 256]
    assert len(weights) == 1
    cat = one.memory[0].categories
    assert cat["weights"] == table + 2 * LAYER
    assert cat["optimizer state"] == 2 * (table + 2 * LAYER)  # Adam: two moments
    assert cat["gradient accumulators"] == table + 2 * LAYER
    # tied through two names (as Hugging Face ties an LM head to the embeddings)
    tied = WithHead()
    tied.decoder = nn.Linear(256, 1000, bias=False)
    tied.decoder.weight = tied.table

    def forward(ids):
        x = nn.functional.embedding(ids, tied.table)
        for layer in tied.layers:
            x = checkpoint(torch.relu(layer(x)))
        return nn.functional.cross_entropy(tied.decoder(x), ids)

    tied.forward = forward
    est = train(capture(tied, torch.zeros(64, dtype=torch.int64)), accumulation=2)
    assert est.memory[0].categories["weights"] == table + 2 * LAYER
    assert est.memory[0].categories["gradient accumulators"] == table + 2 * LAYER


def test_the_backward_working_set_counts_a_segment_once():
    """The input that failed: a recomputation segment's activations were counted twice
    (ResNet-50: 697 MB of temporaries)."""
    def op(name, out, inputs=(), checkpoint=False, inplace=False):
        return op_costs.OpCost(name=name, op="conv", out_bytes=out, in_bytes=100,
                               inputs=inputs, checkpoint=checkpoint, inplace=inplace)

    ops = [op("a", 1000, ("x",)), op("b", 3000, ("a",)), op("c", 0, ("b",), inplace=True),
           op("d", 2000, ("c",), checkpoint=True), op("e", 500, ("d",))]
    # RecomputeAll with explicit recomputation (ResNet-50's "manual" recompute mode)
    stage = activation_memory.stage_memory(ops, [(0, 0)], {"x": 100},
                                           activation_memory.RECOMPUTE_ALL, False,
                                           explicit=True)[0]
    # kept: the input and the checkpoint; recomputed: a, b (c runs in place on b)
    assert stage.saved == 100 + 2000 and stage.recomputed == {"a", "b", "c", "e"}
    # working set: the larger segment (a + b = 4000) once, plus the gradients of its
    # op with the most (b: 3000 out + 100 in)
    assert stage.working == 4000 + 3100


def test_combined_sgd_keeps_one_tensor():
    graph = capture(nn.Linear(64, 32), torch.randn(8, 64))
    elements = 64 * 32 + 32
    combined = OptimizerDescription("SGD", {"momentum": 0.9}, [], {},
                                    use_combined_accum=True)
    cat = train(graph, accumulation=4, optimizer=combined).memory[0].categories
    assert cat["optimizer state"] == elements * 4  # the velocity, in the weight's dtype
    assert cat["gradient accumulators"] == 0
    half = capture(nn.Linear(64, 32).half(), torch.randn(8, 64).half())
    cat = train(half, accumulation=4, optimizer=combined).memory[0].categories
    assert cat["optimizer state"] == elements * 2 and cat["gradient accumulators"] == 0
    separate = OptimizerDescription("SGD", {"momentum": 0.9}, [], {})
    cat = train(graph, accumulation=4, optimizer=separate).memory[0].categories
    assert cat["optimizer state"] == elements * 4  # velocity
    assert cat["gradient accumulators"] == elements * 4  # and a float32 accumulator


def test_ops_without_a_trainable_input_have_no_backward():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 256)

        def forward(self, x, mask):
            scale = (1.0 - mask) * -10000.0  # depends on inputs only
            return (self.fc(x) + scale).sum()

    graph = capture(Masked(), torch.randn(64, 256), torch.randn(64, 256))
    est = train(graph, accumulation=1)
    ops = {op.op: op for op in est.costs.ops}
    assert not ops["rsub"].requires_grad and not ops["mul"].saved
    assert ops["linear"].requires_grad and ops["add"].requires_grad
    cycles = {name: bwd for name, _, _, bwd in est.cycles.op_cycles}
    assert cycles[ops["rsub"].name] == 0 and cycles[ops["mul"].name] == 0
    # the linear's input is a user input: no gradient product for it, only dW
    linear = ops["linear"]
    assert [p.grad_rows for p in linear.products] == [False]
    assert [p.grad_cols for p in linear.products] == [True]


@pytest.mark.parametrize("accumulation", [4, 16])
def test_pipeline_cycles_use_the_merged_stages(accumulation):
    graph = place(capture(Layers(), torch.randn(64, 256)), lambda i: (i, i // 2))
    est = train(graph, accumulation=accumulation)
    schedule = est.cycles.schedule
    assert sum(c.repeat for c in schedule) == accumulation + 3 - 1
