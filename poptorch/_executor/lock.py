"""The per-executor lock of :class:`poptorch.PoplarExecutor`: one call, weight copy,
optimizer change or attach / detach of an executor runs at a time (the executor's
reliability notes, beyond PopTorch's S-73)."""
from __future__ import annotations

import functools
from typing import Callable

__all__ = ["serialised"]


def serialised(method: Callable) -> Callable:
    """Run ``method`` holding its executor's lock: calls, weight copies, optimizer
    changes and attachment of one executor never interleave across threads."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper
