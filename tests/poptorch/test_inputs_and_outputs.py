"""Inputs and outputs of a wrapped model (docs/semantics.md S-14, S-20…S-24): output structures,
fresh output tensors, keyword and nested arguments, non-tensor arguments as compile-time
constants, the input signature checks and in-place updates written back."""
import collections
import copy

import pytest
import torch
import torch.nn as nn

import poptorch
from models import SingleLinear


# -- output structure (docs/semantics.md S-14)
# -----------------------------------------------------------

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
    out = poptorch.inferenceModel(SingleLinear())(torch.randn(2, 6))
    with pytest.raises(poptorch.Error, match="backward\\(\\) cannot be called explicitly"):
        out.backward()
    with pytest.raises(poptorch.Error) as info:
        out.backward()
    assert "If you're using a trainingModel, the backwards pass is performed " \
        "automatically when invoking the model." in str(info.value)  # PopTorch 3.x's words


class _ReturnsState(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y=None):
        out = self.fc(x)
        if y is None:
            return out, self.fc.weight, x
        return out, nn.functional.mse_loss(out, y), self.fc.weight, x


@pytest.mark.parametrize("iterations", [1, 2])
def test_inference_outputs_are_fresh_tensors(iterations):
    """docs/semantics.md S-14: outputs are fresh tensors. A returned parameter or input is a copy:
    writing to it changes neither the device weights (the next call) nor the caller's
    input (one device iteration runs the graph directly, two run it vectorized)."""
    torch.manual_seed(0)
    model = _ReturnsState()
    weight = model.fc.weight.detach().clone()
    inference = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(iterations))
    x = torch.randn(2 * iterations, 4)
    x_before = x.clone()
    out, w, same_x = inference(x)
    w.add_(100.0)
    same_x.add_(5.0)
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)
    out2, w2, _ = inference(x)
    torch.testing.assert_close(w2[:4], weight, rtol=0, atol=0)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_training_outputs_hold_the_forward_values_of_each_iteration():
    """A training output that is a parameter holds its value in that iteration's
    forward pass, not the value after the optimizer step (nor the final one)."""
    torch.manual_seed(0)
    model = _ReturnsState()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.All)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(),
                                                                   lr=0.1))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    _, _, w, same_x = training(x, y)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    expected = []
    for i in range(2):
        expected.append(ref.fc.weight.detach().clone())
        opt.zero_grad()
        ref(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2])[1].backward()
        opt.step()
    torch.testing.assert_close(w, torch.cat(expected))
    same_x.add_(1.0)
    training.copyWeightsToHost()
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)


# -- inputs (docs/semantics.md S-20…S-24)
# ----------------------------------------------------------------

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


def test_non_contiguous_and_requires_grad_inputs(poptorch_logs):
    m = SingleLinear()
    x = torch.randn(6, 4).t()
    assert not x.is_contiguous()
    model = poptorch.inferenceModel(m)
    torch.testing.assert_close(model(x), m(x).detach())
    assert "not contiguous" in poptorch_logs.text
    y = torch.randn(4, 6, requires_grad=True)
    torch.testing.assert_close(model(y), m(y).detach())
    assert "requires_grad=True" in poptorch_logs.text
