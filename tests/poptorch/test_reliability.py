"""Every call is all-or-nothing (docs/semantics.md S-73): an error or a Ctrl-C during a run leaves
device weights, optimizer state, buffers, RNG and the host view as before the call; a failed first
call commits no compilation; Ctrl-C during capture is deferred; a retry sees the user's fixes to the
module's containers."""
import contextlib
import copy
import signal
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from models import BNClassifier


class DeepMLP(nn.Module):
    """12 linear layers: the optimizer updates them one after the other."""

    def __init__(self, width=8, layers=12):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, F.mse_loss(x, y)


def device_state(training):
    session = training._state.session
    weights = {k: v.clone() for k, v in session.readWeights().items()}
    state = {k: v.clone() for k, v in session.readOptimizerState().items()}
    return weights, state


def assert_state(actual, expected, exact=True):
    """Exact, or equal to PyTorch within float tolerance."""
    for a, e in zip(actual, expected):
        assert a.keys() == e.keys()
        for k in a:
            if exact:
                assert torch.equal(a[k], e[k]), k
            else:
                torch.testing.assert_close(a[k], e[k], rtol=1e-5, atol=1e-6, msg=k)


def torch_steps(model, optimizer, x, y, micro_batches):
    """Plain PyTorch: one optimizer step per micro-batch."""
    b = x.shape[0] // micro_batches
    for i in range(micro_batches):
        optimizer.zero_grad()
        _, loss = model(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])
        loss.backward()
        optimizer.step()


def test_error_in_second_device_iteration_changes_nothing():
    """Issue 14 item 1: deviceIterations(2), an out-of-range label in the second
    micro-batch → IndexError; weights, momentum, BatchNorm statistics and the host view
    are as before; the next valid call equals PyTorch."""
    model = BNClassifier()
    reference = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(2)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, opts, optimizer)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 4)
    y = torch.tensor([0, 1, 2, 1])
    training(x, y)
    torch_steps(reference, ref_opt, x, y, 2)
    before = device_state(training)
    host_before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(IndexError):
        training(x, torch.tensor([0, 1, 7, 1]))
    assert_state(device_state(training), before)
    for k, v in model.state_dict().items():
        assert torch.equal(v, host_before[k]), k
    training(x, y)
    torch_steps(reference, ref_opt, x, y, 2)
    for (name, p), (_, q) in zip(model.state_dict().items(),
                                 reference.state_dict().items()):
        torch.testing.assert_close(p.float(), q.float(), rtol=1e-5, atol=1e-6, msg=name)


def test_inference_error_leaves_buffers_and_rng():
    """A failing inference call rolls back mutated buffers and the device RNG."""
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(1))

        def forward(self, x, index):
            self.count += 1
            noise = torch.rand(3)
            return x[index] + noise + self.count

    model = Counter()
    inference = poptorch.inferenceModel(model, poptorch.Options().randomSeed(5))
    x = torch.zeros(3)
    first = inference(x, torch.tensor([0, 1, 2]))
    rng = inference.rng_state
    with pytest.raises(IndexError):
        inference(x, torch.tensor([0, 1, 9]))
    assert inference.rng_state == rng
    assert torch.equal(inference._state.session.readWeights()["count"], torch.tensor([1.0]))
    second = inference(x, torch.tensor([0, 1, 2]))
    assert torch.equal(inference._state.session.readWeights()["count"], torch.tensor([2.0]))
    assert not torch.equal(first, second)


def _interrupt_after(delay):
    """A timer that sends SIGINT to the main thread (not to any thread of the process,
    as os.kill would) after ``delay`` seconds."""
    timer = threading.Timer(delay, signal.pthread_kill,
                            (threading.main_thread().ident, signal.SIGINT))
    timer.daemon = True
    return timer


def _deliver_pending(timer):
    """Let the timer's SIGINT arrive inside this guarded region, whenever it comes."""
    with pytest.raises(KeyboardInterrupt):
        timer.join(timeout=60)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)


