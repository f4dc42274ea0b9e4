"""popart_compiler/backends/auto.py: the policy, and which backend AutoChooser runs
each call on (a synchronous policy, injected clock and figures: never the machine's
speed)."""
import pytest

from popart_compiler.backends import auto
from popart_compiler.backends.auto import AutoChooser, AutoPolicy, Lowering


class Clock:
    """Each reading advances by ``step`` seconds: every call takes ``step``."""
    def __init__(self, step=0.5):
        self.now, self.step = 0.0, step

    def __call__(self):
        self.now += self.step / 2
        return self.now


def _chooser(eager_figure, inductor_figure, compile_inductor=None, **changes):
    figures = {"eager": eager_figure, "inductor": inductor_figure}
    settings = AutoPolicy(hot_calls=2, hot_seconds=0.5, trials=2, synchronous=True,
                          clock=Clock(), measure=lambda name, s: figures[name], **changes)
    eager = Lowering("eager", lambda: "eager")
    inductor = Lowering("inductor", lambda: "inductor")
    return AutoChooser(eager, compile_inductor or (lambda: inductor), settings=settings)


def _calls(chooser, n):
    return [chooser.run(lambda lowering: lowering.runner()) for _ in range(n)]


def test_policy_changes_the_process_policy_inside_the_block_only():
    before = auto.POLICY
    with auto.policy(trials=1, margin=0.5) as changed:
        assert auto.POLICY is changed and (changed.trials, changed.margin) == (1, 0.5)
        assert changed.hot_calls == before.hot_calls
    assert auto.POLICY is before
    with pytest.raises(TypeError):
        with auto.policy(no_such_field=1):
            raise AssertionError("an unknown field must be refused on entering the block")


def test_eager_until_hot_then_timed_trials_keep_the_faster_inductor():
    c = _chooser(eager_figure=2.0, inductor_figure=1.0)
    # 2 hot calls on eager; then compile; one untimed inductor call; 2 + 2 timed trials
    ran = _calls(c, 8)
    assert ran[:2] == ["eager", "eager"] and ran[2] == "inductor"
    assert c.chosen == "inductor"
    assert _calls(c, 2) == ["inductor", "inductor"]


def test_an_inductor_within_the_margin_is_dropped_for_eager():
    c = _chooser(eager_figure=1.0, inductor_figure=0.97)  # 3% faster, margin 5%
    _calls(c, 8)
    assert c.chosen == "eager" and _calls(c, 1) == ["eager"]


def test_a_failing_compilation_keeps_eager(caplog):
    def broken():
        raise RuntimeError("no compiler")
    c = _chooser(1.0, 0.1, compile_inductor=broken)
    assert _calls(c, 4) == ["eager"] * 4
    assert c.chosen == "eager"
    assert "TorchInductor failed (compiling raised RuntimeError: no compiler)" in caplog.text


def test_a_failing_compiled_call_is_run_again_on_eager():
    def raises():
        raise ValueError("bad kernel")
    c = _chooser(1.0, 0.1, compile_inductor=lambda: Lowering("inductor", raises))
    assert _calls(c, 4) == ["eager"] * 4 and c.chosen == "eager"
