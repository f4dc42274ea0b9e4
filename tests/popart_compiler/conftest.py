"""Fixtures of the compiler's tests (nothing here imports ``poptorch``)."""
import logging

import pytest

from popart_compiler.logging import logger


@pytest.fixture
def compiler_logs(caplog):
    """``caplog`` on the compiler's logger (``poptorch:cpp``, which does not propagate
    to the root logger), at DEBUG."""
    level = logger.level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.DEBUG)
    caplog.set_level(logging.DEBUG)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)