@pytest.mark.slow
def test_sigint_during_training_calls_never_half_updates(default_sigint):
    """Issue 14 item 2: SIGINT during a long momentum-SGD call on a 12-layer MLP leaves
    weights and momentum together from one step (before the call, or after it if the
    signal came late); the executor stays usable and equals PyTorch; destroy() then
    hands the device's weights to the host."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    iterations = 200
    torch.manual_seed(0)
    model = DeepMLP()
    reference = copy.deepcopy(model)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    training = poptorch.trainingModel(
        model, poptorch.Options().deviceIterations(iterations), optimizer)
    x = torch.randn(iterations * 2, 8)
    y = torch.randn(iterations * 2, 8).clamp(-0.9, 0.9)
    start = time.perf_counter()
    training(x, y)
    duration = time.perf_counter() - start
    torch_steps(reference, ref_opt, x, y, iterations)
    for trial in range(4):
        before = device_state(training)
        twin_model, twin_opt = copy.deepcopy((reference, ref_opt))
        timer = _interrupt_after(duration * (0.2 + 0.2 * trial))
        timer.start()
        finished = False
        with contextlib.suppress(KeyboardInterrupt):  # interrupted: checked below
            training(x, y)
            finished = True
        if finished:
            _deliver_pending(timer)
        timer.join(timeout=60)
        after = device_state(training)
        torch_steps(twin_model, twin_opt, x, y, iterations)
        if all(torch.equal(after[0][k], before[0][k]) for k in after[0]):
            assert_state(after, before)  # rolled back: momentum too
        else:  # the call completed: everything from the new step
            reference, ref_opt = twin_model, twin_opt
            expected = {k: v.detach() for k, v in reference.state_dict().items()}
            assert_state((after[0],), (expected,), exact=False)
    training(x, y)
    torch_steps(reference, ref_opt, x, y, iterations)
    device = device_state(training)[0]
    training.destroy()
    for (name, p), (_, q) in zip(model.state_dict().items(),
                                 reference.state_dict().items()):
        assert torch.equal(p, device[name]), name  # destroy() handed them over
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_keyboard_interrupt_in_run_rolls_back(monkeypatch, default_sigint):
    """A SIGINT delivered in the middle of a run (the second of two weight updates,
    after the first was applied) restores weights and optimizer state exactly."""
    model = DeepMLP(layers=3)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    training = poptorch.trainingModel(model, poptorch.Options().deviceIterations(2),
                                      optimizer)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    training(x, y)
    before = device_state(training)
    device_opt = training._state.session.optimizer
    real_step = type(device_opt).finish_step
    calls = []

    def interrupted_step(self, params):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)  # delivered to this thread at once
            time.sleep(60)  # the handler raises KeyboardInterrupt by now
        return real_step(self, params)

    monkeypatch.setattr(type(device_opt), "finish_step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        training(x, y)
    monkeypatch.undo()
    assert_state(device_state(training), before)
    assert training.isCompiled()
    training(x, y)


def test_sigint_during_capture_is_deferred(default_sigint):
    """Issue 14 item 2: a SIGINT during torch.export (sent from inside forward, ten
    times in one process) is raised as KeyboardInterrupt after the capture; the
    process survives and the executor compiles and runs afterwards."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    interrupt = {"on": True}

    class Interrupting(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            x = self.fc(x)
            if interrupt["on"]:
                signal.raise_signal(signal.SIGINT)
            return torch.relu(self.fc(x))

    model = Interrupting()
    inference = poptorch.inferenceModel(model)
    x = torch.randn(2, 4)
    for _ in range(10):
        with pytest.raises(KeyboardInterrupt):
            inference(x)
        assert not inference.isCompiled()
        assert not poptorch.isRunningOnIpu()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    interrupt["on"] = False
    torch.testing.assert_close(inference(x), torch.relu(model.fc(model.fc(x))))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_failed_first_call_does_not_freeze_the_signature(dtype):
    """Issue 14 item 5: a first call with the wrong dtype fails, commits nothing, and
    the next float32 call compiles and equals PyTorch. (A float16 ``x`` into a float32
    ``Linear`` is not an error: it computes in float16, docs/semantics.md S-45's master-weight rule;
    see test_master_weights.py.)"""
    model = nn.Linear(4, 3)
    inference = poptorch.inferenceModel(model)
    bad = torch.ones(2, 4, dtype=dtype)
    with pytest.raises(Exception) as info:
        inference(bad)
    assert "Data type mismatch" not in str(info.value)
    assert not inference.isCompiled()
    x = torch.randn(2, 4)
    torch.testing.assert_close(inference(x), model(x))
    assert inference.isCompiled()


def test_failed_first_training_call_then_valid_call_equals_pytorch():
    model = BNClassifier()
    reference = copy.deepcopy(model)
    training = poptorch.trainingModel(
        model, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    with pytest.raises(IndexError):
        training(x, torch.tensor([0, 5]))
    assert not training.isCompiled()
    training(x, y)
    torch_steps(reference, ref_opt, x, y, 1)
    torch.testing.assert_close(model.fc.weight.detach(), reference.fc.weight.detach())


def test_retry_sees_fixes_to_module_containers():
    """Issue 14 item 6: after a failed first call the wrapper's dict / list attributes
    are still the user's objects, so a fix made to them is seen by the retry."""
    class Configured(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.cfg = {"double": False}
            self.scales = [1.0]

        def forward(self, x):
            out = self.fc(x) * self.scales[0]
            return out * 2 if self.cfg["double"] else out

    model = Configured()
    cfg, scales = model.cfg, model.scales
    inference = poptorch.inferenceModel(model)
    with pytest.raises(RuntimeError):
        inference(torch.ones(2, 4, dtype=torch.int64))
    assert inference.cfg is cfg and inference.scales is scales
    assert model.cfg is cfg
    model.cfg["double"] = True
    model.scales[0] = 3.0
    x = torch.randn(2, 4)
    torch.testing.assert_close(inference(x), model.fc(x) * 6)
