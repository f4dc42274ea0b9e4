"""PopTorch's module name for the executor class, kept for programs that import it
(``from poptorch._poplar_executor import PoplarExecutor``); the executor lives in
:mod:`poptorch._executor.executor`."""
from poptorch._executor.executor import PoplarExecutor  # noqa: F401

__all__ = ["PoplarExecutor"]
