"""The error classes (popart_compiler/errors.py): ``Error`` and its recoverable /
unrecoverable kinds, pickling, long messages spilled to a log file."""
import pickle

import pytest

from popart_compiler.errors import Error, RecoverableError, UnrecoverableError


def test_error_classes():
    e = Error("boom", "popart_exception", "frame 1\nframe 2")
    assert e.message == "boom" and e.location == "frame 1\nframe 2"
    assert "Error raised in:\nframe 1" in str(e)
    assert isinstance(RecoverableError("x"), Error)
    assert isinstance(UnrecoverableError("x"), Error)
    with pytest.raises(ValueError):
        RecoverableError("x", recovery_action="REBOOT")
    again = pickle.loads(pickle.dumps(e))
    assert again.message == "boom" and str(again) == str(e)


def test_long_messages_spill_to_a_log_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    e = Error("\n".join(str(i) for i in range(100)))
    assert e.message == "See poptorch_error.log for details"
    assert (tmp_path / "poptorch_error.log").read_text().startswith("0\n1\n")
