"""PopTorch's module name for the executor class, kept for programs that import it
(``from poptorch._poplar_executor import PoplarExecutor``); the executor lives in
:mod:`poptorch._executor.executor`. ``_OverwriteContextManager`` is the registry of
substitution managers PopTorch Geometric uses (:mod:`poptorch._capture.substitution`).
"""
from poptorch._capture.substitution import (  # noqa: F401
    OverwriteContextManager as _OverwriteContextManager)
from poptorch._executor.executor import PoplarExecutor  # noqa: F401

__all__ = ["PoplarExecutor"]
