"""cond, for_loop, nop (docs/api-sections.md api §8.3–§8.5), NameScope / Attribute / MultiConv and
module name scopes (docs/api-sections.md api §8.17–§8.19, docs/semantics.md S-16), and the §8 names
(docs/api-sections.md api §1.1, docs/semantics.md S-4)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

SECTION_8 = ["ctc_beam_search_decoder", "ipu_print_tensor", "for_loop", "cond", "nop",
             "dynamic_slice", "dynamic_update", "recomputationCheckpoint",
             "serializedMatMul", "set_available_memory", "set_overlap_for_input",
             "set_overlap_for_output", "custom_op", "CPU", "identity_loss", "fps",
             "nearest", "MultiConv", "NameScope", "Attribute"]


def quiet(opts=None):
    return (opts or poptorch.Options()).showCompilationProgressBar(False)


def call_functions(executor):
    return [n for n in executor._state.executable.graph.module.graph.nodes
            if n.op == "call_function"]


@pytest.mark.parametrize("name", SECTION_8)
def test_every_section_8_name_is_importable(name):
    assert getattr(poptorch, name) is getattr(poptorch.ops, name)
    assert name in poptorch.ops.__all__


class Trained(nn.Module):
    """A training model whose loss comes from ``body(x * w)[0]``."""

    def __init__(self, body):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.body = body

    def forward(self, x):
        return poptorch.identity_loss(self.body(x * self.w)[0], "sum")


# -- cond ---------------------------------------------------------------------------------

class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("shift", torch.full((3,), 0.5))

    def forward(self, x, flag):
        scale = x.sum() * 2  # computed in the main graph, read by both branches

        def then_body(a, b):
            return [self.fc(a) * scale + self.shift, b.relu(), scale.expand(3)]

        def else_body(a):
            return [a - scale, a * 3, x[0]]  # x: an enclosing-scope tensor returned as is
        return poptorch.cond(flag.sum() > 0, then_body, [x + 1, self.fc(x)], else_body,
                             [x * 2])


def reference_branches(model, x, flag):
    scale = x.sum() * 2
    if flag.sum() > 0:
        return [model.fc(x + 1) * scale + model.shift, model.fc(x).relu(), scale.expand(3)]
    return [x * 2 - scale, x * 6, x[0]]


@pytest.mark.parametrize("iterations", [1, 3])
def test_cond_reads_enclosing_scope_several_outputs_computed_arguments(iterations, capfd):
    model = Branches()
    executor = poptorch.inferenceModel(model, quiet(poptorch.Options().deviceIterations(
        iterations)))
    x = torch.randn(2 * iterations, 3)
    flags = torch.tensor([1.0, -1.0, 2.0][:iterations])
    outs = executor(x, flags)
    assert capfd.readouterr().err == ""
    # micro-batches taking different branches still run as one vectorised call
    assert (executor._state.executable.vectorized is not None) == (iterations > 1)
    assert isinstance(outs, list) and len(outs) == 3
    for k in range(iterations):
        expected = reference_branches(model, x[2 * k:2 * k + 2], flags[k:k + 1])
        for got, want in zip(outs, expected):
            rows = want.shape[0]
            torch.testing.assert_close(got[rows * k:rows * (k + 1)], want.detach())
    # CPU behaviour: a genuine if/else
    for got, want in zip(model(x[:2], flags[:1]), reference_branches(model, x[:2],
                                                                       flags[:1])):
        torch.testing.assert_close(got, want)


def test_cond_errors():
    with pytest.raises(ValueError, match="Object is not list"):
        poptorch.cond(torch.tensor(True), lambda: 1, (torch.ones(1),), lambda: 1, [])
    with pytest.raises(ValueError, match="Object is not list"):
        poptorch.cond(torch.tensor(True), lambda: 1, [], lambda: 1, torch.ones(1))

    body = lambda x: poptorch.cond(x.sum() > 0, lambda a: a * 2, [x], lambda a: a, [x])
    with pytest.raises(poptorch.Error, match=r"poptorch.cond\(\) is only supported in "
                       "inference."):
        poptorch.trainingModel(Trained(body), quiet())(torch.ones(2))


# -- for_loop / nop ------------------------------------------------------------------------

class Loop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x, y):
        bias = y * 0.5

        def body(a, b):
            a.add_(1)  # in place on the loop's copy only
            return [self.fc(a) + bias, b * 2]
        return poptorch.for_loop(3, body, [x, y]), x


def test_for_loop_runs_count_times_on_device_and_once_on_cpu():
    model = Loop()
    x, y = torch.randn(1, 2), torch.randn(1, 2)
    a, b = x.clone(), y.clone()
    for _ in range(3):
        a, b = model.fc(a + 1) + y * 0.5, b * 2
    (out_a, out_b), x_after = poptorch.inferenceModel(model, quiet())(x, y)
    torch.testing.assert_close(out_a, a)
    torch.testing.assert_close(out_b, b)
    torch.testing.assert_close(x_after, x)  # inputs are passed by value
    (cpu_a, cpu_b), _ = model(x.clone(), y)
    torch.testing.assert_close(cpu_b, y * 2)  # PopTorch's CPU quirk: one iteration


def test_for_loop_errors():
    with pytest.raises(ValueError, match=r"\(Object is not list\)"):
        poptorch.for_loop(2, lambda a: a, torch.ones(1))
    with pytest.raises(ValueError, match="Object contained in list at index 1 is not "
                       "torch.tensor"):
        poptorch.for_loop(2, lambda a, b: [a, b], [torch.ones(1), 2])

    body = lambda x: poptorch.for_loop(2, lambda a: a * 2, [x])
    with pytest.raises(poptorch.Error, match=r"poptorch.for_loop\(\) is only supported in "
                       "inference."):
        poptorch.trainingModel(Trained(body), quiet())(torch.ones(2))

    class Mismatch(nn.Module):
        def forward(self, x):
            return poptorch.for_loop(2, lambda a: [a, a], [x])
    with pytest.raises(poptorch.Error, match="must return as many as it takes"):
        poptorch.inferenceModel(Mismatch(), quiet())(torch.ones(2))


def test_nop_is_kept_in_the_graph():
    class Model(nn.Module):
        def forward(self, x):
            return poptorch.nop(x * 2) + 1
    x = torch.randn(3)
    executor = poptorch.inferenceModel(Model(), quiet())
    torch.testing.assert_close(executor(x), x * 2 + 1)
    assert "poptorch.nop.default" in [str(n.target) for n in call_functions(executor)]
    assert poptorch.nop(x) is x
    with pytest.raises(poptorch.Error, match="nop takes a tensor"):
        poptorch.nop(1.0)


# -- name scopes, attributes, multi-conv --------------------------------------------------

class Scoped(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, x):
        with poptorch.NameScope("outer"):
            with poptorch.NameScope("inner"):
                y = x * 2
            z = y + 1
        return self.layer(z)


def test_name_scopes_and_module_scopes_shape_tensor_names():
    executor = poptorch.inferenceModel(Scoped(), quiet())
    executor(torch.randn(1, 2))
    names = executor.getTensorNames()
    assert "outer/inner/Mul:0" in names and "outer/Add:0" in names
    assert "layer/Linear:0" in names
    assert "outer/inner/Mul:0" in executor._debugGetPopartIR()

    opts = quiet().disableModuleNamescope()
    plain = poptorch.inferenceModel(Scoped(), opts)
    plain(torch.randn(1, 2))
    names = plain.getTensorNames()
    assert "Linear:0" in names and "layer/Linear:0" not in names
    assert "outer/inner/Mul:0" in names  # NameScope prefixes stay

    opts = quiet()
    opts.anchorTensor("doubled", "outer/inner/Mul:0")
    anchored = poptorch.inferenceModel(Scoped(), opts)
    x = torch.randn(1, 2)
    anchored(x)
    torch.testing.assert_close(anchored.getAnchoredTensor("doubled"), x * 2)
    with pytest.raises(AssertionError):
        poptorch.NameScope(3)


def test_attribute_scopes_merge_and_restore():
    class Model(nn.Module):
        def forward(self, x):
            with poptorch.Attribute(__outline={"layer": "embedding"}):
                a = x * 2
                with poptorch.Attribute(__outline={"kind": "inner"}, other={"k": "v"}):
                    b = a + 1
                c = b - 3
            return c.relu()
    executor = poptorch.inferenceModel(Model(), quiet())
    x = torch.randn(3)
    torch.testing.assert_close(executor(x), (x * 2 + 1 - 3).relu())
    by_name = {n.name: (n.meta.get("custom") or {}).get("attributes")
               for n in call_functions(executor)}
    assert by_name["mul"] == {"__outline": {"layer": "embedding"}}
    assert by_name["add"] == {"__outline": {"layer": "embedding", "kind": "inner"},
                              "other": {"k": "v"}}
    assert by_name["sub"] == {"__outline": {"layer": "embedding"}}
    assert by_name["relu"] is None
    assert "'__outline': {'layer': 'embedding', 'kind': 'inner'}" in \
        executor._debugGetPopartIR()
    with pytest.raises(AssertionError):
        poptorch.Attribute(x=3)


class TwoConvs(nn.Module):
    def __init__(self, multi):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        self.b = nn.Conv2d(2, 4, 1)
        self.multi = multi

    def forward(self, x):
        with self.multi:
            ya = self.a(x)
            yb = self.b(x)
        return torch.cat([ya, yb], 1)


def test_multi_conv_all_setters_exact_convolutions_recorded():
    multi = (poptorch.MultiConv().availableMemoryProportions((0.4, 0.5))
             .partialsTypes([torch.float, torch.half]).enableConvDithering([True, False])
             .planType(poptorch.MultiConvPlanType.Serial).perConvReservedTiles(10)
             .cycleBackOff(0.3))
    model = TwoConvs(multi)
    x = torch.randn(1, 2, 5, 5)
    executor = poptorch.inferenceModel(model, quiet())
    assert torch.equal(executor(x), torch.cat([model.a(x), model.b(x)], 1))
    assert "'plan_type': 'Serial'" in executor._debugGetPopartIR()
    convs = [n for n in call_functions(executor) if "conv" in str(n.target)]
    assert len(convs) == 2
    settings = [n.meta["custom"]["multi_conv"] for n in convs]
    assert settings[0] == settings[1]
    assert settings[0]["available_memory_proportions"] == [0.4, 0.5]
    assert settings[0]["partials_types"] == ["float", "half"]
    assert settings[0]["enable_conv_dithering"] == [True, False]
    assert settings[0]["plan_type"] == "Serial"
    assert settings[0]["per_conv_reserved_tiles"] == 10
    assert settings[0]["cycle_back_off"] == 0.3
    assert multi.__enter__() is None
    multi.__exit__(None, None, None)


@pytest.mark.parametrize("setter,value,error,message", [
    ("availableMemoryProportions", [], AssertionError, "Invalid available memory"),
    ("availableMemoryProportions", 1, AssertionError, "Invalid available memory"),
    ("partialsTypes", torch.int32, ValueError, "Invalid partials types"),
    ("enableConvDithering", "yes", ValueError, "value must be bool or list of bools"),
    ("planType", "Serial", AssertionError, "Invalid plan type!"),
    ("perConvReservedTiles", 1.5, AssertionError, "must be an int"),
    ("cycleBackOff", 1, AssertionError, "must be a float"),
])
def test_multi_conv_setter_errors(setter, value, error, message):
    with pytest.raises(error, match=message):
        getattr(poptorch.MultiConv(), setter)(value)
    assert poptorch.MultiConv().enableConvDithering(None).planType(None) is not None


def test_scopes_and_hints_are_identities_on_cpu():
    x = torch.randn(2, 3)
    model = TwoConvs(poptorch.MultiConv())
    y = torch.randn(1, 2, 4, 4)
    assert torch.equal(model(y), torch.cat([model.a(y), model.b(y)], 1))
    with poptorch.NameScope("s"), poptorch.Attribute(a={"b": 1}):
        assert poptorch.ipu_print_tensor(x) is x
        assert poptorch.set_available_memory(x, 0.2) is x
        assert poptorch.recomputationCheckpoint(x) is x
    assert torch.equal(poptorch.identity_loss(x, "sum"), x.sum())


def test_ops_in_a_training_model_with_all_markers():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, t):
            with poptorch.NameScope("body"):
                y = poptorch.set_available_memory(self.fc(x), 0.5)
                y = poptorch.recomputationCheckpoint(poptorch.nop(y))
            return F.mse_loss(y, t)
    model = Model()
    reference = nn.Linear(4, 4)
    reference.load_state_dict(model.fc.state_dict())
    executor = poptorch.trainingModel(model, quiet(), torch.optim.SGD(model.parameters(),
                                                                      lr=0.1))
    x, t = torch.randn(2, 4), torch.randn(2, 4)
    loss = executor(x, t)
    ref_loss = F.mse_loss(reference(x), t)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    executor.copyWeightsToHost()
    torch.testing.assert_close(model.fc.weight.detach(),
                               (reference.weight - 0.1 * reference.weight.grad).detach())


def test_name_scopes_interleave_with_module_paths_in_entry_order():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            with poptorch.NameScope("attention"):
                return self.fc(x) * 3

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            with poptorch.NameScope("encoder"):
                return self.inner(x) - 1
    executor = poptorch.inferenceModel(Outer(), quiet())
    executor(torch.randn(1, 2))
    names = executor.getTensorNames()
    assert "encoder/inner/attention/fc/Linear:0" in names
    assert "encoder/inner/attention/Mul:0" in names
    assert "encoder/Sub:0" in names


# -- errors of ops inside a wrapped model ----------------------------------------------

class PrintInCond(nn.Module):
    def forward(self, x):
        return poptorch.cond(x.sum() > 0,
                             lambda a: [poptorch.ipu_print_tensor(a, "then")], [x],
                             lambda a: [a], [x])[0]


def test_host_op_inside_cond_branch_is_a_clear_error():
    executor = poptorch.inferenceModel(PrintInCond(), quiet())
    with pytest.raises(poptorch.Error, match=r"poptorch.cond: a branch could not be captured"
                       r".*call host ops \(ipu_print_tensor, CPU, custom_op\) outside"):
        executor(torch.ones(2, 2))


class OpCall(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.fn = fn

    def forward(self, x):
        return self.fn(self, x)


@pytest.mark.parametrize("fn, error, message", [
    (lambda m, x: poptorch.for_loop(2, lambda a: [a], x), ValueError,
     r"\(Object is not list\)"),
    (lambda m, x: poptorch.cond(x.sum() > 0, lambda a: [a], x, lambda a: [a], [x]),
     ValueError, r"\(Object is not list\)"),
    (lambda m, x: poptorch.recomputationCheckpoint(m.fc(x), 3), ValueError,
     "All inputs must be tensors"),
    (lambda m, x: poptorch.serializedMatMul(x, m.fc.weight,
                                            poptorch.MatMulSerializationMode.ReducingDim,
                                            2, 1), AssertionError,
     "keep_precision must be a bool"),
])
def test_op_argument_errors_inside_a_wrapped_model_keep_the_spec_exception_type(
        fn, error, message):
    model = OpCall(fn)
    before = copy.deepcopy(model.state_dict())
    executor = poptorch.inferenceModel(model, quiet())
    with pytest.raises(error, match=message):
        executor(torch.ones(2, 2))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
