"""inferenceModel: capture once, batching, output modes, structures, inputs and dtypes
(spec api §2.2, §5; semantics S-1…S-24, S-30…S-35, S-44)."""
import collections
import copy

import pytest
import torch
import torch.nn as nn

import poptorch


class Linear6(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 20)

    def forward(self, x):
        return self.fc(x)


# -- capture once (S-1, S-2, S-4) -----------------------------------------------------

def test_plain_tensor_attribute_is_frozen_at_capture():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.i = torch.tensor([0.])

        def forward(self, x):
            self.i += 1
            return self.i + 0 * x

    m = M()
    model = poptorch.inferenceModel(m)
    assert model(torch.zeros(1)).tolist() == [1.0]
    assert model(torch.zeros(1)).tolist() == [1.0]
    assert m.i.tolist() == [1.0]  # the add ran once on the host, at capture


def test_buffer_persists_between_calls_and_needs_explicit_copy_to_host():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("i", torch.tensor([0.]))

        def forward(self, x):
            self.i += 1
            return self.i + 0 * x

    m = M()
    model = poptorch.inferenceModel(m)
    assert model(torch.zeros(1)).tolist() == [1.0]
    assert model(torch.zeros(1)).tolist() == [2.0]
    assert m.i.tolist() == [0.0]  # S-35: inference never marks the host stale
    model.copyWeightsToHost()
    assert m.i.tolist() == [2.0]


def test_forward_python_runs_once_and_is_running_on_ipu():
    calls = []

    class M(nn.Module):
        def forward(self, x):
            calls.append(poptorch.isRunningOnIpu())
            return x * 2

    model = poptorch.inferenceModel(M())
    for _ in range(3):
        assert torch.equal(model(torch.ones(2)), torch.full((2,), 2.0))
    assert calls == [True]
    assert not poptorch.isRunningOnIpu()


def test_ipu_and_cpu_paths_diverge():
    class M(nn.Module):
        def forward(self, x, y):
            if poptorch.isRunningOnIpu():
                return x + y
            return x * y

    x, y = torch.tensor([50.]), torch.tensor([2.])
    assert poptorch.inferenceModel(M())(x, y).item() == 52.0
    assert M()(x, y).item() == 100.0


def test_device_ipu_arguments_are_accepted(poptorch_logs):
    class M(nn.Module):
        def forward(self, x):
            return x + torch.ones(3, device="ipu") + torch.zeros(3).to("ipu") + torch.arange(3)

    out = poptorch.inferenceModel(M())(torch.zeros(3))
    assert out.tolist() == [1.0, 2.0, 3.0]
    assert "No device set in torch.arange(): forcing to IPU" in poptorch_logs.text


def test_compile_hooks_run_around_capture_even_on_failure():
    events = []
    pre = poptorch.registerPreCompileHook(lambda: events.append("pre"))
    post = poptorch.registerPostCompileHook(lambda: events.append("post"))
    try:
        class Bad(nn.Module):
            def forward(self, x):
                raise KeyError("user error")

        with pytest.raises(KeyError, match="user error"):
            poptorch.inferenceModel(Bad())(torch.ones(1))
        assert events == ["pre", "post"]
        poptorch.inferenceModel(nn.Identity())(torch.ones(1))
        assert events == ["pre", "post", "pre", "post"]
    finally:
        pre.remove()
        post.remove()
    poptorch.inferenceModel(nn.Identity())(torch.ones(1))
    assert len(events) == 4
    with pytest.raises(RuntimeError, match="callable"):
        poptorch.registerPreCompileHook(3)


# -- parameters must not be replaced (S-5) -----------------------------------------------

def test_reassigned_buffer_raises_and_host_state_is_restored():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("y", torch.zeros(2))

        def forward(self, x):
            self.y = x
            return x * 2

    m = M()
    buffer = m.y
    model = poptorch.inferenceModel(m)
    with pytest.raises(poptorch.Error, match=r"Buffer y is reassigned within the model.*"
                                             r"self\.y\.copy_\(src\)"):
        model(torch.ones(2))
    assert m.y is buffer and torch.equal(m.y, torch.zeros(2))
    assert not model.isCompiled()


