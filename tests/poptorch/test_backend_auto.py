"""The ``auto`` backend (issue 23): eager at once, TorchInductor once the program is hot,
the faster of the two kept.

The choice never depends on the machine: the policy is synchronous (Inductor compiles
between two calls, in the calling thread) and the timings are injected
(``AutoPolicy.measure``). Most tests replace TorchInductor's compilation by a stand-in
that runs the graph as it is (with its linear layers as oneDNN linears, so results agree
with eager to float rounding) and counts its calls (a real compilation takes seconds on
a small CI box); two tests compile for real, to check numerics and training state.
"""
import copy
import logging

import pytest
import torch

import poptorch
from popart_compiler.backends import auto
from popart_compiler.backends import inductor as inductor_backend
from popart_compiler.session_options import SessionOptions
from models import MLP, Classifier


class _StandIn:
    """What the stand-in compilation returns: ``gm`` run as it is, calls counted."""
    calls = 0

    def __init__(self, gm):
        self.gm = gm

    def __call__(self, *args):
        _StandIn.calls += 1
        return self.gm(*args)


@pytest.fixture
def stand_in(monkeypatch, compiled_always):  # pylint: disable=unused-argument
    """TorchInductor's compilation replaced by :class:`_StandIn` (graphs of prepacked
    kernels only compiled too: ``compiled_always``); yields the list of compiled graph
    modules."""
    compiled = []

    def fake(gm, example_inputs, *, random):  # pylint: disable=unused-argument
        compiled.append(gm)
        return _StandIn(gm)
    monkeypatch.setattr(inductor_backend, "_inductor", fake)
    _StandIn.calls = 0
    return compiled


def _timings(eager: float, inductor: float):
    return lambda backend, seconds: {"eager": eager, "inductor": inductor}[backend]


def _inference(compiler="auto", iterations=4, seed=0):
    torch.manual_seed(seed)
    m = MLP((8, 16, 4))
    opts = poptorch.Options().deviceIterations(iterations)
    opts.Backend.compiler(compiler)
    return m, poptorch.inferenceModel(m, opts)


def _train(compiler, calls):
    """SGD with momentum on a classifier, 2 device iterations per call: the losses, the
    weights after ``calls`` calls and the model."""
    torch.manual_seed(1)
    m = Classifier((8, 16, 4))
    opts = poptorch.Options().deviceIterations(2)
    opts.Backend.compiler(compiler)
    model = poptorch.trainingModel(
        m, opts, poptorch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    torch.manual_seed(2)
    losses = [model(torch.randn(8, 8), torch.randint(0, 4, (8,)))[1] for _ in range(calls)]
    model.copyWeightsToHost()
    return losses, copy.deepcopy(m.state_dict()), model


def _chooser(model) -> auto.AutoChooser:
    return model._state.session.auto  # pylint: disable=protected-access


def test_auto_is_accepted_by_options_and_environment(monkeypatch):
    opts = poptorch.Options().outputMode(poptorch.OutputMode.All)
    opts.Backend.compiler("AUTO")
    assert opts.Backend.compilerName == "auto"
    assert SessionOptions.from_dict(opts.toDict()).backend_key == "cpu/auto"
    monkeypatch.setenv("POPTORCH_COMPILER", "auto")
    assert poptorch.Options().Backend.compilerName == "auto"


def test_auto_first_calls_run_eager_then_picks_inductor_when_faster(stand_in):
    x = torch.randn(16, 8)
    with auto.policy(compile_seconds=0, hot_seconds=0, synchronous=True, hot_calls=2, trials=3,
                     measure=_timings(eager=2.0, inductor=1.0)):
        m, model = _inference()
        ref = m(x).detach()
        for _ in range(2):  # eager while the program is not hot
            torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-6)
        assert stand_in == [] and _StandIn.calls == 0
        chooser = _chooser(model)
        # compiled before the third call; one untimed inductor call, then eager and
        # inductor alternate until each has 3 timed calls
        for _ in range(7):
            torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-6)
        assert len(stand_in) == 1 and _StandIn.calls == 4
        assert chooser.chosen == "inductor"
        model(x)
        assert _StandIn.calls == 5  # every call on inductor from now on
    # the vectorized graph over the 4 device iterations is what was compiled
    inputs = [n for n in stand_in[0].graph.nodes if n.op == "placeholder"][-1]
    assert tuple(inputs.meta["val"].shape) == (4, 4, 8)


