"""How this process ends: its exit status and whether it raised, for the messages the
other processes of a multi-process run give about it (see :mod:`.collectives`).

:func:`install` wraps, once per process, the ways a Python script ends:

- ``sys.excepthook``: an uncaught exception (exit status 1; a KeyboardInterrupt ends
  the process by SIGINT);
- ``sys.exit`` and the ``exit`` / ``quit`` builtins: the status given, and the
  exception being handled when the script called it (a script that catches its error
  and calls ``sys.exit(1)``); a ``SystemExit`` caught by the script is not counted;
- ``os._exit``: the status given.

A script that ends without any of these finished normally (status 0). Not seen: a
``raise SystemExit(n)`` written in the script itself (use ``sys.exit``), a process
killed by a signal (the other processes report it as killed) and processes forked
from this one (their own ends are not this process's).

Listeners (:func:`listen`) hear an uncaught exception and ``os._exit`` at once, before
the process goes; :func:`ending` answers, at exit, how the script ended.
"""
from __future__ import annotations

import builtins
import contextlib
import dataclasses
import os
import signal
import sys
import threading
from typing import Callable, List, Optional, Tuple

__all__ = ["Ending", "install", "listen", "ending"]


@dataclasses.dataclass(frozen=True)
class Ending:
    """How this process ends.

    Attributes:
        status: the exit status (0-255; ``-2`` for a process ended by SIGINT).
        via: ``"end"`` (its script finished), ``"sys.exit"``, ``"exit"``,
            ``"os._exit"`` or ``"exception"`` (uncaught).
        raised: ``"RuntimeError: ..."``: the uncaught exception, or the exception the
            script was handling when it called ``sys.exit`` / ``os._exit``; ``""``
            when it raised none.
        code: what the script passed to ``sys.exit`` / ``os._exit`` (its ``repr``).
    """
    status: int
    via: str
    raised: str = ""
    code: str = ""

    @property
    def failed(self) -> bool:
        """Whether the process ends with an error: a non-zero status or an exception."""
        return self.status != 0 or bool(self.raised)

    def describe(self) -> str:
        """``"exited with status 1 (sys.exit(1)) after catching RuntimeError: boom"``,
        ``"ended normally (its script finished, exit status 0)"``, ..."""
        if self.via == "exception":
            status = "killed by SIGINT" if self.status < 0 else f"exit status {self.status}"
            return f"ended with {self.raised} (uncaught, {status})"
        if self.via == "end":
            return "ended normally (its script finished, exit status 0)"
        text = f"exited with status {self.status} ({self.via}({self.code}))"
        if self.raised:
            return f"{text} after catching {self.raised}"
        return text + (" without an error being raised" if self.status else "")


_PID = [0]
#: (SystemExit, via, handled exception) raised by the wrapped ``sys.exit`` / ``exit``
_EXITS: List[Tuple[BaseException, str, str]] = []
_UNCAUGHT: List[Ending] = []
_LISTENERS: List[Callable[[Ending], None]] = []


def _mine() -> bool:
    """Whether this is the installing process (not a forked child) and its main
    thread (a SystemExit in another thread ends only that thread)."""
    return os.getpid() == _PID[0] and threading.current_thread() is threading.main_thread()


def _text(value: Optional[BaseException]) -> str:
    if value is None:
        return ""
    text = f"{type(value).__name__}: {value}".strip().rstrip(":")
    return text if len(text) <= 300 else text[:297] + "..."


def _status(code) -> int:
    """The exit status Python gives for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def _tell(end: Ending) -> None:
    for listener in list(_LISTENERS):
        listener(end)


def _wrap_exit(original: Callable, via: str) -> Callable:
    def exit_(*args):
        if not _mine() or len(args) > 1:
            return original(*args)
        error = SystemExit(*args)
        _EXITS.append((error, via, _text(sys.exc_info()[1])))
        if via == "exit":  # the builtins close stdin first, as site's do
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stdin.close()
        raise error
    exit_.__doc__ = original.__doc__
    exit_.__wrapped__ = original
    return exit_


def _wrap_os_exit(original: Callable) -> Callable:
    def os_exit(status):
        if os.getpid() == _PID[0]:
            _tell(Ending(_status(status), "os._exit", _text(sys.exc_info()[1]),
                         repr(status)))
        original(status)
    os_exit.__doc__ = original.__doc__
    os_exit.__wrapped__ = original
    return os_exit


def _wrap_excepthook(previous: Callable) -> Callable:
    def hook(kind, value, traceback):
        try:
            previous(kind, value, traceback)
        finally:
            if os.getpid() == _PID[0]:
                interrupted = issubclass(kind, KeyboardInterrupt)
                end = Ending(-signal.SIGINT if interrupted else 1, "exception",
                             _text(value) or kind.__name__)
                _UNCAUGHT.append(end)
                _tell(end)
    return hook


def install() -> None:
    """Wrap ``sys.excepthook``, ``sys.exit``, ``exit`` / ``quit`` and ``os._exit``
    (once per process; a forked child installs its own)."""
    if _PID[0] == os.getpid():
        return
    _PID[0] = os.getpid()
    sys.excepthook = _wrap_excepthook(sys.excepthook)
    sys.exit = _wrap_exit(sys.exit, "sys.exit")
    for name in ("exit", "quit"):
        if callable(getattr(builtins, name, None)):
            setattr(builtins, name, _wrap_exit(getattr(builtins, name), "exit"))
    os._exit = _wrap_os_exit(os._exit)


def listen(listener: Callable[[Ending], None]) -> None:
    """Call ``listener(ending)`` when this process ends with an uncaught exception
    (after the traceback is printed) or calls ``os._exit``."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def _ended_the_script(error: BaseException) -> bool:
    """Whether ``error`` (a SystemExit raised by ``sys.exit``) ended the script rather
    than being caught. Python sets an exception's traceback when a handler (``except``,
    ``finally``, ``with``) takes it: none took it (no traceback), or the outermost
    frame that did stopped at the instruction the exception passed through (it
    re-raised it; a frame that caught it went on)."""
    tb = error.__traceback__
    return tb is None or tb.tb_lasti == tb.tb_frame.f_lasti


def ending() -> Ending:
    """How this process's script ended, asked at exit (``atexit``)."""
    if _UNCAUGHT:
        return _UNCAUGHT[-1]
    for error, via, raised in reversed(_EXITS):
        if _ended_the_script(error):
            code = error.code
            return Ending(_status(code), via, raised, "" if code is None else repr(code))
    return Ending(0, "end")
