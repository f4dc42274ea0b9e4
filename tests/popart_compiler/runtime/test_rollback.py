"""Sessions roll a failed run back (docs/semantics.md S-73) and defer SIGINT where a half-done step
would corrupt state. Nothing here imports ``poptorch``."""
import signal
import threading

import pytest
import torch

from models import BNClassifier, export
from popart_compiler import compiler
from popart_compiler.runtime.rollback import deferred_interrupts
from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.runtime.training import TrainingSession
from popart_compiler.session_options import SessionOptions


def session(accumulation=1):
    x, t = torch.randn(2, 4), torch.tensor([0, 1])
    graph = export(BNClassifier(), x, t)
    opts = SessionOptions(device_iterations=2, gradient_accumulation=accumulation,
                          output_mode=2)
    desc = OptimizerDescription("SGD", defaults=dict(lr=0.1, momentum=0.9), groups=[],
                                group_of={})
    return TrainingSession(compiler.compile(graph, opts, training=True), None, desc)


def state(s):
    out = dict(s.readWeights())
    out.update(s.readOptimizerState())
    return {k: v.clone() for k, v in out.items()}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_failed_run_restores_weights_buffers_and_optimizer(accumulation):
    s = session(accumulation)
    n = 2 * 2 * accumulation
    x, t = torch.randn(n, 4), torch.randint(0, 3, (n,))
    s.run([x, t])
    before = state(s)
    bad = t.clone()
    bad[-1] = 9
    for _ in range(2):  # the reused snapshot buffers work more than once
        with pytest.raises(IndexError):
            s.run([x, bad])
        after = state(s)
        assert all(torch.equal(before[k], after[k]) for k in before)
    s.run([x, t])
    assert not torch.equal(state(s)["fc.weight"], before["fc.weight"])


def test_rollback_can_be_turned_off_for_measurement():
    s = session()
    x, t = torch.randn(4, 4), torch.tensor([0, 1, 2, 9])
    s.run([x, torch.tensor([0, 1, 2, 1])])
    before = state(s)
    s.all_or_nothing = False
    with pytest.raises(IndexError):
        s.run([x, t])
    assert not torch.equal(state(s)["fc.weight"], before["fc.weight"])


def test_deferred_interrupts_reraise_after_the_block(default_sigint):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            # raise_signal delivers to this thread before it returns (os.kill may pick
            # another thread of the process, late on a loaded machine)
            signal.raise_signal(signal.SIGINT)
            for _ in range(1000):  # the handler would have run by now
                done.append(1)
    assert len(done) == 1000
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_deferred_interrupts_nest_and_let_errors_through(default_sigint):
    with pytest.raises(ValueError):
        with deferred_interrupts():
            with deferred_interrupts():
                signal.raise_signal(signal.SIGINT)
            raise ValueError("the block's own error wins")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_deferred_interrupts_do_nothing_outside_the_main_thread(default_sigint):
    seen = []

    def body():
        with deferred_interrupts():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=60)
    assert seen == [signal.default_int_handler]
