"""Ops that steer the IPU compiler (docs/api-sections.md api §8.8–§8.11, docs/semantics.md S-66):
recomputationCheckpoint, serializedMatMul, set_available_memory, set_overlap_for_input/output, and
capture from a torch.fx GraphModule."""
import copy

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import poptorch

MODES = list(poptorch.MatMulSerializationMode)


def quiet(opts=None):
    return (opts or poptorch.Options()).showCompilationProgressBar(False)


def targets_of(executor, prefix):
    module = executor._state.executable.graph.module
    return [n for n in module.graph.nodes if str(n.target).startswith(prefix)]


class SerializedLinear(nn.Linear):
    def __init__(self, n_in, n_out, mode, factor):
        super().__init__(n_in, n_out)
        self.mode, self.factor = mode, factor

    def forward(self, x):
        return poptorch.serializedMatMul(x, self.weight.t(), self.mode, self.factor) + \
            self.bias


class WithLoss(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, target):
        out = self.layer(x)
        return out, F.mse_loss(out, target)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("factor", [4])
def test_serialized_linear_inference_and_sgd_step_equal_nn_linear(mode, factor):
    torch.manual_seed(1)
    layer = SerializedLinear(16, 32, mode, factor)
    plain = nn.Linear(16, 32)
    plain.load_state_dict(layer.state_dict())
    x, target = torch.randn(8, 16), torch.randn(8, 32)

    inference = poptorch.inferenceModel(layer, quiet())
    torch.testing.assert_close(inference(x), plain(x))
    assert [str(n.args[2]) for n in targets_of(inference, "poptorch.serialized_matmul")] \
        == [mode.name]

    model, ref = WithLoss(copy.deepcopy(layer)), WithLoss(plain)
    training = poptorch.trainingModel(model, quiet(), torch.optim.SGD(model.parameters(),
                                                                      lr=0.1))
    out, loss = training(x, target)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_out, ref_loss = ref(x, target)
    ref_loss.backward()
    ref_opt.step()
    torch.testing.assert_close(loss, ref_loss.detach())
    training.copyWeightsToHost()
    torch.testing.assert_close(model.layer.weight.detach(), ref.layer.weight.detach())
    torch.testing.assert_close(model.layer.bias.detach(), ref.layer.bias.detach())


@pytest.mark.parametrize("mode", MODES)
def test_serialized_matmul_batched_and_half_keep_precision(mode):
    class Model(nn.Module):
        def forward(self, a, b):
            return poptorch.serializedMatMul(a, b, mode, 2, keep_precision=True)
    a, b = torch.randn(3, 4, 6), torch.randn(6, 8)
    executor = poptorch.inferenceModel(Model(), quiet(poptorch.Options().deviceIterations(3)))
    torch.testing.assert_close(executor(a, b.expand(3, 6, 8).reshape(18, 8)),
                               torch.matmul(a, b), rtol=1e-5, atol=1e-5)
    assert executor._state.executable.vectorized is not None  # the op has a batching rule
    half = poptorch.inferenceModel(Model(), quiet())
    torch.testing.assert_close(half(a[:1].half(), b.half()),
                               torch.matmul(a[:1], b).half(), rtol=1e-2, atol=1e-2)


def test_serialized_matmul_errors_and_cpu_behaviour():
    a, b = torch.randn(4, 6), torch.randn(6, 8)
    mode = poptorch.MatMulSerializationMode.OutputChannels
    torch.testing.assert_close(poptorch.serializedMatMul(a, b, mode, 3), a @ b)
    with pytest.raises(AssertionError):
        poptorch.serializedMatMul(a, b, "OutputChannels", 2)
    with pytest.raises(AssertionError):
        poptorch.serializedMatMul(a, b, mode, 2.0)
    with pytest.raises(AssertionError):
        poptorch.serializedMatMul(a, b, mode, 2, keep_precision=1)

    class Model(nn.Module):
        def forward(self, a, b):
            return poptorch.serializedMatMul(a, b, mode, 3)
    with pytest.raises(poptorch.Error, match="factor 3 does not divide columns of rhs"):
        poptorch.inferenceModel(Model(), quiet())(a, b)


def test_recomputation_checkpoint_forms_and_errors():
    x, y = torch.ones(2), torch.zeros(2)
    assert poptorch.recomputationCheckpoint(x) is x
    assert poptorch.recomputationCheckpoint(x, y) == (x, y)
    out = poptorch.recomputationCheckpoint([x, y])
    assert isinstance(out, list) and out[0] is x
    with pytest.raises(ValueError, match="All inputs must be tensors"):
        poptorch.recomputationCheckpoint(x, 3)

    class Model(nn.Module):
        def forward(self, a, b):
            c, d = poptorch.recomputationCheckpoint((a * 2, b + 1))
            return poptorch.recomputationCheckpoint(c + d)
    executor = poptorch.inferenceModel(Model(), quiet())
    torch.testing.assert_close(executor(x, y), x * 2 + y + 1)
    assert len(targets_of(executor, "poptorch.recomputation_checkpoint")) == 3
    assert "RecomputationCheckpoint:0" in executor._debugGetPopartIR()


