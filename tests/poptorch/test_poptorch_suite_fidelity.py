"""Behaviours and wordings that PopTorch's own test suite checks (issue 22 §2), each
with the case that failed here before: error texts PopTorch users match, static-shape
bincount, MultiConv checks, optimizer constness, RMSprop state names, phased blocks on
several IPUs, pickled executors."""
import io
import pickle

import pytest
import torch
import torch.nn.functional as F

import poptorch


def _run(forward, *inputs, options=None):
    model = type("Model", (torch.nn.Module,), {"forward": lambda self, *a: forward(*a)})()
    return poptorch.inferenceModel(model, options)(*inputs)


# -- wordings ---------------------------------------------------------------------------

@pytest.mark.parametrize("end, message", [
    (lambda s: s, r"The start and end of a slice must be different\."),
    (lambda s: s - 2, r"Taking a slice of a tensor with the end less than the start is not "
                      r"supported\."),
    (lambda s: s + 7, r"The size of the slice \(7\) must be a factor of the slicing "
                      r"dimension \(8\)\."),
    (lambda s: s * 2, r"The size of the sliced tensor must be a constant for each execution "
                      r"of the model when running on the IPU\."),
])
def test_run_time_slice_errors_read_as_poptorchs(end, message):
    with pytest.raises(poptorch.Error, match=message):
        _run(lambda x, s: x[s:end(s)] * 1, torch.arange(8.0), torch.tensor([5]))


def test_dynamic_slice_size_must_divide_the_dimension():
    with pytest.raises(poptorch.Error, match=r"size of the slice \(3\) must be a factor"):
        _run(lambda x, s: poptorch.dynamic_slice(x, 0, s, 3, 1), torch.arange(8.0),
             torch.tensor([2]))
    out = _run(lambda x, s: poptorch.dynamic_slice(x, 0, s, 4, 1), torch.arange(8.0),
               torch.tensor([6]))
    assert out.tolist() == [6.0, 7.0, 0.0, 1.0]  # a dividing size wraps (docs/semantics.md S-102)


def test_dynamic_update_dimension_and_dtype_errors():
    start = torch.tensor([1])
    with pytest.raises(poptorch.Error, match=r"input and src tensors must have same "
                                             r"dimensionality\. \(2\) vs \(1\)"):
        _run(lambda t, s: poptorch.dynamic_update(t, s, 0, start, 1), torch.ones(2, 8),
             torch.ones(8))
    with pytest.raises(poptorch.Error, match=r"input and src tensor must have same dtype\. "
                                             r"\(torch\.float32 vs torch\.int32\)"):
        _run(lambda t, s: poptorch.dynamic_update(t, s, 0, start, 1), torch.ones(8),
             torch.tensor([-1]))


def test_dict_input_keys_are_named_as_poptorch_does():
    model = poptorch.inferenceModel(type("D", (torch.nn.Module,), {
        "forward": lambda self, z: z["x"] + z["y"]})())
    assert model({"x": torch.tensor([1.0]), "y": torch.tensor([2.0])}).tolist() == [3.0]
    with pytest.raises(poptorch.Error, match=r"Missing arguments: x\."):
        model({"y": torch.tensor([2.0])})
    with pytest.raises(poptorch.Error, match=r"Unexpected arguments: z\."):
        model({"x": torch.tensor([1.0]), "y": torch.tensor([2.0]), "z": torch.tensor([3.0])})