def test_reassigned_parameter_raises():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x):
            self.w = nn.Parameter(x)
            return x

    with pytest.raises(poptorch.Error, match="Parameter w is reassigned"):
        poptorch.inferenceModel(M())(torch.ones(2))


# -- trivial graphs (S-6) -----------------------------------------------------------------

def test_pass_through_outputs_follow_new_inputs():
    class M(nn.Module):
        def forward(self, x, y, z):
            return x, y, z + 0.0

    model = poptorch.inferenceModel(M())
    out = model(torch.tensor([1.]), torch.tensor([2.]), torch.tensor([3.]))
    assert [t.item() for t in out] == [1.0, 2.0, 3.0]
    out = model(torch.tensor([4.]), torch.tensor([5.]), torch.tensor([6.]))
    assert [t.item() for t in out] == [4.0, 5.0, 6.0]


def test_model_returning_none_returns_none_and_writes_inputs_back():
    class M(nn.Module):
        def forward(self, x):
            x += 1

    t = torch.tensor([1.])
    model = poptorch.inferenceModel(M())
    assert model(t) is None
    assert model(t) is None
    assert t.item() == 3.0


def test_model_returning_only_constants():
    class M(nn.Module):
        def forward(self, x):
            return torch.full((2,), 7.0)

    assert poptorch.inferenceModel(M())(torch.ones(1)).tolist() == [7.0, 7.0]


# -- batching and output modes (S-10…S-13) --------------------------------------------

@pytest.mark.parametrize("mode,period,rows", [
    (poptorch.OutputMode.All, None, list(range(10))),
    (poptorch.OutputMode.EveryN, 5, [4, 9]),
    (poptorch.OutputMode.Final, None, [9]),
])
def test_output_modes_shapes_and_values(mode, period, rows):
    m = Linear6()
    opts = poptorch.Options().deviceIterations(10).outputMode(mode, period)
    x = torch.randn(10, 1, 5, 6)
    out = poptorch.inferenceModel(m, opts)(x)
    ref = m(x).detach()
    assert out.shape == (len(rows), 1, 5, 20)
    torch.testing.assert_close(out, ref[rows], rtol=1e-5, atol=1e-6)


def test_output_mode_sum():
    m = Linear6()
    opts = poptorch.Options().deviceIterations(10).outputMode(poptorch.OutputMode.Sum)
    x = torch.randn(10, 1, 5, 6)
    out = poptorch.inferenceModel(m, opts)(x)
    assert out.shape == (1, 1, 5, 20)
    torch.testing.assert_close(out, m(x).detach().sum(0, keepdim=True), rtol=1e-5, atol=1e-5)


def test_default_output_mode_resolves_to_all_for_inference():
    opts = poptorch.Options().deviceIterations(3)
    model = poptorch.inferenceModel(Linear6(), opts)
    assert model.options.output_mode == poptorch.OutputMode.All
    assert opts.output_mode == poptorch.OutputMode.Default


def test_scalar_outputs_stay_0d_when_k_is_1_and_become_vectors_otherwise():
    class M(nn.Module):
        def forward(self, x):
            return x.sum()

    assert poptorch.inferenceModel(M())(torch.ones(3)).shape == ()
    opts = poptorch.Options().deviceIterations(4)
    out = poptorch.inferenceModel(M(), opts)(torch.arange(8.).reshape(4, 2))
    assert out.tolist() == [1.0, 5.0, 9.0, 13.0]


def test_replica_ordering_of_inputs_and_outputs():
    """S-13: D=2, R=2, B=1: rows [x0..x3] → iteration 0 runs x0 (replica 0) and x1."""
    class M(nn.Module):
        def forward(self, x):
            return x * 10

    opts = poptorch.Options().deviceIterations(2).replicationFactor(2)
    x = torch.tensor([[0.], [1.], [2.], [3.]])
    assert poptorch.inferenceModel(M(), opts)(x).flatten().tolist() == [0., 10., 20., 30.]
    final = poptorch.Options().deviceIterations(2).replicationFactor(2).outputMode(
        poptorch.OutputMode.Final)
    assert poptorch.inferenceModel(M(), final)(x).flatten().tolist() == [20., 30.]


