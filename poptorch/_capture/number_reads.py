"""``int(t)`` and ``float(t)`` on a tensor known only at run time, read as ``t.item()``.

``torch.export`` (non-strict) runs ``forward`` as plain Python, and Python's ``int()``
and ``float()`` must return a real number, so a tensor whose value is known only at
run time cannot be converted at capture, while ``t.item()`` can stay symbolic (a
``SymInt`` / ``SymFloat`` the graph computes at run time). Strict export (Dynamo)
rewrites ``int(t)`` to ``item()`` for the same reason; here, while ``forward`` is
captured again after such a read failed (:func:`poptorch._capture.capture.capture`),
the names ``int`` and ``float`` in the modules defining the model's classes are
shadowed by stand-ins that do the same: a one-element fake tensor becomes
``torch.sym_int(t.item())`` / ``torch.sym_float(t.item())``, anything else goes to the
builtin unchanged. The stand-ins pass ``isinstance`` / ``issubclass`` checks as the
builtins do, but are not the builtins: ``type(v) is int`` is false and torch refuses
``dtype=int`` there, which is why models that never read a tensor this way are
captured without them. Code in other modules (helpers the model imports) still gets
the builtins and the data-dependence error that points to ``.item()``. The second
capture does not log again what the first one logged (:func:`logged_once`).
"""
from __future__ import annotations

import builtins
import contextlib
import logging
import sys
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["items_for_number_reads", "logged_once"]

_SKIPPED = ("torch", "poptorch", "popart_compiler", "builtins")


class _NumberMeta(type):
    """``int(t)`` → ``sym_int(t.item())`` for a traced one-element tensor."""

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and _traced_number(args[0]):
            return cls._symbolic(args[0].item())
        return cls._builtin(*args, **kwargs)

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, cls._builtin)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, cls._builtin)


def _traced_number(value) -> bool:
    return isinstance(value, torch.Tensor) and is_fake(value) and value.numel() == 1 \
        and value.dtype != torch.bool


class _Int(int, metaclass=_NumberMeta):
    _builtin = builtins.int
    _symbolic = staticmethod(torch.sym_int)


class _Float(float, metaclass=_NumberMeta):
    _builtin = builtins.float
    _symbolic = staticmethod(torch.sym_float)


def items_for_number_reads(model: torch.nn.Module):
    """A context manager: while active, ``int(t)`` / ``float(t)`` in the modules
    defining the classes of ``model`` and its sub-modules (taken now) read ``t`` as
    ``t.item()`` does."""
    names = {type(m).__module__ for m in model.modules()}
    return _shadowed([sys.modules[n] for n in sorted(names)
                      if n in sys.modules and n.split(".")[0] not in _SKIPPED])


@contextlib.contextmanager
def _shadowed(modules) -> Iterator[None]:
    saved = []
    for module in modules:
        table = vars(module)
        saved.append((table, {name: table[name] for name in ("int", "float")
                              if name in table}))
        if table.get("int", builtins.int) is builtins.int:
            table["int"] = _Int
        if table.get("float", builtins.float) is builtins.float:
            table["float"] = _Float
    try:
        yield
    finally:
        for table, before in saved:
            for name in ("int", "float"):
                if name in before:
                    table[name] = before[name]
                else:
                    table.pop(name, None)


class _Once(logging.Filter):
    """Passes every record of the first capture; after :meth:`repeat`, drops the
    records that capture already passed."""

    def __init__(self):
        super().__init__()
        self.seen = set()
        self.repeating = False

    def repeat(self) -> None:
        self.repeating = True

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, record.getMessage())
        if self.repeating:
            return key not in self.seen
        self.seen.add(key)
        return True


@contextlib.contextmanager
def logged_once(logger: logging.Logger) -> Iterator[_Once]:
    """While active, ``logger`` logs a record of a repeated capture only if the first
    capture did not (call ``.repeat()`` on the yielded filter before repeating)."""
    once = _Once()
    logger.addFilter(once)
    try:
        yield once
    finally:
        logger.removeFilter(once)
