"""Ops doing host work at run time (docs/api-sections.md api §8.2, §8.12, §8.13): ipu_print_tensor,
CPU and the custom-op registry."""
import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from poptorch._ops.print_format import PrintFormat, format_tensor


def quiet(opts=None):
    return (opts or poptorch.Options()).showCompilationProgressBar(False)


class Printing(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.kwargs = kwargs

    def forward(self, x, t=None):
        y = poptorch.ipu_print_tensor(self.fc(x), "act", **self.kwargs)
        if t is None:
            return y
        return F.mse_loss(y, t)


def print_lines(err, title):
    return [line for line in err.splitlines() if line.startswith(f"{title}:")]


def test_print_runs_once_per_micro_batch_and_replica_at_run_time(capfd):
    opts = quiet(poptorch.Options().deviceIterations(4).replicationFactor(2))
    executor = poptorch.inferenceModel(Printing(), opts)
    x = torch.randn(8, 2)
    executor.compile(x)
    assert print_lines(capfd.readouterr().err, "act") == []  # nothing at capture
    assert executor._state.executable.vectorized is None  # runs micro-batch by micro-batch
    executor(x)
    assert len(print_lines(capfd.readouterr().err, "act")) == 8
    executor(x)
    assert len(print_lines(capfd.readouterr().err, "act")) == 8


def test_print_shows_actual_values_and_cpu_prints_nothing(capfd):
    model = Printing(float_format="fixed", digits=3)
    with torch.no_grad():
        model.fc.weight.copy_(torch.eye(2))
        model.fc.bias.zero_()
    x = torch.tensor([[1.25, -2.5]])
    assert model(x) is not None and capfd.readouterr().err == ""
    executor = poptorch.inferenceModel(model, quiet())
    torch.testing.assert_close(executor(x), x)
    # 3 significant digits: one integer digit, two decimals, aligned.
    assert "act: (\n ( 1.25, -2.50)\n)\n" in capfd.readouterr().err


def test_print_gradient_in_training(capfd):
    model = Printing()
    executor = poptorch.trainingModel(model, quiet(poptorch.Options().deviceIterations(2)))
    executor(torch.randn(4, 2), torch.randn(4, 2))
    err = capfd.readouterr().err
    assert len(print_lines(err, "act")) == 2
    assert len(print_lines(err, "act_gradient")) == 2
    silent = poptorch.trainingModel(Printing(print_gradient=False), quiet())
    silent(torch.randn(2, 2), torch.randn(2, 2))
    err = capfd.readouterr().err
    assert len(print_lines(err, "act")) == 1 and not print_lines(err, "act_gradient")


def test_print_errors():
    with pytest.raises(poptorch.Error, match="ipu print tensor must take a torch.tensor"):
        poptorch.ipu_print_tensor([1.0])
    with pytest.raises(KeyError):
        poptorch.ipu_print_tensor(torch.ones(1), float_format="engineering")


@pytest.mark.parametrize("kwargs, message", [
    (dict(float_format="bogus"), r"float_format must be one of 'auto', 'fixed', "
     r"'scientific', 'none' \(lower case\), got 'bogus'"),
    (dict(float_format="FIXED"), r"float_format must be one of .*got 'FIXED'"),
    (dict(digits=-1), r"digits must be an int >= 0 \(0 disables the analysis\), got -1"),
    (dict(max_line_width=-3), r"max_line_width must be an int >= 0 .*got -3"),
    (dict(summarise_threshold=-5), r"summarise_threshold must be an int >= 0 .*got -5"),
    (dict(edge_items=-1), r"edge_items must be an int >= 0 \(0 shows only the "
     r"ellipsis\), got -1"),
    (dict(edge_items=1.5), r"edge_items must be an int >= 0 .*got 1.5"),
    (dict(digits=True), r"digits must be an int >= 0 .*got True"),
    (dict(separator=None), r"separator must be a str, got None"),
    (dict(open_bracket=1), r"open_bracket must be a str, got 1"),
])
def test_print_arguments_are_checked_when_captured(kwargs, message):
    """Fresh-user report D5: unknown float_format gave a bare KeyError wrapped in a
    capture error; bad counts and a None separator were accepted silently."""
    class M(nn.Module):
        def forward(self, x):
            return poptorch.ipu_print_tensor(x, "t", **kwargs) + 0
    with pytest.raises(poptorch.Error, match=message):
        poptorch.inferenceModel(M(), quiet())(torch.arange(4.))
    with pytest.raises(poptorch.Error, match=message):  # on the CPU too
        poptorch.ipu_print_tensor(torch.ones(1), **kwargs)


def test_unknown_float_format_is_still_a_key_error_as_in_poptorch():
    with pytest.raises(KeyError) as info:
        poptorch.ipu_print_tensor(torch.ones(1), float_format="Auto")
    assert isinstance(info.value, poptorch.Error)


def test_print_with_zero_edge_items_shows_only_the_ellipsis(capfd):
    """Fresh-user report D4: edge_items=0 with summarising raised a raw index_select
    RuntimeError at run time."""
    class M(nn.Module):
        def forward(self, x):
            return poptorch.ipu_print_tensor(x, "t", summarise_threshold=5,
                                             edge_items=0) + 0
    out = poptorch.inferenceModel(M(), quiet())(torch.arange(20.))
    torch.testing.assert_close(out, torch.arange(20.))
    assert print_lines(capfd.readouterr().err, "t") == ["t: (...)"]
    grid = format_tensor(torch.arange(20.).reshape(4, 5),
                         PrintFormat(summarise_threshold=5, edge_items=0))
    assert grid == "(\n ...\n)"


GRID = torch.tensor([[2.7182817, 3.1415927], [1.4142135, 1.7320508]])


@pytest.mark.parametrize("kwargs,expected", [
    # Poplar's own defaults: space separator, square brackets, 8 digits.
    (dict(summarise_threshold=1000, edge_items=3, max_line_width=75, digits=8,
          float_format="auto", separator=" ", open_bracket="[", close_bracket="]"),
     "[\n [2.7182817 3.1415927]\n [1.4142135 1.7320508]\n]"),
    # Scientific: digits count the mantissa's digits; a narrow line width wraps each
    # row after its first element, continuing two columns past the bracket.
    (dict(max_line_width=16, digits=6, float_format="scientific", separator=",",
          open_bracket="<", close_bracket=">"),
     "<\n <2.71828e+00,\n   3.14159e+00>\n <1.41421e+00,\n   1.73205e+00>\n>"),
    (dict(digits=3, float_format="fixed", separator="|", open_bracket="{",
          close_bracket="}"),
     "{\n {2.72|3.14}\n {1.41|1.73}\n}"),
    # PopTorch's defaults: ", " and round brackets, 4 digits.
    (dict(), "(\n (2.718, 3.142)\n (1.414, 1.732)\n)"),
    # digits=0: no analysis, each value as C's %g, unaligned.
    (dict(digits=0), "(\n (2.71828, 3.14159)\n (1.41421, 1.73205)\n)"),
])
def test_print_format_options_give_exact_text(kwargs, expected):
    assert format_tensor(GRID, PrintFormat(**kwargs)) == expected


def test_print_format_through_a_compiled_model(capfd):
    model = Printing(max_line_width=16, digits=6, float_format="scientific",
                     separator=",", open_bracket="<", close_bracket=">")
    with torch.no_grad():
        model.fc.weight.copy_(torch.eye(2))
        model.fc.bias.zero_()
    poptorch.inferenceModel(model, quiet())(GRID)
    assert "act: <\n <2.71828e+00,\n   3.14159e+00>\n <1.41421e+00,\n   1.73205e+00>\n>" \
        in capfd.readouterr().err


def test_print_format_summarises_every_dimension_at_the_edges():
    assert format_tensor(torch.arange(10), PrintFormat(summarise_threshold=5,
                                                       edge_items=2)) == "(0, 1, ..., 8, 9)"
    assert format_tensor(torch.arange(10), PrintFormat(summarise_threshold=0)) == \
        "(0, 1, 2, 3, 4, 5, 6, 7, 8, 9)"
    grid = torch.arange(36).reshape(6, 6)
    assert format_tensor(grid, PrintFormat(summarise_threshold=20, edge_items=1)) == \
        "(\n ( 0, ...,  5)\n ...\n (30, ..., 35)\n)"
    # The alignment width comes from the shown values only, not the hidden 1000.
    assert format_tensor(torch.tensor([1, 2, 1000, 3, 4]),
                         PrintFormat(summarise_threshold=2, edge_items=1)) == "(1, ..., 4)"


def test_print_format_numbers():
    # auto: scientific when a value is too small for the decimals fixed would show...
    assert format_tensor(torch.tensor([1e-6, 1.0]), PrintFormat(digits=2)) == \
        "(1.0e-06, 1.0e+00)"
    # ... or needs more integer digits than ``digits``.
    assert format_tensor(torch.tensor([1.5, -10.25, 12345.0]), PrintFormat()) == \
        "( 1.500e+00, -1.025e+01,  1.234e+04)"
    # fixed keeps the integer digits of the largest magnitude, rest decimals.
    assert format_tensor(torch.tensor([1.5, -10.25]), PrintFormat()) == "(  1.50, -10.25)"
    # none: each element on its own (%g with ``digits`` significant digits), aligned.
    assert format_tensor(torch.tensor([0.5, 10.25]), PrintFormat(float_format="none",
                                                                 digits=3)) == \
        "( 0.5, 10.2)"
    assert format_tensor(torch.tensor([float("nan"), 1.0, float("inf")]),
                         PrintFormat()) == "(  nan, 1.000,   inf)"
    assert format_tensor(torch.tensor([1.5], dtype=torch.half), PrintFormat()) == "(1.500)"
    assert format_tensor(torch.tensor(3), PrintFormat()) == "3"
    assert format_tensor(torch.tensor([True, False]), PrintFormat()) == "( True, False)"
    assert format_tensor(torch.zeros(0), PrintFormat()) == "()"
    assert format_tensor(torch.zeros(2, 0), PrintFormat()) == "(\n ()\n ()\n)"
    wrapped = format_tensor(torch.arange(12), PrintFormat(max_line_width=14))
    assert wrapped == "( 0,  1,  2,\n   3,  4,  5,\n   6,  7,  8,\n   9, 10, 11)"


# -- CPU ----------------------------------------------------------------------------------

class HostModel(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.cpu = poptorch.CPU(fn, "host")

    def forward(self, x, t=None):
        y = self.cpu(self.fc(x))
        out = y * 2 if isinstance(y, torch.Tensor) else y[0] * 2 + y[1]
        if t is None:
            return out
        return out, F.mse_loss(self.fc(x) + out, t)


def test_cpu_op_runs_on_host_with_actual_values_once_per_micro_batch():
    seen = []

    def host(a):
        seen.append(a.clone())
        return a.sin()

    model = HostModel(host)
    x = torch.randn(8, 3)
    executor = poptorch.inferenceModel(model, quiet(poptorch.Options().deviceIterations(4)))
    executor.compile(x)
    seen.clear()
    out = executor(x)
    torch.testing.assert_close(out, model.fc(x).sin() * 2)
    assert len(seen) == 4
    torch.testing.assert_close(torch.cat(seen), model.fc(x).detach())
    seen.clear()
    assert torch.equal(model(x), model.fc(x).sin() * 2)  # CPU: direct call
    assert len(seen) == 1


def test_cpu_op_in_training_runs_per_micro_batch_and_several_outputs():
    calls = []

    def host(a):
        calls.append(a.shape)
        return (a.cos(), a.abs().to(torch.float32))

    model = HostModel(host)
    ref = copy.deepcopy(model)
    opts = quiet()
    opts.Training.gradientAccumulation(3)
    executor = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(),
                                                                   lr=0.1))
    x, t = torch.randn(6, 3), torch.randn(6, 3)
    executor.compile(x, t)
    calls.clear()
    out, loss = executor(x, t)
    assert calls == [torch.Size([2, 3])] * 3
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(3):
        xs, ts = x[2 * k:2 * k + 2], t[2 * k:2 * k + 2]
        h = ref.fc(xs).detach()  # host results are constants for the backward pass
        (F.mse_loss(ref.fc(xs) + h.cos() * 2 + h.abs(), ts) / 3).backward()
    optimizer.step()
    executor.copyWeightsToHost()
    torch.testing.assert_close(model.fc.weight.detach(), ref.fc.weight.detach())


