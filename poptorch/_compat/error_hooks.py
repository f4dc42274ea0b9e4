"""Raise each kind of PopTorch error on demand (``poptorch.poptorch_core``'s
``TestErrorType`` and ``_throwTestError``), as PopTorch 3.4 does.

The IPU Model never fails the way a device does; these hooks let programs check their
error handling: Graphcore's ``docs/user_guide/error_handling.py`` catches each kind in
the order ``RecoverableError``, ``UnrecoverableError``, ``Error``.
"""
from __future__ import annotations

import enum

from popart_compiler.errors import Error, RecoverableError, UnrecoverableError
from popart_compiler.session_options import SessionOptions

__all__ = ["TestErrorType", "throw_test_error", "validate_options"]


class TestErrorType(enum.IntEnum):
    """The kinds of error :func:`throw_test_error` raises (PopTorch's names)."""
    __test__ = False  # not a pytest test class

    Poptorch = 0
    Popart = 1
    PopartInternal = 2
    Poplibs = 3
    PoplarUnrecoverable = 4
    PoplarUnknown = 5
    PoplarRecoverableFullReset = 6
    PoplarLinkError = 7


#: The context stack every test error carries (outermost first).
_LOCATION = "throwTestError::topLevel\nthrowTestError::bottomLevel"

#: kind -> (class, type string, message)
_ERRORS = {
    TestErrorType.Poptorch: (Error, "poptorch_cpp_error", "This is a PopTorch error"),
    TestErrorType.Popart: (Error, "popart_exception", "This is a Popart error"),
    TestErrorType.PopartInternal: (Error, "popart_internal_exception",
                                   "This is a Popart internal error"),
    TestErrorType.Poplibs: (Error, "poplibs_exception", "This is a Poplibs error"),
    TestErrorType.PoplarUnrecoverable: (UnrecoverableError,
                                        "poplar_unrecoverable_runtime_error",
                                        "This is not recoverable"),
    TestErrorType.PoplarUnknown: (Error, "poplar_unknown_runtime_error",
                                  "Unknown runtime error"),
    TestErrorType.PoplarRecoverableFullReset: (RecoverableError,
                                               "poplar_recoverable_runtime_error",
                                               "Reboot needed"),
    # the linker's output is appended to a link error's message
    TestErrorType.PoplarLinkError: (Error, "poplar_link_error",
                                    "Link error\nLibrary -lfoo not found\ncheck path"),
}


def throw_test_error(kind) -> None:
    """Raise the error of ``kind`` (a :class:`TestErrorType` or its int value).

    Its ``location`` is a two-level context stack (``throwTestError::topLevel``,
    ``throwTestError::bottomLevel``); ``message`` never contains it. The recoverable
    error asks for ``FULL_RESET``.

    Raises:
        poptorch.RecoverableError / UnrecoverableError / Error: always.
    """
    try:
        kind = TestErrorType(int(kind))
    except (TypeError, ValueError):
        raise Error(f"Unknown TestErrorType {kind!r}", "poptorch_cpp_error") from None
    cls, type_, message = _ERRORS[kind]
    if cls is RecoverableError:
        raise RecoverableError(message, type_, _LOCATION, recovery_action="FULL_RESET")
    raise cls(message, type_, _LOCATION)


def validate_options(values: dict) -> None:
    """Validate an ``Options.toDict()`` dictionary as the backend does at compile time
    (``poptorch_core._validateOptions``).

    Raises:
        poptorch.Error: "Unknown <category> option <key>", "Unknown value type <t> for
            option <key>", an enum value out of range.
    """
    SessionOptions.from_dict(dict(values))
