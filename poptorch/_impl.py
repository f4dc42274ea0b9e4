"""Per-thread state shared by the capture and the ops, and PopTorch's ``_impl`` names
that its clients import (``rewrapModelIfNecessary``, ``isWrapped``, ..., see
:mod:`poptorch._compat.wrapping`).

Each thread has its own state: a capture in one thread does not make another thread
look as if it ran inside a model's ``forward``.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_state = threading.local()


def isRunningOnIpu() -> bool:
    """``True`` only while the model's ``forward`` runs in the device context.

    In PopTorch (and here) that is the one-time capture at compilation (docs/semantics.md S-1, S-4);
    ``False`` everywhere else, including when the model is called directly on the CPU
    and in every other thread than the capturing one.
    """
    return getattr(_state, "capturing", False)


def isDispatchTracing() -> bool:
    """``True`` while a model's ``forward`` is being captured (in this thread), as
    PopTorch's dispatcher tracing; the same as :func:`isRunningOnIpu`."""
    return isRunningOnIpu()


def capturing_training() -> bool:
    """Whether the graph being captured (in this thread) is a training graph."""
    return isRunningOnIpu() and getattr(_state, "training", False)


@contextlib.contextmanager
def device_context(training: bool) -> Iterator[None]:
    """Mark the code inside (in this thread) as running on the (simulated) IPU."""
    previous = (isRunningOnIpu(), getattr(_state, "training", False))
    _state.capturing, _state.training = True, training
    try:
        yield
    finally:
        _state.capturing, _state.training = previous


# PopTorch's names (imported last: poptorch._compat.wrapping needs the executor)
from poptorch._compat.wrapping import (isWrapped, rewrapModelIfNecessary,  # noqa: E402,F401
                                       unwrapIfWrapped, unwrapModelIfNecessary)
from poptorch._compat.wrapping import (  # noqa: E402,F401
    restoreWrapperIfNecessary as _restoreWrapperIfNecessary)