def test_two_independent_losses_read_as_poptorchs():
    class TwoLosses(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            out = F.log_softmax(self.fc(x), dim=1)
            return F.nll_loss(out, y) + F.nll_loss(out, y) * 5.0

    with pytest.raises(poptorch.Error, match=r"Multiple independent losses found in graph\. "
                                             r"Graph must have one final loss\. Wrap final "
                                             r"graph loss in poptorch\.identity_loss\."):
        poptorch.trainingModel(TwoLosses())(torch.randn(2, 4), torch.tensor([0, 1]))


def test_pipelined_stage_count_messages_read_as_poptorchs():
    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = poptorch.BeginBlock(torch.nn.Linear(2, 2), ipu_id=0)
            self.b = poptorch.BeginBlock(torch.nn.Linear(2, 2), ipu_id=1)

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(poptorch.Error, match=r"poptorch\.Options\(\)\.deviceIterations must "
                                             r"be greater than or equal to the number of "
                                             r"pipeline stages \(2\) when using "
                                             r"PopTorch\.PipelinedExecution\."):
        poptorch.inferenceModel(Chain())(torch.randn(1, 2))

    class Loss(Chain):
        def forward(self, x):
            return poptorch.identity_loss(super().forward(x).sum(), "none")

    with pytest.raises(poptorch.Error, match=r"poptorch\.Options\(\)\.Training\."
                                             r"gradientAccumulation must be greater than or "
                                             r"equal to the number of pipeline stages \(3\) "
                                             r"when using poptorch\.PipelinedExecution\. "
                                             r"Please note that a model with 2 pipeline "
                                             r"stages in PopTorch will have an additional 1 "
                                             r"stages when training\."):
        poptorch.trainingModel(Loss())(torch.randn(1, 2))


class _Overlapped(torch.nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case

    def forward(self, x):
        mode = poptorch.OverlapMode.OverlapAccumulationLoop
        if self.case == "not_input":
            y = x + 1
            return y, poptorch.set_overlap_for_input(y, mode)
        if self.case == "input_twice":
            y = x + 1
            return y, poptorch.set_overlap_for_input(x, mode)
        if self.case == "not_output":
            return poptorch.set_overlap_for_output(x, mode) + 1
        y = x + 1
        return y, poptorch.set_overlap_for_output(y, mode)  # returned twice


@pytest.mark.parametrize("case, message", [
    ("not_input", r"poptorch\.set_overlap_for_input applied on a node which is not a tensor "
                  r"input to the model\."),
    ("input_twice", r"poptorch\.set_overlap_for_input must be the only op applied to an "
                    r"input\. This is not the case for input x to the model\."),
    ("not_output", r"poptorch\.set_overlap_for_output applied on a node which is not a "
                   r"tensor output to the model\."),
    ("returned_twice", r"poptorch\.set_overlap_for_output cannot be used with a tensor that "
                       r"is returned twice\."),
])
def test_overlap_markers_are_checked_first_with_poptorchs_words(case, message):
    """With default options (pipelined, no IO tiles) the marker error comes first."""
    with pytest.raises(poptorch.Error, match=message):
        poptorch.inferenceModel(_Overlapped(case))(torch.ones(1))


def test_overlap_strategy_and_io_tile_messages():
    class Normal(torch.nn.Module):
        def forward(self, x):
            return poptorch.set_overlap_for_input(
                x, poptorch.OverlapMode.OverlapAccumulationLoop) + 1

    with pytest.raises(poptorch.Error, match=r"Overlapped IO is not supported with "
                                             r"poptorch\.PipelinedExecution\. If you are "
                                             r"using only one IPU, please switch to "
                                             r"poptorch\.ShardedExecution\."):
        poptorch.inferenceModel(Normal())(torch.ones(1))
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    with pytest.raises(poptorch.Error, match=r"No IO tiles allocated\. You must allocate at "
                                             r"least 32 IO tiles using "
                                             r"poptorch\.Options\(\)\.TensorLocations\."
                                             r"numIOTiles\."):
        poptorch.inferenceModel(Normal(), opts)(torch.ones(1))


# -- ops --------------------------------------------------------------------------------

def test_one_hot_without_num_classes_and_bincount_without_minlength():
    with pytest.raises(poptorch.Error, match="OneHot num classes must be specified and must "
                                             "be constant"):
        _run(lambda x: F.one_hot(x), torch.tensor([1, 2]))
    with pytest.raises(poptorch.Error, match="torch.bincount needs minlength"):
        _run(lambda x: torch.bincount(x), torch.tensor([1, 2]))


def test_bincount_with_minlength_has_a_static_shape():
    x = torch.tensor([1, 2, 2, 4])
    assert _run(lambda x: torch.bincount(x, minlength=5), x).tolist() == [0, 1, 2, 0, 1]
    w = torch.tensor([0.5, 1.0, 2.0, 4.0])
    out = _run(lambda x, w: x.bincount(w, minlength=6), x, w)
    torch.testing.assert_close(out, torch.bincount(x, w, minlength=6))
    # values at or past minlength are not counted (the output keeps minlength bins)
    assert _run(lambda x: torch.bincount(x, minlength=3), x).tolist() == [0, 1, 2]


def test_uint8_masks_in_masked_fill_and_index_put():
    mask = torch.tensor([1, 0, 1], dtype=torch.uint8)
    assert _run(lambda x, m: x.masked_fill(m, 0.0), torch.ones(3), mask).tolist() == \
        [0.0, 1.0, 0.0]

    def index_put(x, m):
        x = x.clone()
        x[m] = 5.0
        return x
    assert _run(index_put, torch.ones(3), mask).tolist() == [5.0, 1.0, 5.0]


class _Conv(torch.nn.Module):
    def __init__(self, nested=False, empty=False):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)
        self.nested, self.empty = nested, empty

    def forward(self, x):
        with poptorch.MultiConv():
            if self.nested:
                with poptorch.MultiConv():
                    return self.conv(x)
            if self.empty:
                return torch.pow(x, 2)
            return self.conv(x)


def test_multiconv_validation():
    x = torch.ones(1, 1, 5, 5)
    with pytest.raises(poptorch.Error, match="Nested poptorch.MultiConv is not supported"):
        poptorch.inferenceModel(_Conv(nested=True))(x)
    with pytest.raises(poptorch.Error, match="Unexpected end_multi_conv"):
        poptorch.inferenceModel(_Conv(empty=True))(x)
    model = _Conv()
    torch.testing.assert_close(poptorch.inferenceModel(model)(x), model(x))
    with pytest.raises(ValueError, match="Invalid partials types"):
        poptorch.MultiConv().partialsTypes("half")
    with pytest.raises(AssertionError, match="Invalid plan type"):
        poptorch.MultiConv().planType("parallel")


def test_transformer_with_several_layers_matches_pytorch():
    torch.manual_seed(0)
    model = torch.nn.Transformer(d_model=8, nhead=2, num_encoder_layers=2,
                                 num_decoder_layers=2, dim_feedforward=16,
                                 dropout=0.0).eval()
    src, tgt = torch.randn(3, 2, 8), torch.randn(4, 2, 8)
    torch.testing.assert_close(poptorch.inferenceModel(model)(src, tgt), model(src, tgt))


# -- buffers, saving -----------------------------------------------------------------------

class _Buffered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.ones(2))

    def forward(self, x):
        return x + self.b


