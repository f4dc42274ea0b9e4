"""Process-wide state shared by the capture and the ops."""
from __future__ import annotations

import contextlib
from typing import Iterator

_state = {"capturing": False, "training": False}


def isRunningOnIpu() -> bool:
    """``True`` only while the model's ``forward`` runs in the device context.

    In PopTorch (and here) that is the one-time capture at compilation (S-1, S-4);
    ``False`` everywhere else, including when the model is called directly on the CPU.
    """
    return _state["capturing"]


def capturing_training() -> bool:
    """Whether the graph being captured is a training graph."""
    return _state["capturing"] and _state["training"]


@contextlib.contextmanager
def device_context(training: bool) -> Iterator[None]:
    """Mark the code inside as running on the (simulated) IPU."""
    previous = dict(_state)
    _state.update(capturing=True, training=training)
    try:
        yield
    finally:
        _state.update(previous)
