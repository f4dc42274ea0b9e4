"""``popart_compiler.runtime.exit_status``: how a process ends, in the words its peers
give (tests/poptorch/test_distributed.py runs real processes ending each way)."""
import pytest

from popart_compiler.runtime import exit_status
from popart_compiler.runtime.exit_status import Ending


@pytest.mark.parametrize("end, failed, words", [
    (Ending(0, "end"), False, "ended normally (its script finished, exit status 0)"),
    (Ending(1, "sys.exit", "RuntimeError: boom", "1"), True,
     "exited with status 1 (sys.exit(1)) after catching RuntimeError: boom"),
    (Ending(3, "os._exit", "", "3"), True,
     "exited with status 3 (os._exit(3)) without an error being raised"),
    (Ending(0, "sys.exit", "", "0"), False, "exited with status 0 (sys.exit(0))"),
    (Ending(1, "exception", "ValueError: bad"), True,
     "ended with ValueError: bad (uncaught, exit status 1)"),
    (Ending(-2, "exception", "KeyboardInterrupt"), True,
     "ended with KeyboardInterrupt (uncaught, killed by SIGINT)"),
])
def test_an_ending_is_described_with_its_status(end, failed, words):
    assert end.failed is failed
    assert end.describe() == words
    assert "ended normally" not in end.describe() or end.status == 0


@pytest.mark.parametrize("code, status", [(None, 0), (0, 0), (2, 2), (256 + 5, 5),
                                          ("a message", 1)])
def test_the_status_python_gives_for_sys_exit(code, status):
    assert exit_status._status(code) == status


def test_a_long_exception_text_is_cut():
    text = exit_status._text(RuntimeError("x" * 1000))
    assert len(text) == 300 and text.startswith("RuntimeError: xxx") and \
        text.endswith("...")
    assert exit_status._text(None) == ""