@pytest.mark.parametrize("group_type,expected", [
    (poptorch.CommGroupType.Consecutive, [0, 0, 1, 1]),
    (poptorch.CommGroupType.Orthogonal, [0, 1, 0, 1]),
])
def test_input_replica_grouping(group_type, expected):
    class M(nn.Module):
        def forward(self, x):
            return x + 0

    opts = poptorch.Options().replicationFactor(4).inputReplicaGrouping(2, group_type)
    out = poptorch.inferenceModel(M(), opts)(torch.tensor([[0.], [1.]]))
    assert out.flatten().tolist() == expected


def test_vectorized_and_looped_execution_agree():
    """A stateless model runs all micro-batches at once; a stateful one loops."""
    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 4)
            self.register_buffer("n", torch.zeros(()))

        def forward(self, x):
            self.n += 1
            return self.fc(x) * 1

    m = Stateful()
    x = torch.randn(16 * 3, 6)
    opts = poptorch.Options().deviceIterations(16)
    stateful = poptorch.inferenceModel(m, opts)
    plain = poptorch.inferenceModel(Linear6(), opts)
    out = stateful(x)
    plain(x)
    assert stateful._state.executable.vectorized is None
    assert plain._state.executable.vectorized is not None
    torch.testing.assert_close(out, m.fc(x).detach(), rtol=1e-5, atol=1e-6)
    stateful.copyWeightsToHost()
    assert m.n.item() == 16.0


def test_bad_batch_dimension_raises_assertion_error():
    opts = poptorch.Options().deviceIterations(4).replicationFactor(2)
    model = poptorch.inferenceModel(Linear6(), opts)
    with pytest.raises(AssertionError, match=r"\(10\).*\[10, 6\].*deviceIterations\(4\) \* "
                                             r"replicationFactor\(2\).* = 8"):
        model(torch.randn(10, 6))
    assert not model.isCompiled()
    assert model(torch.randn(16, 6)).shape == (16, 20)


def test_scalar_input_only_when_factor_is_one():
    class M(nn.Module):
        def forward(self, x):
            return x * 2

    assert poptorch.inferenceModel(M())(torch.tensor(3.)).item() == 6.0
    with pytest.raises(AssertionError, match="scalar"):
        poptorch.inferenceModel(M(), poptorch.Options().deviceIterations(2))(torch.tensor(3.))


# -- output structure (S-14) --------------------------------------------------------------

def test_dict_output_keeps_key_order_and_type():
    class M(nn.Module):
        def forward(self, x, y):
            return collections.OrderedDict(b=x + y, a=x * y)

    out = poptorch.inferenceModel(M())(torch.tensor([2.]), torch.tensor([3.]))
    assert type(out) is collections.OrderedDict
    assert list(out) == ["b", "a"]
    assert out["b"].item() == 5.0 and out["a"].item() == 6.0


def test_nested_tuple_named_tuple_and_non_tensor_leaves():
    Pair = collections.namedtuple("Pair", "left right")

    class M(nn.Module):
        def forward(self, x):
            t1 = x + 1
            return t1, (t1, x * 2, t1), Pair(x - 1, "tag"), 5, None

    out = poptorch.inferenceModel(M())(torch.tensor([1.]))
    assert out[0].item() == 2.0
    assert [t.item() for t in out[1]] == [2.0, 2.0, 2.0]
    assert isinstance(out[2], Pair) and out[2].left.item() == 0.0 and out[2].right == "tag"
    assert out[3] == 5 and out[4] is None


def test_host_tensor_output_is_returned_as_captured():
    constant = torch.tensor([42.])

    class M(nn.Module):
        def forward(self, x):
            return x + 1, constant

    with pytest.warns(UserWarning, match="Output expected to be on the IPU but is on cpu"):
        out = poptorch.inferenceModel(M())(torch.tensor([1.]))
    assert out[1] is constant


def test_outputs_cannot_be_backpropagated():
    out = poptorch.inferenceModel(Linear6())(torch.randn(2, 6))
    with pytest.raises(poptorch.Error, match="backward\\(\\) cannot be called explicitly"):
        out.backward()


# -- inputs (S-20…S-24) ------------------------------------------------------------------

class ThreeArgs(nn.Module):
    def forward(self, x, y=None, z=None):
        return x + (z if z is not None else 0)