def test_updatable_named_buffers_refuses_a_name_that_is_not_a_buffer():
    # Refused when the model compiles, as PopTorch does.
    opts = poptorch.Options()
    opts.updatableNamedBuffers(["b", "nope"])
    executor = poptorch.inferenceModel(_Buffered(), opts)
    with pytest.raises(poptorch.Error, match=r"'nope', which is not a buffer of the model"):
        executor(torch.zeros(2))
    assert not executor.isCompiled()
    opts = poptorch.Options()
    opts.updatableNamedBuffers(["b"])
    model = _Buffered()
    executor = poptorch.inferenceModel(model, opts)
    executor(torch.zeros(2))
    model.b.fill_(3.0)
    executor.copyNamedBuffersToDevice()
    assert executor(torch.zeros(2)).tolist() == [3.0, 3.0]


class _BlockFunctions(torch.nn.Module):
    def forward(self, x):
        poptorch.Block.useAutoId()
        return self.times2(self.times4(x))

    @poptorch.BlockFunction(ipu_id=0)
    def times4(self, x):
        return x * 4

    @poptorch.BlockFunction(ipu_id=1)
    def times2(self, x):
        return x * 2


def test_torch_save_of_an_executor_with_block_functions():
    executor = poptorch.inferenceModel(_BlockFunctions(), poptorch.Options().deviceIterations(2))
    assert executor(torch.ones(2, 3)).tolist() == [[8.0] * 3] * 2
    buffer = io.BytesIO()
    torch.save(executor, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is _BlockFunctions and loaded(torch.ones(1)).tolist() == [8.0]


def test_state_dict_of_a_wrapped_model_loads_with_weights_only():
    model = _Classifier()
    training = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(
        model.parameters(), lr=0.1))
    training(torch.randn(2, 4), torch.tensor([0, 1]))  # the host copy is now stale
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert set(loaded) == {"fc.weight", "fc.bias"}
    assert all(type(v) is torch.Tensor for v in loaded.values())
    training.copyWeightsToHost()
    assert torch.equal(loaded["fc.weight"], model.fc.weight.detach())
    assert pickle.loads(pickle.dumps(model.fc.weight)).shape == (3, 4)


