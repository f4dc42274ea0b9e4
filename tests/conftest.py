"""Shared fixtures: deterministic seeds and a clean PopTorch state per test.

The suite runs PyTorch on one intra-op thread: its models are tiny, a second thread
brings nothing, and on a busy machine OpenMP's synchronisation between contended
threads makes each small kernel many times slower. ``POPTORCH_TEST_THREADS=N``
overrides it.

Every compiler pass is followed by the graph verifier (``POPTORCH_VERIFY=1``, see
``popart_compiler/verify.py``) unless the variable is set otherwise.
"""
import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("POPTORCH_TEST_THREADS", "1") or "1"))
os.environ.setdefault("POPTORCH_VERIFY", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def poptorch_logs(caplog):
    """Capture the ``poptorch::python`` / ``poptorch:cpp`` loggers with ``caplog`` at
    DEBUG level (they pass their records to the root logger, as PopTorch's do)."""
    import logging
    import poptorch
    poptorch.setLogLevel("DEBUG")
    caplog.set_level(logging.DEBUG)
    yield caplog
    poptorch.setLogLevel("WARN")