def test_keyword_arguments_are_normalised():
    model = poptorch.inferenceModel(ThreeArgs())
    assert model(torch.ones(2), z=torch.ones(2)).tolist() == [2.0, 2.0]
    assert model(x=torch.ones(2), z=torch.full((2,), 2.0)).tolist() == [3.0, 3.0]


@pytest.mark.parametrize("call,exc,match", [
    (lambda m: m(torch.ones(2), None, None, None), AssertionError, "Too many arguments"),
    (lambda m: m(torch.ones(2), w=1), AssertionError,
     r"w is not a valid parameter\.Allowed values are \['x', 'y', 'z'\]"),
    (lambda m: m(torch.ones(2), x=torch.ones(2)), AssertionError,
     "Parameter x was passed more than once"),
    (lambda m: m(), poptorch.Error, "Mandatory parameter x missing"),
])
def test_argument_binding_errors(call, exc, match):
    model = poptorch.inferenceModel(ThreeArgs())
    with pytest.raises(exc, match=match):
        call(model)
    assert not model.isCompiled()


def test_nested_inputs_and_variadic_forward():
    class M(nn.Module):
        def forward(self, pair, mapping, *rest, scale=1.0):
            return (pair[0] + pair[1] + mapping["a"] - mapping["b"] + sum(rest)) * scale

    model = poptorch.inferenceModel(M())
    args = ((torch.ones(2), torch.ones(2)), {"a": torch.ones(2), "b": torch.zeros(2)},
            torch.ones(2))
    assert model(*args, scale=2.0).tolist() == [8.0, 8.0]
    # dict key order does not matter
    assert model(args[0], {"b": torch.zeros(2), "a": torch.ones(2)}, args[2],
                 scale=2.0).tolist() == [8.0, 8.0]
    with pytest.raises(poptorch.Error, match="Value mismatch for scale: expected 2.0 but "
                                             "got 3.0"):
        model(*args, scale=3.0)
    with pytest.raises(poptorch.Error, match=r"Shape mismatch for \*rest\[0\]"):
        model(args[0], args[1], torch.ones(3), scale=2.0)
    with pytest.raises(poptorch.Error, match=r"Keys mismatch for mapping"):
        model(args[0], {"a": torch.ones(2)}, args[2], scale=2.0)
    with pytest.raises(poptorch.Error, match=r"Length mismatch for pair: expected 2 "
                                             "elements but got 3"):
        model((torch.ones(2),) * 3, args[1], args[2], scale=2.0)
    with pytest.raises(poptorch.Error, match=r"Type mismatch for pair: expected tuple but "
                                             "got list"):
        model(list(args[0]), args[1], args[2], scale=2.0)
    with pytest.raises(poptorch.Error, match="Number of positional arguments mismatch"):
        model(args[0], args[1], scale=2.0)


def test_non_tensor_argument_is_a_compile_time_constant():
    class M(nn.Module):
        def forward(self, a, b, u=3):
            return a + b * u

    model = poptorch.inferenceModel(M())
    assert model(torch.ones(1), torch.ones(1), u=5).item() == 6.0
    with pytest.raises(poptorch.Error, match="Value mismatch for u: expected 5 but got 3."):
        model(torch.ones(1), torch.ones(1), u=3)