def test_fx_pass_inserts_checkpoints_trained_with_accumulation_and_blocks():
    torch.manual_seed(2)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)]
    net = nn.Sequential(*blocks)
    ref = copy.deepcopy(net)

    class BlockTracer(torch.fx.Tracer):  # each Linear/ReLU block is one call_module
        def is_leaf_module(self, module, name):
            return name in ("0", "1", "2", "3") or super().is_leaf_module(module, name)
    gm = torch.fx.GraphModule(net, BlockTracer().trace(net))
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target in ("0", "1", "2", "3"):
            with gm.graph.inserting_after(node):
                check = gm.graph.call_function(poptorch.recomputationCheckpoint, (node,))
            node.replace_all_uses_with(check)
            check.args = (node,)
    gm.recompile()

    class Train(nn.Module):
        def __init__(self, body):
            super().__init__()
            self.body = body

        def forward(self, x, t):
            return F.mse_loss(self.body(x), t)

    model = Train(gm)
    poptorch.BeginBlock(gm.get_submodule("0"), "first", ipu_id=0)
    poptorch.BeginBlock(gm.get_submodule("2"), "second", ipu_id=1)
    opts = quiet()
    opts.Training.gradientAccumulation(8)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(),
                                                                   lr=0.05))
    x, t = torch.randn(16, 8), torch.randn(16, 8)
    training(x, t)
    assert len(targets_of(training, "poptorch.recomputation_checkpoint")) == 4

    optimizer = torch.optim.SGD(ref.parameters(), lr=0.05)
    for k in range(8):
        (F.mse_loss(ref(x[2 * k:2 * k + 2]), t[2 * k:2 * k + 2]) / 8).backward()
    optimizer.step()
    training.copyWeightsToHost()
    for p, q in zip(model.body.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())


def test_symbolic_trace_of_forward_calling_ops_records_them():
    class Model(nn.Module):
        def forward(self, x):
            y = poptorch.set_available_memory(x * 2, 0.4)
            return poptorch.recomputationCheckpoint(poptorch.nop(y))
    gm = torch.fx.symbolic_trace(Model())
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "poptorch.set_available_memory.default" in names
    assert "poptorch.nop.default" in names
    executor = poptorch.inferenceModel(gm, quiet())
    torch.testing.assert_close(executor(torch.ones(3)), torch.full((3,), 2.0))


def test_set_available_memory_recorded_on_producer_and_errors():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return poptorch.set_available_memory(self.fc(x), 0.25)
    model = Model()
    x = torch.randn(2, 4)
    assert torch.equal(model(x), model.fc(x))
    executor = poptorch.inferenceModel(model, quiet())
    torch.testing.assert_close(executor(x), model.fc(x))
    marker, = targets_of(executor, "poptorch.set_available_memory")
    assert marker.args[1] == 0.25
    assert marker.args[0].meta["available_memory_proportion"] == 0.25
    assert "SetAvailableMemory:0" in executor._debugGetPopartIR()
    assert "{'available_memory_proportion': 0.25}" in executor._debugGetPopartIR()
    with pytest.raises(poptorch.Error, match="only set available memory for torch.tensor"):
        poptorch.set_available_memory(3.0, 0.5)

    class Bad(nn.Module):
        def forward(self, x):
            return poptorch.set_available_memory(x + 1, 1.5)
    with pytest.raises(poptorch.Error, match=r"must be in \[0, 1\], got 1.5"):
        poptorch.inferenceModel(Bad(), quiet())(x)


class Overlapped(nn.Module):
    def __init__(self, use_input_twice=False, return_twice=False, mark_internal=False):
        super().__init__()
        self.twice, self.ret2, self.internal = use_input_twice, return_twice, mark_internal

    def forward(self, x):
        mode = poptorch.OverlapMode.OverlapAccumulationLoop
        y = poptorch.set_overlap_for_input(x, mode)
        if self.twice:
            y = y + x
        if self.internal:
            poptorch.set_overlap_for_input(y * 2, mode)
        out = poptorch.set_overlap_for_output({"a": y * 3, "n": 5}, mode)
        if self.ret2:
            return out["a"], out["a"]
        return out["a"]


def overlap_options(strategy=True, tiles=True, mode=poptorch.OutputMode.All):
    opts = quiet()
    if strategy:
        opts.setExecutionStrategy(poptorch.ShardedExecution())
    if tiles:
        opts.TensorLocations.numIOTiles(32)
    return opts.outputMode(mode)


def test_overlap_markers_valid_use_and_structure():
    x = torch.randn(2, 3)
    executor = poptorch.inferenceModel(Overlapped(), overlap_options())
    torch.testing.assert_close(executor(x), x * 3)
    assert len(targets_of(executor, "poptorch.set_overlap_for")) == 2
    marked = poptorch.set_overlap_for_output((x, [x, "s"]), poptorch.OverlapMode.NoOverlap)
    assert marked[0] is x and marked[1][1] == "s"
    with pytest.raises(poptorch.Error, match="must be a poptorch.OverlapMode"):
        poptorch.set_overlap_for_input(x, "no_overlap")


@pytest.mark.parametrize("model,opts,message", [
    (Overlapped(), dict(strategy=False), "not supported with poptorch.PipelinedExecution"),
    (Overlapped(), dict(tiles=False), "No IO tiles allocated"),
    (Overlapped(), dict(mode=poptorch.OutputMode.Final), "Unsupported output mode"),
    (Overlapped(use_input_twice=True), {}, "must be the only op applied to an input"),
    (Overlapped(mark_internal=True), {}, "not a tensor input to the model"),
    (Overlapped(return_twice=True), {}, "returned twice"),
])
def test_overlap_rules_of_s66(model, opts, message):
    with pytest.raises(poptorch.Error, match=message):
        poptorch.inferenceModel(model, overlap_options(**opts))(torch.randn(2, 3))


def test_overlap_output_marker_must_be_returned():
    class Model(nn.Module):
        def forward(self, x):
            y = poptorch.set_overlap_for_output(x * 2,
                                                poptorch.OverlapMode.OverlapDeviceIterationLoop)
            return y + 1
    with pytest.raises(poptorch.Error, match="not a tensor output to the model"):
        poptorch.inferenceModel(Model(), overlap_options())(torch.randn(2, 3))
