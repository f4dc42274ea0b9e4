"""Shared fixtures: deterministic seeds and a clean PopTorch state per test."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def poptorch_logs(caplog):
    """Capture the ``poptorch::python`` / ``poptorch:cpp`` loggers with ``caplog``.

    The loggers do not propagate to the root logger (PopTorch formats its own lines), so
    the fixture attaches caplog's handler to them directly.
    """
    import logging
    import poptorch
    loggers = [logging.getLogger("poptorch::python"), logging.getLogger("poptorch:cpp")]
    for lg in loggers:
        lg.addHandler(caplog.handler)
    poptorch.setLogLevel("DEBUG")
    caplog.set_level(logging.DEBUG)
    yield caplog
    poptorch.setLogLevel("WARN")
    for lg in loggers:
        lg.removeHandler(caplog.handler)