# -- optimizers ---------------------------------------------------------------------------

class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.fc(x)
        return out, F.cross_entropy(out, y)


_DEFAULTS = [
    (torch.optim.SGD, poptorch.optim.SGD,
     dict(momentum=0.0, dampening=0.0, weight_decay=0.0)),
    (torch.optim.Adam, poptorch.optim.Adam,
     dict(betas=(0.9, 0.999), eps=1e-08, weight_decay=0.0, amsgrad=False)),
    (torch.optim.AdamW, poptorch.optim.AdamW,
     dict(betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01, amsgrad=False)),
    (torch.optim.RMSprop, poptorch.optim.RMSprop,
     dict(momentum=0.0, alpha=0.99, eps=1e-08, weight_decay=0.0)),
]


@pytest.mark.parametrize("torch_opt, poptorch_opt, defaults", _DEFAULTS,
                         ids=[d[1].__name__ for d in _DEFAULTS])
def test_optimizers_at_default_values_replace_each_other(torch_opt, poptorch_opt, defaults):
    """A model compiled with a torch optimizer at the default values takes a default
    PopTorch optimizer (torch's own flags such as foreach used to count as changed
    constants); explicitly passed attributes are variables and may change."""
    extra = {"use_combined_accum": False} if poptorch_opt is poptorch.optim.SGD else {}
    x, y = torch.randn(2, 4), torch.tensor([0, 1])
    model = _Classifier()
    executor = poptorch.trainingModel(model, optimizer=torch_opt(model.parameters(), lr=1.0,
                                                                 **defaults))
    executor(x, y)
    executor.setOptimizer(poptorch_opt(model.parameters(), lr=1.0, **extra))
    executor(x, y)
    explicit = poptorch_opt(model.parameters(), lr=1.0, **extra, **defaults)
    for attr in defaults:
        assert not explicit.variable_attrs.isConstant(attr)
        explicit.variable_attrs.markAsConstant(attr)
    executor.setOptimizer(explicit)
    executor(x, y)

    model = _Classifier()
    executor = poptorch.trainingModel(model, optimizer=poptorch_opt(
        model.parameters(), lr=1.0, **extra, **defaults))
    executor(x, y)
    changed = {k: v + 0.5 if isinstance(v, float) else
               tuple(e / 2 for e in v) if isinstance(v, tuple) else v
               for k, v in defaults.items()}
    executor.setOptimizer(poptorch_opt(model.parameters(), lr=1.0, **extra, **changed))
    executor(x, y)


def test_variable_attributes_can_be_assigned_as_poptorch_tests_do():
    model = _Classifier()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.0)
    attrs = optimizer.variable_attrs
    attrs._variable_attributes = list(attrs._allowed_attributes)
    assert not any(attrs.isConstant(a) for a in attrs._allowed_attributes)


