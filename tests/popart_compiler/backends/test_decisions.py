"""``popart_compiler.backends.decisions``: the store of the ``auto`` backend's choices
(one JSON entry per program), the pinning variable, and where the store lives."""
import json
import logging

import pytest

from popart_compiler.backends import decisions
from popart_compiler.errors import Error


def test_a_saved_decision_is_loaded_back(tmp_path):
    store = decisions.DecisionStore(str(tmp_path / "store"))
    assert store.load("k1") is None
    assert store.save("k1", "inductor", "timed", {"graph": "g"})
    assert store.load("k1") == "inductor"
    entry = json.loads((tmp_path / "store" / "k1.json").read_text())
    assert entry["backend"] == "inductor" and entry["signature"] == {"graph": "g"}
    assert store.save("k1", "eager", "redecided", {})
    assert store.load("k1") == "eager"


@pytest.mark.parametrize("text", ["{not json", "[]", '{"version": 1, "backend": "tpu"}'])
def test_an_unreadable_entry_is_a_warning_and_no_decision(tmp_path, caplog, text):
    store = decisions.DecisionStore(str(tmp_path))
    (tmp_path / "k.json").write_text(text)
    with caplog.at_level(logging.WARNING):
        assert store.load("k") is None
    assert "ignoring the unreadable decision" in caplog.text


def test_an_unknown_backend_is_not_recorded(tmp_path):
    with pytest.raises(ValueError, match="Invalid backend decision 'tpu'"):
        decisions.DecisionStore(str(tmp_path)).save("k", "tpu", "", {})


def test_an_unwritable_store_returns_false(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert not decisions.DecisionStore(str(blocker / "store")).save("k", "eager", "", {})


def test_the_mode_variable(monkeypatch):
    monkeypatch.setenv("POPTORCH_AUTO_BACKEND", "Inductor")
    assert decisions.mode() == "inductor"
    monkeypatch.setenv("POPTORCH_AUTO_BACKEND", "fastest")
    with pytest.raises(Error, match="POPTORCH_AUTO_BACKEND='fastest' is not valid"):
        decisions.mode()


def test_the_store_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("POPTORCH_AUTO_DECISIONS_DIR", str(tmp_path / "d"))
    assert decisions.store_dir() == str(tmp_path / "d")
    monkeypatch.delenv("POPTORCH_AUTO_DECISIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert decisions.store_dir() == str(tmp_path / "poptorch" / "auto-decisions")