def test_auto_keeps_eager_when_inductor_is_slower(stand_in):
    x = torch.randn(16, 8)
    with auto.policy(compile_seconds=0, hot_seconds=0, synchronous=True, hot_calls=1, trials=2,
                     measure=_timings(eager=1.0, inductor=0.99)):  # within the margin
        m, model = _inference()
        for _ in range(6):
            torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-6)
        chooser = _chooser(model)
        assert chooser.chosen == "eager" and len(stand_in) == 1
        calls = _StandIn.calls
        model(x)
        assert _StandIn.calls == calls == 3  # 1 untimed + 2 timed, then eager only


def test_auto_first_call_is_eager_even_with_no_hot_calls(stand_in):
    with auto.policy(compile_seconds=0, hot_seconds=0, synchronous=True, hot_calls=0):
        _, model = _inference()
        model(torch.randn(16, 8))
        assert stand_in == []  # nothing compiled before the first result
        model(torch.randn(16, 8))
        assert len(stand_in) == 1


def test_auto_compiles_only_once_the_calls_took_hot_seconds(stand_in):
    """A program that has run briefly never pays for a compilation: hot once 2 calls
    took 0.35 s in all; each call takes 0.1 s by the injected clock."""
    ticks = iter(range(1000))
    with auto.policy(compile_seconds=0, synchronous=True, hot_calls=2, hot_seconds=0.35,
                     clock=lambda: next(ticks) * 0.1):  # read at start and end
        _, model = _inference()
        for _ in range(4):
            model(torch.randn(16, 8))
        assert stand_in == []
        model(torch.randn(16, 8))
        assert len(stand_in) == 1


def test_auto_logs_when_it_turns_hot_compiles_and_decides(stand_in, caplog):
    """The hot rule (3 calls *and* 1 s in all by default) is visible in the log: DEBUG
    for each call while not hot, INFO when compiling starts (calls, seconds), when it
    ends and when a backend is kept (the fastest timed calls). Each call takes 0.1 s by
    the injected clock; hot after 4 calls (0.4 s >= 0.35 s)."""
    ticks = iter(range(1000))
    with auto.policy(compile_seconds=0, synchronous=True, hot_calls=2, hot_seconds=0.35, trials=1,
                     clock=lambda: next(ticks) * 0.1,
                     measure=_timings(eager=2.0, inductor=1.0)), \
            caplog.at_level(logging.DEBUG, logger="poptorch:cpp"):
        _, model = _inference()
        for _ in range(4):
            model(torch.randn(16, 8))
        waiting = [r for r in caplog.records if "not hot yet" in r.getMessage()]
        assert [r.levelno for r in waiting] == [logging.DEBUG] * 4
        assert "after 4 calls taking 0.4 s in all (compiles after 2 calls and 0.35 s" \
            in waiting[-1].getMessage()
        caplog.clear()
        for _ in range(3):  # compiles, 1 untimed inductor call, 1 timed call of each
            model(torch.randn(16, 8))
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO
             and r.getMessage().startswith("Backend auto")]
    assert len(infos) == 3, infos
    assert "the program is hot (4 calls took 0.4 s in all; thresholds 2 calls and " \
        "0.35 s): compiling it with TorchInductor before the next call" in infos[0]
    assert "TorchInductor compiled the program in " in infos[1]
    assert "s of CPU); timing 1 calls of each backend before choosing" in infos[1]
    assert infos[2] == ("Backend auto: keeping inductor (fastest call 1 s on inductor "
                        "against 2 s on eager)")
    assert not [r for r in caplog.records if "not hot yet" in r.getMessage()]


def test_auto_default_hot_rule_is_3_calls_and_1_second():
    assert (auto.POLICY.hot_calls, auto.POLICY.hot_seconds) == (3, 1.0)


@pytest.mark.parametrize("where, message", [("compile", "no C++ compiler"),
                                            ("call", "kernel crashed")])
@pytest.mark.usefixtures("compiled_always")
def test_auto_falls_back_to_eager_when_inductor_fails(where, message, monkeypatch, caplog):
    """A compilation that raises, or a compiled call that raises (that call is run
    again on eager): one warning, correct results, eager for good."""
    def failing(*args):
        raise RuntimeError(message)

    def compile_fx(gm, example_inputs, *, random):
        if where == "compile":
            raise RuntimeError(message)
        return failing
    monkeypatch.setattr(inductor_backend, "_inductor", compile_fx)
    x = torch.randn(16, 8)
    with auto.policy(compile_seconds=0, hot_seconds=0, synchronous=True, hot_calls=1), \
            caplog.at_level(logging.WARNING, logger="poptorch"):
        m, model = _inference()
        for _ in range(5):
            torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-6)
    assert _chooser(model).chosen == "eager"
    warnings = [r for r in caplog.records if "TorchInductor failed" in r.getMessage()]
    assert len(warnings) == 1 and message in warnings[0].getMessage()