def test_rmsprop_state_carries_poparts_names():
    model = _Classifier()
    optimizer = poptorch.optim.RMSprop(model.parameters(), lr=0.05, weight_decay=0.025,
                                       loss_scaling=0.75, momentum=0.5, centered=True)
    executor = poptorch.trainingModel(model, optimizer=optimizer)
    executor.compile(torch.randn(2, 4), torch.tensor([0, 1]))
    state = optimizer.state_dict()
    assert {"Accl1___fc.weight", "Accl2___fc.weight", "Accl3___fc.weight"} <= \
        set(state["ipu_state"])
    torch.testing.assert_close(state["ipu_param"]["learningRate___specific___fc.bias"],
                               torch.tensor(0.05))
    torch.testing.assert_close(state["ipu_param"]["weightDecay___specific___fc.bias"],
                               torch.tensor(0.025))
    torch.testing.assert_close(state["ipu_param"]["lossScaling_FLOAT"], torch.tensor(0.75))
    before = {k: v.clone() for k, v in state["ipu_state"].items()}
    executor(torch.randn(2, 4), torch.tensor([0, 1]))
    after = optimizer.state_dict()["ipu_state"]
    assert not torch.equal(before["Accl1___fc.weight"], after["Accl1___fc.weight"])


# -- phased execution ----------------------------------------------------------------------

class _TwoByTwoPhases(torch.nn.Module):
    """Each phase runs two matmuls at once, on IPUs 0 and 2 or 1 and 3: one block id
    per phase, started on two IPUs."""

    def __init__(self, phases=4, size=4):
        super().__init__()
        self.size, self.phases = size, phases
        self.ws = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.rand(size, size)) for _ in range(2 * phases)])

    def forward(self, x, target):
        with poptorch.Block("0", ipu_id=0):
            ins = torch.split(x, self.size)
        weights = iter(self.ws)
        for phase in range(self.phases):
            out = []
            for side in range(2):
                with poptorch.Block(f"{phase}", ipu_id=(phase % 2) + 2 * side):
                    out.append(F.relu(torch.matmul(next(weights), ins[side])))
            ins = out[1], out[0]
        with poptorch.Block(f"{self.phases - 1}", ipu_id=3):
            res = ins[0] + ins[1]
            return res, F.l1_loss(res, target)


def test_a_phase_block_started_on_two_ipus_trains_like_pytorch(poptorch_logs):
    torch.manual_seed(0)
    model, ref = _TwoByTwoPhases(), _TwoByTwoPhases()
    ref.load_state_dict(model.state_dict())
    opts = poptorch.Options()
    opts.setExecutionStrategy(poptorch.ParallelPhasedExecution(*[str(n) for n in range(4)]))
    executor = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(),
                                                                      lr=0.1))
    x, target = torch.rand(8, 1), torch.rand(4, 1)
    out, loss = executor(x, target)
    want_out, want_loss = ref(x, target)
    want_loss.backward()
    torch.testing.assert_close(out, want_out.detach())
    torch.testing.assert_close(loss, want_loss.detach())
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())
    table = [r.getMessage().split() for r in poptorch_logs.records
             if r.getMessage().strip()[:1].isdigit()]
    phase0_ipus = {int(row[0]) for row in table if len(row) > 3 and row[2] == "0"
                   and row[3] != "0"}
    assert phase0_ipus == {0, 2}  # the forward ops of phase 0 run on IPUs 0 and 2


# -- a model without inputs -------------------------------------------------------------

_A = torch.tensor([1, 2])
_B = torch.tensor([3, 4])


class _ConstantsOnly(torch.nn.Module):
    def forward(self):
        return _A + _B, ([_A, _B], [_A, _B]), _B


def test_model_without_inputs_computing_from_two_constants():
    """No input and two module-level constants failed in torch.export with "Argument
    'lifted_tensor_1' of Node 'add' was used before it has been defined"."""
    executor = poptorch.inferenceModel(_ConstantsOnly())
    with pytest.warns(UserWarning, match="Output expected to be on the IPU but is on cpu"):
        executor.compile()
    total, (first, second), last = executor()
    assert total.tolist() == [4, 6]
    assert [t.tolist() for t in first + second] == [[1, 2], [3, 4]] * 2
    assert last.tolist() == [3, 4]