def test_changed_dtype_or_shape_raises_until_destroy():
    class M(nn.Module):
        def forward(self, a, b):
            return a + b

    model = poptorch.inferenceModel(M())
    model(torch.tensor([1.]), torch.tensor([2.]))
    with pytest.raises(poptorch.Error, match="Data type mismatch for a: expected "
                                             "torch.float32 but got torch.int64"):
        model(torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(poptorch.Error, match=r"Shape mismatch for a: expected "
                                             r"torch.Size\(\[1\]\) but got torch.Size\(\[2\]\)"):
        model(torch.tensor([1., 1.]), torch.tensor([2., 2.]))
    with pytest.raises(poptorch.Error, match="destroy"):
        model(torch.tensor([1., 1.]), torch.tensor([2., 2.]))
    assert model(torch.tensor([1.]), torch.tensor([5.])).item() == 6.0  # still usable
    model.destroy()
    assert not model.isCompiled()
    out = model(torch.tensor([1, 2]), torch.tensor([3, 4]))
    assert out.tolist() == [4, 6] and out.dtype == torch.int32


def test_none_versus_tensor_is_a_type_mismatch():
    model = poptorch.inferenceModel(ThreeArgs())
    model(torch.ones(2), None, None)
    with pytest.raises(poptorch.Error, match="Type mismatch for z"):
        model(torch.ones(2), None, torch.ones(2))


def test_nested_in_place_updates_are_written_back():
    class M(nn.Module):
        def forward(self, inputs):
            inputs[0].add_(1)
            inputs[1]["k"].mul_(2)
            return inputs[0] * 1

    a, b = torch.tensor([1.]), torch.tensor([3.])
    model = poptorch.inferenceModel(M())
    model([a, {"k": b}])
    model([a, {"k": b}])
    assert a.item() == 3.0 and b.item() == 12.0


def test_non_contiguous_and_requires_grad_inputs(poptorch_logs):
    m = Linear6()
    x = torch.randn(6, 4).t()
    assert not x.is_contiguous()
    model = poptorch.inferenceModel(m)
    torch.testing.assert_close(model(x), m(x).detach())
    assert "not contiguous" in poptorch_logs.text
    y = torch.randn(4, 6, requires_grad=True)
    torch.testing.assert_close(model(y), m(y).detach())
    assert "requires_grad=True" in poptorch_logs.text


def test_data_dependent_control_flow_names_the_line_and_points_to_cond():
    class M(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent
                return x * 2
            return x

    model = poptorch.inferenceModel(M())
    with pytest.raises(poptorch.Error) as info:
        model(torch.ones(2))
    message = str(info.value)
    assert "test_inference.py" in message and "if x.sum() > 0:" in message
    assert "poptorch.cond" in message
    assert not model.isCompiled()


def test_cond_expresses_data_dependent_choice():
    class M(nn.Module):
        def forward(self, x):
            return poptorch.cond(x.sum() > 0, lambda a: a * 2, [x], lambda a: a - 1, [x])[0]

    model = poptorch.inferenceModel(M())
    assert model(torch.ones(2)).tolist() == [2.0, 2.0]
    assert model(-torch.ones(2)).tolist() == [-2.0, -2.0]
    assert M()(torch.ones(2)).tolist() == [2.0, 2.0]  # genuine if/else on the CPU


# -- dtypes (S-44, S-45, S-47) ----------------------------------------------------------------

def test_64_bit_outputs_come_back_as_32_bit():
    class M(nn.Module):
        def forward(self, x, y):
            return (x + y).type(torch.float64), torch.arange(3), x.long()

    out = poptorch.inferenceModel(M())(torch.ones(1), torch.ones(1))
    assert [t.dtype for t in out] == [torch.float32, torch.int32, torch.int32]
    assert out[0].item() == 2.0 and out[1].tolist() == [0, 1, 2]


def test_64_bit_inputs_and_parameters():
    m = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    model = poptorch.inferenceModel(m)
    out = model(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, m(x).float().detach(), rtol=1e-5, atol=1e-6)
    assert m.weight.dtype == torch.float64  # host keeps its dtype
    ints = poptorch.inferenceModel(nn.Identity())(torch.tensor([1, 2]))
    assert ints.dtype == torch.int32 and ints.tolist() == [1, 2]


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16,
                                   torch.int32, torch.float16, torch.float32])
def test_other_dtypes_pass_through(dtype):
    x = torch.tensor([1, 0, 1]).to(dtype)
    out = poptorch.inferenceModel(nn.Identity())(x)
    assert out.dtype == dtype and torch.equal(out, x)


def test_half_model_keeps_half_outputs():
    m = nn.Linear(1, 10).half()
    out = poptorch.inferenceModel(m)(torch.ones(1, 1, dtype=torch.half))
    assert out.dtype == torch.float16


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "BFloat16"),
                                        (torch.complex64, "ComplexFloat")])
def test_unsupported_input_dtype(dtype, name):
    model = poptorch.inferenceModel(nn.Identity())
    with pytest.raises(poptorch.Error, match=f"Unsupported tensor input type from pytorch: "
                                             f"{name}"):
        model(torch.ones(2, dtype=dtype))
    assert not model.isCompiled()
    assert model(torch.ones(2)).tolist() == [1.0, 1.0]


