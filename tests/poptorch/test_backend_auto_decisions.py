"""The ``auto`` backend's recorded decisions (issue 30): a program decided once on a
machine starts on the same backend in every later run; ``POPTORCH_AUTO_BACKEND`` pins
or re-decides; a store that cannot be read or written never fails a compilation.

As in ``test_backend_auto.py``, TorchInductor's compilation is a stand-in that runs the
graph as it is, and the timings are injected: nothing depends on the machine. The
suite's ``conftest.py`` gives each test its own store (``POPTORCH_AUTO_DECISIONS_DIR``).
"""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import poptorch
from popart_compiler.backends import auto, decisions
from popart_compiler.backends import inductor as inductor_backend
from models import MLP
import processes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "auto_decision_worker.py")



def _timings(eager, inductor):
    return lambda backend, seconds: {"eager": eager, "inductor": inductor}[backend]


def _deciding(eager=2.0, inductor=1.0):
    """A policy that decides within 1 + 1 + 2 × 2 calls."""
    return auto.policy(compile_seconds=0, hot_seconds=0, hot_calls=1, trials=2, synchronous=True,
                       measure=_timings(eager, inductor))


def _model(seed=0):
    torch.manual_seed(seed)
    m = MLP((8, 16, 4))
    opts = poptorch.Options().deviceIterations(4)
    opts.Backend.compiler("auto")
    return m, poptorch.inferenceModel(m, opts)


def _chooser(model) -> auto.AutoChooser:
    return model._state.session.auto  # pylint: disable=protected-access


def _entries():
    where = decisions.store_dir()
    if not os.path.isdir(where):
        return {}
    out = {}
    for name in sorted(os.listdir(where)):
        if name == "compile-times.json":  # the compilation times (test_backend_auto_policy)
            continue
        with open(os.path.join(where, name), encoding="utf-8") as f:
            out[name] = json.load(f)
    return out


def _decide(calls=6, **timings):
    x = torch.randn(16, 8)
    with _deciding(**timings):
        m, model = _model()
        for _ in range(calls):
            torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-6)
    return model


def test_a_decision_is_recorded_with_the_program_signature(stand_in):
    model = _decide()
    assert _chooser(model).chosen == "inductor" and len(stand_in) == 1
    entries = _entries()
    assert len(entries) == 1
    (name, entry), = entries.items()
    assert name.endswith(".json") and entry["backend"] == "inductor"
    assert "fastest call 1 s on inductor against 2 s on eager" in entry["why"]
    sig = entry["signature"]
    assert sig["deviceIterations"] == "4" and sig["training"] == "False"
    assert sig["micro-batch input 0"] == "[4, 8] float32"
    assert sig["torch"] == torch.__version__ and sig["execution device"] == "cpu"


def test_a_recorded_inductor_decision_runs_inductor_from_the_first_call(stand_in):
    _decide()
    stand_in.clear()
    x = torch.randn(16, 8)
    m, model = _model()  # the default policy: would not compile within 2 calls
    torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-6)
    assert _chooser(model).chosen == "inductor" and len(stand_in) == 1
    model(x)
    assert len(stand_in) == 1


def test_a_recorded_eager_decision_never_compiles(stand_in):
    _decide(eager=1.0, inductor=0.99)  # within the margin: eager kept
    assert [e["backend"] for e in _entries().values()] == ["eager"]
    stand_in.clear()
    with auto.policy(compile_seconds=0, hot_seconds=0, hot_calls=1, synchronous=True):
        _, model = _model()
        for _ in range(4):
            model(torch.randn(16, 8))
    assert _chooser(model).chosen == "eager" and stand_in == []


def test_another_program_is_decided_on_its_own(stand_in):
    _decide()
    torch.manual_seed(0)
    opts = poptorch.Options().deviceIterations(2)  # another signature
    opts.Backend.compiler("auto")
    model = poptorch.inferenceModel(MLP((8, 16, 4)), opts)
    model(torch.randn(8, 8))
    assert _chooser(model).chosen is None
    assert len(_entries()) == 1


