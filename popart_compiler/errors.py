"""Error classes of the compiler and runtime (PopTorch's ``poptorch_core`` errors).

``poptorch`` re-exports :class:`Error`, :class:`RecoverableError` and
:class:`UnrecoverableError` unchanged (docs/api-sections.md api §3, docs/semantics.md S-70…S-73).
"""
from __future__ import annotations

__all__ = [
    "Error",
    "RecoverableError",
    "UnrecoverableError",
    "py_error",
    "backend_error",
    "RECOVERY_ACTIONS",
]

#: Recovery actions a :class:`RecoverableError` may carry.
RECOVERY_ACTIONS = ("IPU_RESET", "LINK_RESET", "PARTITION_RESET", "FULL_RESET")

#: Messages longer than this many lines are spilled to ``poptorch_error.log``
#: (docs/semantics.md S-71).
_MAX_MESSAGE_LINES = 80


class Error(Exception):
    """An error detected by PopTorch or its backend (docs/semantics.md S-70, S-71).

    Attributes (all ``str``):
        message: the text without context.
        type: origin / category, e.g. ``"poptorch_py_error"`` for errors of the Python
            layer or ``"poptorch_cpp_error"`` for compiler checks.
        location: a multi-line "where it happened" context stack (may be empty).
    """

    def __init__(self, message: str = "", type: str = "poptorch_py_error",  # noqa: A002
                 location: str = ""):
        message = str(message)
        if message.count("\n") + 1 > _MAX_MESSAGE_LINES:
            with open("poptorch_error.log", "w", encoding="utf-8") as f:
                f.write(message)
            message = "See poptorch_error.log for details"
        self.message = message
        self.type = type
        self.location = location
        super().__init__(self._render())

    def _render(self) -> str:
        # PopTorch prefixes backend errors with "In <file>:<line>:" naming its C++
        # source; here that would name a module of the simulator, which tells a user
        # nothing, so both layers render as "'<type>': <message>".
        text = f"'{self.type}': {self.message}"
        action = getattr(self, "recovery_action", None)
        if action:
            text += f"\nRecovery action required: {action}"
        if self.location:
            text += f"\nError raised in:\n{self.location}"
        return text

    def __str__(self) -> str:  # the args may have been changed by pickling
        return self._render()

    def __reduce__(self):
        return (_rebuild, (type(self), self.__dict__.copy()))


def _rebuild(cls, state):
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    Exception.__init__(obj, obj._render())
    return obj


class RecoverableError(Error):
    """A transient device runtime failure that can be retried after ``recovery_action``.

    The IPU Model never raises it by itself; it exists so that user code catching it
    works unchanged (docs/api-sections.md api §3).
    """

    def __init__(self, message: str = "",
                 type: str = "poplar_recoverable_runtime_error",  # noqa: A002
                 location: str = "", recovery_action: str = "IPU_RESET", **kwargs):
        if recovery_action not in RECOVERY_ACTIONS:
            raise ValueError(f"recovery_action must be one of {RECOVERY_ACTIONS}, "
                             f"got {recovery_action!r}")
        self.recovery_action = recovery_action
        super().__init__(message, type, location, **kwargs)


class UnrecoverableError(Error):
    """A persistent device runtime failure (the machine needs servicing)."""

    def __init__(self, message: str = "",
                 type: str = "poplar_unrecoverable_runtime_error",  # noqa: A002
                 location: str = "", **kwargs):
        super().__init__(message, type, location, **kwargs)


def py_error(message: str) -> Error:
    """An :class:`Error` of the Python layer (``type == "poptorch_py_error"``)."""
    return Error(message)


def backend_error(message: str, type: str = "poptorch_cpp_error",  # noqa: A002
                  location: str = "") -> Error:
    """An :class:`Error` raised by the compiler/runtime (``type`` defaults to
    ``"poptorch_cpp_error"``), rendered as ``'<type>': <message>``."""
    return Error(message, type, location)


# Users see these classes as PopTorch's: ``poptorch.Error`` in tracebacks and reprs
# (``poptorch`` re-exports them; pickles refer to them there too).
for _cls in (Error, RecoverableError, UnrecoverableError):
    _cls.__module__ = "poptorch"
