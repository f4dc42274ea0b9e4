"""Fixtures of the compiler's tests (nothing here imports ``poptorch``)."""
import logging

import pytest

from popart_compiler.logging import logger


@pytest.fixture
def compiler_logs(caplog):
    """``caplog`` on the compiler's logger (``poptorch:cpp``, which passes its records
    to the root logger, as PopTorch's loggers do), at DEBUG."""
    level = logger.level
    logger.setLevel(logging.DEBUG)
    caplog.set_level(logging.DEBUG)
    yield caplog
    logger.setLevel(level)