def test_zero_sized_inputs_are_rejected():
    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got "
                                             r"shape \[0, 2, 5, 5\]\)"):
        poptorch.inferenceModel(nn.Identity())(torch.ones(0, 2, 5, 5))


# -- weights (S-30…S-33) ------------------------------------------------------------------

def test_shallow_copy_shares_tensors_not_attributes():
    m = Linear6()
    model = poptorch.inferenceModel(m)
    m.foo = 2
    assert not hasattr(model._state.model, "foo")
    with torch.no_grad():
        m.fc.weight.fill_(0)
        m.fc.bias.fill_(1)
    assert torch.equal(model(torch.randn(2, 6)), torch.ones(2, 20))  # S-33


def test_host_changes_need_copy_weights_to_device():
    m = Linear6()
    model = poptorch.inferenceModel(m)
    x = torch.randn(2, 6)
    before = model(x)
    with torch.no_grad():
        m.fc.bias.add_(1)
    assert torch.equal(model(x), before)  # S-32
    model.copyWeightsToDevice()
    torch.testing.assert_close(model(x), before + 1)


def test_load_state_dict_through_the_executor():
    m, other = Linear6(), Linear6()
    model = poptorch.inferenceModel(m)
    x = torch.randn(2, 6)
    model(x)
    result = model.load_state_dict(other.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    torch.testing.assert_close(model(x), other(x).detach())


def test_attribute_forwarding_and_repr():
    m = Linear6()
    model = poptorch.inferenceModel(m)
    assert model.fc is m.fc
    assert torch.equal(model.forward(torch.ones(1, 6)), m(torch.ones(1, 6)))
    assert repr(model) == repr(m)
    assert model.model is m


def test_train_and_eval_flags_are_read_at_wrap_and_capture():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(x), torch.tensor(self.training)

    m = M()
    m.train()
    model = poptorch.inferenceModel(m)
    m.eval()  # the top-level flag was copied at wrap time; sub-modules are shared
    out, training = model(torch.ones(100))
    assert training.item() is True
    assert torch.equal(out, torch.ones(100))  # dropout in eval mode at capture


# -- lifecycle (api §5) -----------------------------------------------------------------

def test_lifecycle_state_machine():
    model = poptorch.inferenceModel(Linear6())
    assert not model.isCompiled() and not model.isAttachedToDevice()
    for method in (model.copyWeightsToHost, model.copyWeightsToDevice,
                   model.detachFromDevice, model.attachToDevice):
        with pytest.raises(poptorch.Error, match="Model has not been compiled or has been "
                                                 "destroyed."):
            method()
    model.compile(torch.randn(2, 6))
    assert model.isCompiled() and model.isAttachedToDevice()
    with pytest.raises(poptorch.Error, match="Device is already attached"):
        model.attachToDevice()
    model.detachFromDevice()
    assert not model.isAttachedToDevice()
    with pytest.raises(poptorch.Error, match="Device is not attached"):
        model.detachFromDevice()
    model(torch.randn(2, 6))  # re-attaches implicitly
    assert model.isAttachedToDevice()
    model.destroy()
    assert not model.isCompiled() and not model.isAttachedToDevice()
    model.destroy()  # no-op


def test_compile_twice_logs_a_warning(poptorch_logs):
    model = poptorch.inferenceModel(Linear6())
    model.compile(torch.randn(2, 6))
    model.compile(torch.randn(2, 6))
    assert "Call to compile() ignored: the executable is already compiled" in \
        poptorch_logs.text


def test_buffer_updates_are_lost_on_reattach_unless_copied():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("i", torch.zeros(()))

        def forward(self, x):
            self.i += 1
            return self.i + 0 * x

    model = poptorch.inferenceModel(M())
    model(torch.zeros(()))
    model(torch.zeros(()))
    model.detachFromDevice()
    model.attachToDevice()
    assert model(torch.zeros(())).item() == 1.0


def test_invalid_options_type():
    with pytest.raises(poptorch.Error, match="Invalid type: 'options' is of type"):
        poptorch.inferenceModel(Linear6(), options={"deviceIterations": 2})


def test_options_passed_are_frozen_and_cloned():
    opts = poptorch.Options().deviceIterations(2)
    model = poptorch.inferenceModel(Linear6(), opts)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.deviceIterations(3)
    assert model.options is not opts and model.options.device_iterations == 2


def test_gradient_accumulation_is_rejected_for_inference():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match="gradientAccumulation to 1.*deviceIterations"):
        poptorch.inferenceModel(Linear6(), opts)


