"""Runs that are all-or-nothing (docs/semantics.md S-73): the copies a failed run is rolled back
from (:class:`SavedTensors`), and deferring ``SIGINT`` (Ctrl-C) across work that must not be cut in
two.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when the
signal arrives. Two places must not be interrupted half-way: ``torch.export`` (an
exception raised inside one of its C++ dispatch callbacks aborts the process) and the
rollback of a failed run (half a rollback would leave parameters and optimizer state
from different steps). Inside :func:`deferred_interrupts` a ``SIGINT`` is recorded
instead, and ``KeyboardInterrupt`` is raised when the block ends.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, List, Optional

import torch

__all__ = ["deferred_interrupts", "SavedTensors"]


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Record ``SIGINT`` while inside; raise ``KeyboardInterrupt`` on leaving if one
    arrived (unless the block already raised, which then propagates as is).

    Only the main thread receives signals in Python; elsewhere, or when the program
    installed its own ``SIGINT`` handler (anything but Python's default one), this
    does nothing. Re-entrant: an inner block leaves the decision to the outer one.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    received = []

    def record(signum, frame):
        received.append(signum)

    signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt


class SavedTensors:
    """Copies of a list of device tensors in storage reused from one run to the next
    (reallocated only when the list changes), for the all-or-nothing rollback."""

    def __init__(self):
        self._key: Optional[tuple] = None
        self._copies: List[torch.Tensor] = []

    def take(self, tensors: List[torch.Tensor]) -> None:
        key = tuple((id(t), t.shape, t.dtype, t.device) for t in tensors)
        if key != self._key:
            self._copies = [torch.empty_like(t, requires_grad=False) for t in tensors]
            self._key = key
        if tensors:
            with torch.no_grad():
                torch._foreach_copy_(self._copies, [t.detach() for t in tensors])

    def put_back(self, tensors: List[torch.Tensor]) -> None:
        if tensors:
            with torch.no_grad():
                torch._foreach_copy_([t.detach() for t in tensors], self._copies)