def test_a_decided_inductor_that_fails_later_falls_back_to_eager(stand_in, caplog):
    """Once Inductor is chosen, calls are no longer timed; one of its calls that raises
    is run again on eager (correct results), with one warning, and eager is kept."""
    x = torch.randn(16, 8)
    with auto.policy(compile_seconds=0, hot_seconds=0, synchronous=True, hot_calls=1,
                     trials=1, measure=_timings(eager=2.0, inductor=1.0)), \
            caplog.at_level(logging.WARNING, logger="poptorch"):
        m, model = _inference()
        for _ in range(4):
            model(x)
        chooser = _chooser(model)
        assert chooser.chosen == "inductor"
        calls = _StandIn.calls
        model(x)
        assert _StandIn.calls == calls + 1  # the call ran on the chosen Inductor
        stand_in[-1].forward = None  # its next call raises (TypeError)
        torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-6)
    assert chooser.chosen == "eager"
    warnings = [r for r in caplog.records if "TorchInductor failed" in r.getMessage()]
    assert len(warnings) == 1


def test_auto_compiles_in_a_background_thread(stand_in):
    x = torch.randn(16, 8)
    with auto.policy(compile_seconds=0, hot_seconds=0, hot_calls=1, trials=1,
                     measure=_timings(eager=2.0, inductor=1.0)):
        m, model = _inference()
        model(x)
        model(x)  # starts the compilation in the background; runs eager
        chooser = _chooser(model)
        chooser.wait()
        assert len(stand_in) == 1 and not chooser.compiling
        for _ in range(3):  # untimed inductor call, eager, inductor
            torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-6)
        assert chooser.chosen == "inductor"


def test_auto_training_switches_between_calls_keeping_weights_and_optimizer(stand_in):
    """SGD with momentum: the stand-in compiled forward runs from the 3rd call on; the
    losses and weights equal the eager backend's to float rounding (the stand-in runs
    the linear layers as oneDNN linears, as the inductor lowering does)."""
    with auto.policy(compile_seconds=0, hot_seconds=0, synchronous=True, hot_calls=2, trials=2,
                     measure=_timings(eager=2.0, inductor=1.0)):
        losses, weights, model = _train("auto", calls=8)
    assert _chooser(model).chosen == "inductor" and _StandIn.calls > 0
    eager_losses, eager_weights, _ = _train("eager", calls=8)
    for a, b in zip(losses, eager_losses):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for k, v in eager_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6)


def test_auto_stays_eager_for_checked_floating_point_exceptions_and_pipelines():
    opts = poptorch.Options()
    opts.Backend.compiler("auto")
    opts.Precision.enableFloatingPointExceptions(True)
    model = poptorch.inferenceModel(MLP((8, 16, 4)), opts)
    model(torch.randn(2, 8))
    assert _chooser(model) is None

    class TwoStages(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = poptorch.BeginBlock(torch.nn.Linear(4, 4), "A", ipu_id=0)
            self.b = poptorch.BeginBlock(torch.nn.Linear(4, 3), "B", ipu_id=1)

        def forward(self, x):
            return self.b(self.a(x))
    opts = poptorch.Options().deviceIterations(2)
    opts.Backend.compiler("auto")
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    model = poptorch.inferenceModel(TwoStages(), opts)
    model(torch.randn(4, 4))
    assert _chooser(model) is None


# -- real TorchInductor compilations ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.usefixtures("compiled_always")
def test_auto_on_inductor_matches_eager_inference_and_training():
    """Real compilations: inference (vectorized over 4 device iterations) and SGD
    training (forward and backward compiled) on the chosen Inductor agree with the
    eager backend within float rounding, and training continues from the eager calls'
    weights and momentum."""
    x = torch.randn(16, 8)
    with auto.policy(compile_seconds=0, hot_seconds=0, synchronous=True, hot_calls=1, trials=1,
                     measure=_timings(eager=2.0, inductor=1.0)):
        m, model = _inference()
        before = inductor_backend.compile_count()
        outs = [model(x) for _ in range(4)]
        assert _chooser(model).chosen == "inductor"
        assert inductor_backend.compile_count() == before + 1
        for out in outs:
            torch.testing.assert_close(out, m(x).detach(), rtol=1e-5, atol=1e-5)

        losses, weights, training = _train("auto", calls=5)
        assert _chooser(training).chosen == "inductor"
    eager_losses, eager_weights, _ = _train("eager", calls=5)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-5)
    for k, v in eager_weights.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-5)
