"""The ``poptorch::python`` logger and :func:`setLogLevel` (docs/api-sections.md api §2.7,
docs/semantics.md S-90)."""
from __future__ import annotations

from typing import Union

from popart_compiler import logging as compiler_logging

from poptorch._options import environment as config

__all__ = ["logger", "setLogLevel"]

logger = compiler_logging.make_logger("poptorch::python", lowercase=True)

_LEGACY_INTS = {0: "TRACE", 1: "DEBUG", 2: "INFO", 3: "WARN", 4: "ERR", 6: "OFF"}


def setLogLevel(level: Union[str, int]) -> None:
    """Set the verbosity of the Python (``poptorch::python``) and backend loggers.

    Args:
        level: ``"TRACE"``, ``"DEBUG"``, ``"INFO"``, ``"WARN"``, ``"ERR"``, ``"OFF"``
            (also ``"TRACE_ALL"``, ``"DEBUG_IR"``), or a legacy integer
            0=TRACE, 1=DEBUG, 2=INFO, 3=WARN, 4=ERR, 6=OFF.

    Raises:
        ValueError: "Invalid log level integer" for any other integer; "Unknown log
            level: <x>. Valid values are DEBUG, ERR, INFO, OFF, TRACE and WARN" for an
            unknown string. Same as PopTorch.
    """
    if isinstance(level, int) and not isinstance(level, bool):
        if level not in _LEGACY_INTS:
            raise ValueError("Invalid log level integer")
        level = _LEGACY_INTS[level]
    py_level = compiler_logging.level_from_name(str(level))
    compiler_logging.set_level(str(level))
    logger.setLevel(py_level)


setLogLevel(config.log_level())