def test_the_decision_is_reused_by_a_second_process(tmp_path):
    """Two processes of the same script: the first decides Inductor (injected timings)
    and records it; the second, under the default policy, runs Inductor from its first
    call and its outputs equal the first's."""
    env = processes.env(POPTORCH_AUTO_DECISIONS_DIR=str(tmp_path / "store"))
    env.pop("POPTORCH_AUTO_BACKEND", None)
    results = []
    for mode in ("decide", "reuse"):
        done = subprocess.run([sys.executable, WORKER, mode], env=env, capture_output=True,
                              text=True, timeout=300 * processes.load_factor(), check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    decided, reused = results
    assert decided["chosen"] == "inductor" and decided["compiled"] == 1
    assert reused["chosen"] == "inductor" and reused["compiled"] == 1
    torch.testing.assert_close(torch.tensor(reused["out"]), torch.tensor(decided["out"]),
                               rtol=0, atol=0)
    # one decision, and the compilation times
    assert "compile-times.json" in os.listdir(tmp_path / "store")
    assert len(os.listdir(tmp_path / "store")) == 2


@pytest.mark.parametrize("pinned", ["eager", "inductor"])
def test_poptorch_auto_backend_pins_the_backend(pinned, stand_in, monkeypatch):
    """A pin wins over a recorded decision and over the timings, and records nothing."""
    _decide(eager=2.0, inductor=1.0) if pinned == "eager" else \
        _decide(eager=1.0, inductor=1.0)
    recorded = _entries()
    stand_in.clear()
    monkeypatch.setenv("POPTORCH_AUTO_BACKEND", pinned.upper())
    x = torch.randn(16, 8)
    with _deciding(eager=1.0, inductor=1.0):
        m, model = _model()
        for _ in range(6):
            torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-6)
    assert _chooser(model).chosen == pinned
    assert len(stand_in) == (1 if pinned == "inductor" else 0)
    assert _entries() == recorded


def test_redecide_decides_again_and_overwrites(stand_in, monkeypatch):
    _decide(eager=2.0, inductor=1.0)
    monkeypatch.setenv("POPTORCH_AUTO_BACKEND", "redecide")
    model = _decide(eager=1.0, inductor=1.0)
    assert _chooser(model).chosen == "eager"
    assert [e["backend"] for e in _entries().values()] == ["eager"]


def test_an_invalid_poptorch_auto_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("POPTORCH_AUTO_BACKEND", "fastest")
    _, model = _model()
    with pytest.raises(poptorch.Error, match=r"POPTORCH_AUTO_BACKEND='fastest' is not "
                                             r"valid: set it to eager or inductor"):
        model(torch.randn(16, 8))


@pytest.mark.parametrize("content", ["{not json", '{"version": 1, "backend": "tvm"}',
                                     "[1, 2]", ""])
def test_a_corrupt_entry_is_a_warning_and_is_rewritten(content, stand_in, caplog):
    _decide()
    (name, _), = _entries().items()
    path = os.path.join(decisions.store_dir(), name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(content)
    stand_in.clear()
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        model = _decide(eager=1.0, inductor=1.0)  # decided again: eager this time
    warnings = [r.getMessage() for r in caplog.records
                if "ignoring the unreadable decision" in r.getMessage()]
    assert len(warnings) == 1 and path in warnings[0]
    assert _chooser(model).chosen == "eager" and len(stand_in) == 1
    assert [e["backend"] for e in _entries().values()] == ["eager"]


def test_an_unwritable_store_is_a_warning_and_the_program_still_runs(
        stand_in, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("POPTORCH_AUTO_DECISIONS_DIR", str(blocker / "store"))
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        model = _decide()
    assert _chooser(model).chosen == "inductor"
    assert any("cannot record decisions in" in r.getMessage() for r in caplog.records)
    assert blocker.read_text() == "not a directory"


def test_a_recorded_inductor_that_fails_to_compile_falls_back_and_records_eager(
        stand_in, monkeypatch, caplog):
    _decide()

    def failing(gm, example_inputs, *, random):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(inductor_backend, "_inductor", failing)
    x = torch.randn(16, 8)
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        m, model = _model()
        torch.testing.assert_close(model(x), m(x).detach(), rtol=1e-5, atol=1e-6)
    assert _chooser(model).chosen == "eager"
    assert any("no C++ compiler" in r.getMessage() for r in caplog.records)
    assert [e["backend"] for e in _entries().values()] == ["eager"]
