"""The backend module of PopTorch (docs/api-sections.md api §3): its error classes and the few
functions PopTorch's clients and tests call (``isCompilingWithDispatcher``,
``TestErrorType``, ``_throwTestError``, ``_validateOptions``).

In PopTorch this is the C++ extension; here the classes come from ``popart_compiler``
and the functions from :mod:`poptorch._compat.error_hooks`.
"""
from popart_compiler.errors import Error, RecoverableError, UnrecoverableError  # noqa: F401
from poptorch._compat.error_hooks import TestErrorType  # noqa: F401
from poptorch._compat.error_hooks import throw_test_error as _throwTestError  # noqa: F401
from poptorch._compat.error_hooks import validate_options as _validateOptions  # noqa: F401
from poptorch._impl import isDispatchTracing as isCompilingWithDispatcher  # noqa: F401

__all__ = ["Error", "RecoverableError", "UnrecoverableError", "TestErrorType",
           "isCompilingWithDispatcher"]