def test_cpu_op_output_shape_and_dtype_errors():
    state = {"shape": (2, 3), "dtype": torch.float32}

    def host(a):
        return torch.zeros(state["shape"], dtype=state["dtype"])

    executor = poptorch.inferenceModel(HostModel(host), quiet())
    x = torch.randn(2, 3)
    executor(x)
    state["shape"] = (2, 4)
    with pytest.raises(poptorch.Error, match=r"output 0 has shape \[2, 4\].*shape \[2, 3\]"):
        executor(x)
    state["shape"], state["dtype"] = (2, 3), torch.int32
    with pytest.raises(poptorch.Error, match="dtype torch.int32"):
        executor(x)
    with pytest.raises(poptorch.Error, match="must return a tensor"):
        poptorch.inferenceModel(HostModel(lambda a: 3), quiet())(x)


def test_cpu_ops_must_not_overlap_and_module_params_frozen():
    inner = poptorch.CPU(lambda a: a + 1, "inner")
    layer = nn.Linear(3, 3)
    assert not any(p.requires_grad for p in poptorch.CPU(layer, "m")._layer.parameters())
    executor = poptorch.inferenceModel(HostModel(lambda a: inner(a)), quiet())
    with pytest.raises(poptorch.Error, match="CPU ops must not overlap"):
        executor(torch.randn(2, 3))


