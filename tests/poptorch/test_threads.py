"""Executors used from several threads (issue 14 item 3): captures are serialised,
"inside a model" is per thread, sys.stderr is never left redirected, each executor runs
one call at a time, and host weights read in any thread are the latest ones; compiling
holds the trace lock, running compiled code does not (issue 11). Every thread is joined
with a generous timeout; assertions are on values, not timing."""
import copy
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import poptorch
from poptorch._capture import guard
from popart_compiler.backends import inductor as inductor_backend
from popart_compiler.backends.tracing import TRACE_LOCK
from models import Classifier

TIMEOUT = 300


def run_threads(*targets):
    """Run each callable in its own thread; re-raise the first failure."""
    errors = []

    def wrap(fn):
        def body():
            try:
                fn()
            except BaseException as exc:  # reported to the test's thread
                errors.append(exc)
        return body

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
        assert not t.is_alive(), "thread did not finish"
    if errors:
        raise errors[0]


def no_bar():
    return poptorch.Options().showCompilationProgressBar(False)


def test_calls_in_one_thread_while_another_compiles():
    """A compiled executor keeps working in one thread while other models compile in
    another (no "cannot be called inside the forward" error)."""
    running = poptorch.inferenceModel(Classifier((6, 8, 3)), no_bar())
    x = torch.randn(4, 6)
    expected = running.model(x)
    running(x)
    stop = threading.Event()
    results = []

    def caller():
        while not stop.is_set() or len(results) < 5:
            results.append(running(x))

    def compiler():
        try:
            for _ in range(3):
                model = Classifier((6, 8, 3))
                other = poptorch.inferenceModel(model, no_bar())
                torch.testing.assert_close(other(x), model(x))
        finally:
            stop.set()

    run_threads(caller, compiler)
    assert len(results) >= 5
    for out in results:
        torch.testing.assert_close(out, expected)
    assert not poptorch.isRunningOnIpu()


def test_concurrent_compiles_succeed_and_restore_stderr():
    stderr = sys.stderr
    models = [Classifier((6, 8, 3)) for _ in range(4)]
    executors = [poptorch.inferenceModel(m, no_bar()) for m in models]
    x = torch.randn(2, 6)
    run_threads(*[lambda e=e: e.compile(x) for e in executors])
    assert sys.stderr is stderr
    assert not poptorch.isRunningOnIpu()
    for model, executor in zip(models, executors):
        assert executor.isCompiled()
        torch.testing.assert_close(executor(x), model(x))


def test_one_training_model_called_from_two_threads_equals_pytorch():
    """Calls of one executor never interleave: 2 threads × 6 calls on the same batch
    are 12 whole steps, as in PyTorch."""
    model = Classifier((6, 8, 3))
    reference = copy.deepcopy(model)
    training = poptorch.trainingModel(
        model, no_bar(), poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 1])
    training.compile(x, y)

    def worker():
        for _ in range(6):
            training(x, y)

    run_threads(worker, worker)
    for _ in range(12):
        ref_opt.zero_grad()
        reference(x, y)[1].backward()
        ref_opt.step()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_two_training_executors_in_two_threads_read_fresh_host_weights():
    """Each thread trains its own model and reads its host weights after every call:
    always the device's latest values (the implicit copy is per thread)."""
    def trainer(seed):
        def body():
            torch.manual_seed(seed)
            model = Classifier((6, 8, 3))
            reference = copy.deepcopy(model)
            training = poptorch.trainingModel(
                model, no_bar(), poptorch.optim.SGD(model.parameters(), lr=0.1))
            ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(seed)
            for _ in range(15):
                x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
                training(x, y)
                ref_opt.zero_grad()
                reference(x, y)[1].backward()
                ref_opt.step()
                torch.testing.assert_close(model.fc1.weight.detach(),
                                           reference.fc1.weight.detach(),
                                           rtol=1e-5, atol=1e-6)
        return body

    run_threads(trainer(1), trainer(2))


