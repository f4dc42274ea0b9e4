"""Regressions found by a fresh-user attack on the inductor warm-up (issue 11) and the
executor / optimizer refactor."""
import copy
import gc

import pytest
import torch
import torch.nn as nn

import poptorch
from popart_compiler.backends import inductor as inductor_backend


class _Inverse(nn.Module):
    def forward(self, x):
        return torch.linalg.inv(x) * 2


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_inductor_warm_up_on_zero_inputs_does_not_fail_a_valid_model():
    """The warm-up runs the compiled kernels on zero inputs; a model that raises on
    those (``linalg.inv`` of a zero matrix is singular) but not on the user's inputs
    compiles and runs, and a kernel error of a real run is PyTorch's own error (not
    Dynamo's "Attempt to trace generator"), as on the eager backend."""
    x = torch.eye(3).expand(2, 3, 3) * torch.tensor([2.0, 4.0])[:, None, None]
    opts = poptorch.Options()
    opts.Backend.compiler("inductor")
    model = poptorch.inferenceModel(_Inverse(), opts)
    before = inductor_backend.compile_count()
    model.compile(x)
    assert inductor_backend.compile_count() == before + 1
    torch.testing.assert_close(model(x), torch.linalg.inv(x) * 2)
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        model(torch.zeros(2, 3, 3))
    torch.testing.assert_close(model(x * 2), torch.linalg.inv(x * 2) * 2)
    assert inductor_backend.compile_count() == before + 1


class _HostWork(nn.Module):
    def __init__(self, calls):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cpu = poptorch.CPU(lambda x: calls.append(x.clone()) or x * 2, "host")

    def forward(self, x):
        return self.cpu(poptorch.ipu_print_tensor(self.fc(x), "hval"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_inductor_warm_up_does_not_run_host_ops(capfd):
    """``compile()`` with the inductor compiler calls a ``poptorch.CPU`` function and
    prints an ``ipu_print_tensor`` exactly as the eager backend does: the host function
    once (the capture's example call), no print; the warm-up's trial run on zeros would
    add a host call and a print of made-up values, so such programs compile their
    kernels at the first run."""
    calls = []
    model = _HostWork(calls)
    x = torch.ones(2, 4)
    opts = poptorch.Options()
    opts.Backend.compiler("inductor")
    inference = poptorch.inferenceModel(model, opts)
    before = inductor_backend.compile_count()
    capfd.readouterr()
    inference.compile(x)
    assert len(calls) == 1 and "hval:" not in capfd.readouterr().err
    out = inference(x)
    assert inductor_backend.compile_count() == before + 1
    assert len(calls) == 2 and capfd.readouterr().err.count("hval:") == 1
    torch.testing.assert_close(calls[1], model.fc(x).detach())
    torch.testing.assert_close(out, model.fc(x).detach() * 2)


class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, y=None):
        out = self.fc(x)
        return out if y is None else (out, nn.functional.cross_entropy(out, y))


@pytest.mark.parametrize("drop", ["destroy", "garbage_collect"])
def test_inference_sees_weights_of_a_second_trainer_of_the_model(drop):
    """S-31: an inference wrapper uploads the trained weights of whichever trainer wraps
    its model now. A second ``trainingModel`` of the model (after the first one was
    destroyed or freed) counts its host copies from 1 again; its first copy must not be
    taken for the first trainer's copy that the inference wrapper already uploaded."""
    torch.manual_seed(0)
    model = _Classifier()
    ref = copy.deepcopy(model)
    xs, ys, probe = torch.randn(2, 4, 6), torch.randint(0, 3, (2, 4)), torch.randn(4, 6)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    expected = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        ref(x, y)[1].backward()
        opt.step()
        expected.append(ref(probe).detach())

    def trainer():
        return poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(),
                                                                       lr=0.1))
    inference = poptorch.inferenceModel(model)
    first = trainer()
    first(xs[0], ys[0])
    torch.testing.assert_close(inference(probe), expected[0])
    if drop == "destroy":
        first.destroy()
    else:
        del first
        gc.collect()
    second = trainer()
    second(xs[1], ys[1])
    torch.testing.assert_close(inference(probe), expected[1])


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
    """S-14: outputs are fresh tensors. A returned parameter or input is a copy:
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
