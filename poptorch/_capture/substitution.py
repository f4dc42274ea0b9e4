"""Substitution managers: code that frameworks swap in while a model is captured
(``poptorch._poplar_executor._OverwriteContextManager``, as in PopTorch 3.4).

PopTorch Geometric registers a manager class whose ``replace()`` swaps PyG functions
for IPU-friendly ones and whose ``restore()`` puts them back; PopTorch calls them
around every capture. The registry lives here, not in the top-level shim, so that a
framework that re-executes the shim module (``loader.load_module()``) still registers
with the class the capture uses.
"""
from __future__ import annotations

from typing import List

__all__ = ["OverwriteContextManager"]


class OverwriteContextManager:
    """Enter: instantiate every registered manager type and call its ``replace()``;
    exit: call ``restore()`` in reverse order (also when the capture fails)."""

    # PopTorch's spelling of the attribute and of the registration method
    _subsitution_manager_types: List[type] = []

    def __init__(self):
        self.substitution_managers = [manager_type() for manager_type in
                                      OverwriteContextManager._subsitution_manager_types]
        self._replaced: List[object] = []

    def __enter__(self):
        try:
            for manager in self.substitution_managers:
                manager.replace()
                self._replaced.append(manager)
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, exc_type, value, traceback):
        self._restore()

    def _restore(self) -> None:
        while self._replaced:
            self._replaced.pop().restore()

    @classmethod
    def registerSubsitutionManager(cls, manager_type: type) -> None:
        """Register a class with ``replace()`` and ``restore()`` methods (once)."""
        if manager_type not in cls._subsitution_manager_types:
            cls._subsitution_manager_types.append(manager_type)
