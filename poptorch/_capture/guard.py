"""What makes a capture safe next to other threads and Ctrl-C.

* ``torch.export`` is not thread-safe (it patches global state of torch while it
  traces), so captures are serialised by one process-wide lock, the one Inductor
  compilations hold too (:data:`popart_compiler.backends.tracing.TRACE_LOCK`).
* ``SIGINT`` is deferred across the capture and re-raised after it
  (:func:`popart_compiler.runtime.rollback.deferred_interrupts`): a ``KeyboardInterrupt``
  raised inside one of torch's C++ dispatch callbacks aborts the process.
* What ``torch.export`` prints to ``sys.stderr`` (the partial graph of a failed trace)
  is held back per thread (:func:`thread_stderr`): other threads keep writing to the
  real stream, and the process-wide ``sys.stderr`` is put back even when captures
  and other redirections interleave.
"""
from __future__ import annotations

import contextlib
import io
import sys
import threading
from typing import Iterator

from popart_compiler.backends.tracing import TRACE_LOCK
from popart_compiler.runtime.rollback import deferred_interrupts

__all__ = ["capture_guard", "thread_stderr"]


class _PerThreadStream:
    """A ``sys.stderr`` stand-in: the capturing thread's writes go to its buffer,
    every other thread's (and every other attribute: ``encoding``, ``isatty``,
    ``fileno``, ...) to the stream that was ``sys.stderr`` before."""

    def __init__(self, real, owner: int, buffer: io.StringIO):
        self.real, self.owner, self.buffer = real, owner, buffer

    def _target(self):
        return self.buffer if threading.get_ident() == self.owner else self.real

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name: str):
        return getattr(self.real, name)


@contextlib.contextmanager
def thread_stderr(buffer: io.StringIO) -> Iterator[None]:
    """Send this thread's ``sys.stderr`` writes to ``buffer`` while inside.

    Must run under the capture lock (one redirection at a time). On leaving,
    ``sys.stderr`` is restored only if nobody replaced it meanwhile.
    """
    real = sys.stderr
    proxy = _PerThreadStream(real, threading.get_ident(), buffer)
    sys.stderr = proxy
    try:
        yield
    finally:
        if sys.stderr is proxy:
            sys.stderr = real


@contextlib.contextmanager
def capture_guard() -> Iterator[None]:
    """Hold the process-wide capture lock with ``SIGINT`` deferred (see module
    docstring). A Ctrl-C during the capture raises ``KeyboardInterrupt`` once the
    capture has ended and the model's state has been restored. Waiting for another
    thread's capture can still be interrupted."""
    with TRACE_LOCK, deferred_interrupts():
        yield
