"""The backend logger ``poptorch:cpp`` (docs/semantics.md S-90).

Format ``[HH:MM:SS.mmm] [poptorch:cpp] [<level>] <msg>``; destination from
``POPTORCH_LOG_DEST`` (``stderr`` default, ``stdout`` or a file path); level from
``POPTORCH_LOG_LEVEL`` (default ``WARN``). ``poptorch.setLogLevel`` changes it together
with the Python logger.
"""
from __future__ import annotations

import logging
import sys
import time

from popart_compiler import config

__all__ = ["logger", "LEVELS", "level_from_name", "set_level"]

#: PopTorch level names → Python logging levels (docs/semantics.md S-90).
LEVELS = {
    "TRACE": logging.DEBUG,
    "TRACE_ALL": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "DEBUG_IR": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERR": logging.ERROR,
    "OFF": logging.CRITICAL,
}


class _Formatter(logging.Formatter):
    def __init__(self, name: str, lowercase: bool):
        super().__init__()
        self._name = name
        self._lowercase = lowercase

    def format(self, record: logging.LogRecord) -> str:
        t = time.localtime(record.created)
        stamp = time.strftime("%H:%M:%S", t) + f".{int(record.msecs):03d}"
        level = {"WARNING": "warning", "CRITICAL": "critical"}.get(
            record.levelname, record.levelname.lower())
        if not self._lowercase:
            level = level.upper()
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return f"[{stamp}] [{self._name}] [{level}] {msg}"


class _StreamHandler(logging.StreamHandler):
    """Writes to the *current* ``sys.stderr``/``sys.stdout`` so that pytest's capture works."""

    def __init__(self, dest: str):
        super().__init__()
        self._dest = dest

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout if self._dest == "stdout" else sys.stderr

    @stream.setter
    def stream(self, value):
        """Ignored: the handler always writes to the current ``sys.stderr`` /
        ``sys.stdout`` (``logging`` assigns a stream when the handler is created)."""


def make_logger(name: str, lowercase: bool, dest: str = "stderr") -> logging.Logger:
    """A logger with PopTorch's line format on its own handler.

    As PopTorch's loggers do, it passes its records up to the root logger too, so
    handlers installed with ``logging.basicConfig`` and pytest's ``caplog`` see them.
    ``warn`` is an alias of ``warning`` on this logger (PopTorch programs call
    ``poptorch.logger.warn``), without the ``DeprecationWarning`` of
    ``logging.Logger.warn``.
    """
    log = logging.getLogger(name)
    if not log.handlers:
        if dest in ("stderr", "stdout"):
            handler: logging.Handler = _StreamHandler(dest)
        else:
            handler = logging.FileHandler(dest)
        handler.setFormatter(_Formatter(name, lowercase))
        log.addHandler(handler)
    log.warn = log.warning  # type: ignore[method-assign]
    return log


def level_from_name(name: str) -> int:
    """Python logging level of a PopTorch level name; ``ValueError`` if unknown."""
    if name not in LEVELS:
        raise ValueError(f"Unknown log level: {name}. Valid values are DEBUG, ERR, INFO, "
                         "OFF, TRACE and WARN")
    return LEVELS[name]


logger = make_logger("poptorch:cpp", lowercase=True,
                     dest=config.log_dest())


def set_level(name: str) -> None:
    """Set the backend logger's level from a PopTorch level name."""
    logger.setLevel(level_from_name(name))


set_level(config.log_level())