def test_wrapping_an_executor_uses_its_model():
    m = Linear6()
    first = poptorch.inferenceModel(m)
    second = poptorch.inferenceModel(first)
    assert second.model is m


def test_hardware_helpers():
    assert poptorch.ipuHardwareIsAvailable() is False
    assert poptorch.ipuHardwareIsAvailable(4) is False
    with pytest.raises(AssertionError, match="No IPU hardware available on this system"):
        poptorch.ipuHardwareVersion()


def test_physical_ipus_cannot_be_acquired():
    opts = poptorch.Options().useIpuModel(False)
    model = poptorch.inferenceModel(Linear6(), opts)
    with pytest.raises(poptorch.Error, match=r"Failed to acquire 1 IPU\(s\)"):
        model(torch.randn(1, 6))


def test_offline_model_cannot_run():
    opts = poptorch.Options().useOfflineIpuTarget()
    model = poptorch.inferenceModel(Linear6(), opts)
    with pytest.raises(AssertionError, match="Trying to run a model on an offline device"):
        model(torch.randn(1, 6))
    model.compile(torch.randn(1, 6))
    assert model.isCompiled() and not model.isAttachedToDevice()
    with pytest.raises(AssertionError, match=r"offline device \(ConnectionType.Never\)"):
        model.attachToDevice()


def test_cycle_count_is_the_ipu_model_estimate():
    # Beyond PopTorch (whose IPU Model refuses logCycleCount): the estimate of the run.
    opts = poptorch.Options().logCycleCount(True)
    model = poptorch.inferenceModel(Linear6(), opts)
    model.compile(torch.randn(1, 6))
    with pytest.raises(poptorch.Error, match="run the model at least once"):
        model.cycleCount()
    model(torch.randn(1, 6))
    assert model.cycleCount() == model.ipuModelEstimate()["cycles"]["run"] > 0
    model = poptorch.inferenceModel(Linear6())
    with pytest.raises(poptorch.Error, match="Cycle count logging is disabled"):
        model.cycleCount()


def test_compilation_time_and_perf_counters():
    model = poptorch.inferenceModel(Linear6())
    with pytest.raises(poptorch.Error, match="compile the model before obtaining "
                                             "compilation time"):
        model.compilationTime()
    assert model.getPerfCounters()["input"] == [[]]
    model(torch.randn(2, 6))
    assert model.compilationTime().total_seconds() > 0
    counters = model.getPerfCounters()
    assert set(counters) == {"input", "input_complete", "output", "output_complete"}
    low, high, mean = model.getLatency()
    assert 0 <= low <= mean <= high
    quiet = poptorch.inferenceModel(Linear6(),
                                    poptorch.Options().showCompilationProgressBar(False))
    quiet(torch.randn(2, 6))
    with pytest.raises(poptorch.Error, match="set showCompilationProgressBar option"):
        quiet.compilationTime()


def test_tensor_names_and_activation_anchor():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

        def forward(self, x):
            return self.layer(x) * 2

    m = M()
    probe = poptorch.inferenceModel(m)
    with pytest.raises(AssertionError, match="Model must be compiled before calling "
                                             "getTensorNames"):
        probe.getTensorNames()
    probe(torch.randn(2, 4))
    names = probe.getTensorNames()
    assert "layer.0.weight" in names and "layer/0/Linear:0" in names
    opts = poptorch.Options().deviceIterations(2)
    opts.anchorTensor("hidden", "layer/0/Linear:0")
    model = poptorch.inferenceModel(m, opts)
    with pytest.raises(AssertionError, match="No tensor with name hidden found."):
        model.getAnchoredTensor("hidden")
    x = torch.randn(4, 4)
    model(x)
    torch.testing.assert_close(model.getAnchoredTensor("hidden"), m.layer[0](x).detach())