# -- custom_op ------------------------------------------------------------------------------

@pytest.fixture
def registry():
    keys = []

    def register(name, impl, gradient=None, domain="test.ops", version=1):
        poptorch.ops.register_custom_op(name, domain, version, impl, gradient)
        keys.append((name, domain, version))
    yield register
    for key in keys:
        poptorch.ops.unregister_custom_op(*key)


ATTRIBUTES = {"alpha": 1.5, "count": 3, "mode": "fast", "floats": (0.5, 2.0),
              "ints": [1, 2], "names": ["a", "b"]}


class CustomModel(nn.Module):
    def __init__(self, name="ScaledTanh", attributes=ATTRIBUTES):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.name, self.attributes = name, attributes

    def forward(self, x, t=None):
        y = self.fc(x)
        out, extra = poptorch.custom_op([y, x], self.name, "test.ops", 1,
                                        example_outputs=[y, x.sum(1)],
                                        attributes=self.attributes)
        if t is None:
            return out, extra
        return out, F.mse_loss(out, t)


def scaled_tanh(inputs, attributes):
    y, x = inputs
    return [torch.tanh(y) * attributes["alpha"], x.sum(1)]


def test_custom_op_attributes_arrive_with_python_types(registry):
    received = []

    def impl(inputs, attributes):
        received.append(attributes)
        return scaled_tanh(inputs, attributes)
    registry("ScaledTanh", impl)
    model = CustomModel()
    x = torch.randn(2, 4)
    out, extra = poptorch.inferenceModel(model, quiet())(x)
    torch.testing.assert_close(out, torch.tanh(model.fc(x)) * 1.5)
    torch.testing.assert_close(extra, x.sum(1))
    attrs = received[-1]
    assert attrs == {"alpha": 1.5, "count": 3, "mode": "fast", "floats": [0.5, 2.0],
                     "ints": [1, 2], "names": ["a", "b"]}
    assert [type(attrs[k]) for k in ("alpha", "count", "mode")] == [float, int, str]
    assert type(attrs["floats"][0]) is float and type(attrs["ints"][0]) is int
    cpu_out, cpu_extra = model(x)  # CPU behaviour: zeros shaped like the examples
    assert torch.equal(cpu_out, torch.zeros(2, 4)) and torch.equal(cpu_extra, torch.zeros(2))