def test_nested_call_inside_forward_still_rejected():
    """The per-thread flag still catches a wrapped model called inside another's
    forward."""
    inner = poptorch.inferenceModel(nn.Linear(6, 6), no_bar())

    class Outer(nn.Module):
        def forward(self, x):
            return inner(x)

    outer = poptorch.inferenceModel(Outer(), no_bar())
    with pytest.raises(poptorch.Error, match="cannot be called inside the forward"):
        outer(torch.randn(2, 6))
    assert not poptorch.isRunningOnIpu()


def test_capture_holds_back_only_the_capturing_threads_stderr(capsys):
    """During a capture, what the capturing thread writes to stderr is held back;
    other threads keep writing to the real stream."""
    import io

    from poptorch._capture.guard import capture_guard, thread_stderr
    held = io.StringIO()
    real = sys.stderr
    with capture_guard(), thread_stderr(held):
        print("from the capture", file=sys.stderr)
        other = threading.Thread(target=lambda: print("from another thread",
                                                      file=sys.stderr))
        other.start()
        other.join(timeout=TIMEOUT)
    assert sys.stderr is real
    assert held.getvalue() == "from the capture\n"
    assert "from another thread" in capsys.readouterr().err


# -- the trace lock and the first compiles of a fresh process --------------------------

def _add_one(x):
    return (x + 1,)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_compiling_holds_the_trace_lock_and_running_does_not():
    """Two threads compiling inductor models failed intermittently ("found no compiled
    frames", "CURRENT_PATCHER is None"): torch.export, make_fx and Dynamo patch
    process-wide state. A compilation (the first call with an input signature) now
    waits for the trace lock, which captures hold too; a call of compiled code runs
    while another thread holds it, without Dynamo."""
    assert guard.TRACE_LOCK is TRACE_LOCK
    compiled = inductor_backend.compile_graph(make_fx(_add_one)(torch.zeros(3)))
    torch.testing.assert_close(compiled(torch.zeros(3))[0], torch.ones(3))  # compiled
    done = {}

    def call(key, x):
        done[key] = compiled(x)[0]
    held, release = threading.Event(), threading.Event()

    def capture():  # another thread's capture
        with TRACE_LOCK:
            held.set()
            release.wait(60)
    holder = threading.Thread(target=capture)
    holder.start()
    assert held.wait(60)
    try:
        same = threading.Thread(target=call, args=("same", torch.full((3,), 2.0)))
        same.start()
        same.join(60)
        assert not same.is_alive()  # compiled code runs beside the capture
        torch.testing.assert_close(done["same"], torch.full((3,), 3.0))
        new = threading.Thread(target=call, args=("new", torch.zeros(5)))
        new.start()
        new.join(0.5)
        assert "new" not in done  # a new signature compiles: it waits for the capture
    finally:
        release.set()
        holder.join(60)
    new.join(600)
    torch.testing.assert_close(done["new"], torch.ones(5))


_COLD_THREADS = r'''
import sys, threading
import torch
import poptorch

errors = []


def inductor():
    try:
        opts = poptorch.Options()
        opts.Backend.compiler("inductor")
        m = torch.nn.Linear(4, 2)
        x = torch.randn(2, 4)
        torch.testing.assert_close(poptorch.inferenceModel(m, opts)(x), m(x))
    except Exception as e:  # noqa: BLE001
        errors.append(repr(e))


def eager_and_optimizer():
    try:
        torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
        m = torch.nn.Linear(4, 3)
        x = torch.randn(2, 4)
        torch.testing.assert_close(poptorch.inferenceModel(m)(x), m(x))
    except Exception as e:  # noqa: BLE001
        errors.append(repr(e))


threads = [threading.Thread(target=inductor), threading.Thread(target=eager_and_optimizer)]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
sys.exit(1 if errors else 0)
'''


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_first_compiles_in_two_threads_of_a_fresh_process():
    """In a fresh process, an inductor compile in one thread and a capture or a
    ``torch.optim`` optimizer in another imported torch._dynamo and torch._inductor
    (which import each other) from different ends at once: "deadlock detected by
    _ModuleLock('torch._dynamo')", "partially initialized module", in 5 of 8 runs, and
    nothing could compile in that process afterwards. The compiler stack is now
    imported from torch._dynamo down, under the trace lock."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", _COLD_THREADS], env=env, cwd=root,
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