def test_error_attributes():
    try:
        poptorch.inferenceModel(Linear6(), options=3)
    except poptorch.Error as e:
        assert e.type == "poptorch_py_error" and e.location == ""
        assert str(e) == f"'poptorch_py_error': {e.message}"
    else:
        pytest.fail("no error")
    assert issubclass(poptorch.RecoverableError, poptorch.Error)
    assert issubclass(poptorch.UnrecoverableError, poptorch.Error)
    err = poptorch.RecoverableError("link lost", recovery_action="LINK_RESET")
    assert err.recovery_action == "LINK_RESET" and "Recovery action required: LINK_RESET" \
        in str(err)


def test_model_selection_logs(poptorch_logs):
    model = poptorch.inferenceModel(Linear6(), poptorch.Options().useIpuModel(True))
    model(torch.randn(1, 6))
    assert "From the user configuration: Ipu model: Enabled" in poptorch_logs.text


def test_deep_copy_of_model_is_independent():
    m = Linear6()
    copied = copy.deepcopy(m)
    model = poptorch.inferenceModel(copied)
    x = torch.randn(2, 6)
    torch.testing.assert_close(model(x), m(x).detach())


def test_in_place_update_of_a_converted_input_is_written_back():
    """A float64 input reaches the device as a float32 copy; the update still comes back."""
    class M(nn.Module):
        def forward(self, x):
            x.mul_(2)
            return x + 0

    t = torch.tensor([1.5, 2.0], dtype=torch.float64)
    model = poptorch.inferenceModel(M())
    out = model(t)
    assert out.dtype == torch.float32 and out.tolist() == [3.0, 4.0]
    assert t.dtype == torch.float64 and t.tolist() == [3.0, 4.0]


@pytest.mark.parametrize("iterations", [1, 2])
def test_data_dependent_output_shapes_are_rejected(iterations):
    """Found by a user: x[x > 0] ran with deviceIterations 1 (shape changing from call to
    call) and failed with a raw RuntimeError with 2."""
    class M(nn.Module):
        def forward(self, x):
            return x[x > 0] * 2

    model = poptorch.inferenceModel(M(), poptorch.Options().deviceIterations(iterations))
    with pytest.raises(poptorch.Error) as info:
        model(torch.ones(iterations, 2))
    message = str(info.value)
    assert "shape depends on tensor values" in message
    assert "return x[x > 0] * 2" in message and "torch.where" in message
    assert not model.isCompiled()


def test_wrapped_model_inside_another_forward_is_rejected():
    """Found by a user: it failed deep inside torch.export with an AssertionError."""
    inner = poptorch.inferenceModel(nn.Linear(2, 2))

    class Outer(nn.Module):
        def forward(self, x):
            return inner(x) + 1

    outer = poptorch.inferenceModel(Outer())
    with pytest.raises(poptorch.Error, match="cannot be called inside the forward of "
                                             "another wrapped model"):
        outer(torch.ones(1, 2))
    assert not outer.isCompiled()


def test_executor_copy_gives_a_clear_error():
    model = poptorch.inferenceModel(Linear6())
    model(torch.randn(1, 6))
    with pytest.raises(poptorch.Error, match="cannot be copied"):
        copy.deepcopy(model)
    assert model(torch.randn(1, 6)).shape == (1, 20)  # still usable


def test_zero_sized_outputs_are_rejected():
    class M(nn.Module):
        def forward(self, x):
            return x + 1, torch.zeros(0, 2, 5, 5, device="ipu")

    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got "
                                             r"shape \[0, 2, 5, 5\]\)"):
        poptorch.inferenceModel(M())(torch.ones(1))


def test_shallow_copies_of_executors_are_refused_and_pickles_store_the_model():
    """Found by a user: copy.copy(executor) shared the device weights without the host
    synchronisation. Pickling (torch.save(executor), PopTorch's test_block_function_
    saving) stores the wrapped model with its weights."""
    import pickle
    user = Linear6()
    model = poptorch.inferenceModel(user)
    model(torch.randn(1, 6))
    with pytest.raises(poptorch.Error, match="cannot be copied"):
        copy.copy(model)
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded) is Linear6
    for (name, a), b in zip(loaded.state_dict().items(), user.state_dict().values()):
        assert torch.equal(a, b), name