def test_custom_op_unregistered_names_what_to_register():
    with pytest.raises(poptorch.Error, match=r"'Missing' \(domain 'test.ops', version 1\) "
                       r"is not registered.*register_custom_op\('Missing'"):
        poptorch.inferenceModel(CustomModel("Missing"), quiet())(torch.randn(2, 4))


@pytest.mark.parametrize("with_gradient", [False, True])
def test_registered_custom_op_trains(registry, with_gradient):
    calls = []

    def gradient(inputs, grads, attributes):
        calls.append(1)
        y, x = inputs
        return [grads[0] * attributes["alpha"] * (1 - torch.tanh(y) ** 2), None]
    registry("ScaledTanh", scaled_tanh, gradient if with_gradient else None)
    model = CustomModel()
    ref = copy.deepcopy(model)
    executor = poptorch.trainingModel(model, quiet(), torch.optim.SGD(model.parameters(),
                                                                      lr=0.5))
    x, t = torch.randn(2, 4), torch.randn(2, 4)
    for _ in range(2):
        executor(x, t)
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        F.mse_loss(torch.tanh(ref.fc(x)) * 1.5, t).backward()
        optimizer.step()
    executor.copyWeightsToHost()
    torch.testing.assert_close(model.fc.weight.detach(), ref.fc.weight.detach())
    assert len(calls) == (2 if with_gradient else 0)


