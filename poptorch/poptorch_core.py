"""The backend module of PopTorch: its error classes (spec api §3).

In PopTorch this is the C++ extension; here the classes come from ``popart_compiler``.
"""
from popart_compiler.errors import Error, RecoverableError, UnrecoverableError  # noqa: F401

__all__ = ["Error", "RecoverableError", "UnrecoverableError"]