def test_custom_op_wrong_output_shape_at_run_time(registry):
    registry("ScaledTanh", lambda inputs, attributes: [inputs[0], inputs[1]])
    with pytest.raises(poptorch.Error, match=r"output 1 has shape \[2, 4\]"):
        poptorch.inferenceModel(CustomModel(), quiet())(torch.randn(2, 4))


@pytest.mark.parametrize("attributes,message", [
    ({1: 2.0}, "All attribute keys must be strings."),
    ({"x": {"a": 1}}, "unsupported value type dict"),
    ({"x": [1, 2.0]}, "must all be the same."),
    ({"x": "caf\u00e9"}, "caf\u00e9 contains non-ASCII characters."),
    ({"\u00e9": 1}, "\u00e9 contains non-ASCII characters."),
])
def test_custom_op_attribute_errors(attributes, message):
    with pytest.raises(ValueError, match=message):
        poptorch.custom_op([torch.ones(1)], "Op", "d", 1, [torch.ones(1)], attributes)


# -- a CPU op created inside forward ---------------------------------------------------

def max_weight_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


class InlineCpuPipeline(nn.Module):
    """A two-stage pipeline creating its poptorch.CPU op inside forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.c = nn.Linear(6, 2)

    def forward(self, x, y):
        with poptorch.Block("A", ipu_id=0):
            x = self.a(x)
        with poptorch.Block("B", ipu_id=1):
            x = poptorch.CPU(lambda t: t * 2, "double")(x)
            x = self.c(torch.relu(x))
            loss = F.mse_loss(x, y)
        return x, loss


def test_cpu_op_created_inside_forward_stays_alive_for_training():
    torch.manual_seed(0)
    model = InlineCpuPipeline()
    ref = copy.deepcopy(model)
    opts = quiet()
    opts.Training.gradientAccumulation(4)
    executor = poptorch.trainingModel(model, opts,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 6), torch.randn(8, 2)
    executor.compile(x, y)
    gc.collect()  # the CPU object has no owner but the compiled graph
    executor(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for mb in range(4):
        xs, ys = x[2 * mb:2 * mb + 2], y[2 * mb:2 * mb + 2]
        hidden = (ref.a(xs) * 2).detach()  # no gradient through host code
        (F.mse_loss(ref.c(torch.relu(hidden)), ys) / 4).backward()
    ref_opt.step()
    executor.copyWeightsToHost()
    assert max_weight_diff(model, ref) < 1e-6
