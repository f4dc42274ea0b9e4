"""Shared fixtures: deterministic seeds and a clean PopTorch state per test.

The suite runs PyTorch on one intra-op thread: its models are tiny, a second thread
brings nothing, and on a busy machine OpenMP's synchronisation between contended
threads makes each small kernel many times slower. ``POPTORCH_TEST_THREADS=N``
overrides it.

Every compiler pass is followed by the graph verifier (``POPTORCH_VERIFY=1``, see
``popart_compiler/verify.py``) unless the variable is set otherwise.

The suite runs the ``eager`` backend unless a test asks for another
(``POPTORCH_COMPILER=eager`` unless the variable is set otherwise; ``poptorch.Options()``
defaults to ``auto``, whose choices would depend on how long each test has run and on
the decisions recorded by earlier tests); ``POPTORCH_COMPILER=auto pytest``
runs the suite with ``auto``. Each test records the ``auto`` backend's decisions in
its own directory (``POPTORCH_AUTO_DECISIONS_DIR``), so that no test reuses another's
decision or the user's.

Every test can ``import models`` (``tests/models.py``, the shared tiny models): pytest
runs with ``--import-mode=importlib``, which leaves ``sys.path`` untouched, so the module
is loaded here by its path. ``tests/`` itself is never put on ``sys.path``: its folders
``poptorch/`` and ``popart_compiler/`` would shadow the packages of the same names where
the repository root is not on the path (a plain ``pytest`` with an editable install).
"""
import hashlib
import importlib.util
import os
import signal
import sys

import pytest
import torch

torch.set_num_threads(int(os.environ.get("POPTORCH_TEST_THREADS", "1") or "1"))
os.environ.setdefault("POPTORCH_VERIFY", "1")
os.environ.setdefault("POPTORCH_COMPILER", "eager")


def _load_module(name, relative_path):
    """``tests/<relative_path>`` as the module ``name``: ``models`` (reference
    models) and ``processes`` (starting the multi-process tests' processes)."""
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), relative_path)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


_load_module("models", "models.py")
_load_module("processes", os.path.join("poptorch", "processes.py"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _auto_decisions(request, tmp_path_factory, monkeypatch):
    """A decision store of the test's own (created only if the test records one)."""
    name = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    where = tmp_path_factory.getbasetemp() / "auto-decisions" / name
    monkeypatch.setenv("POPTORCH_AUTO_DECISIONS_DIR", str(where))
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


@pytest.fixture
def default_sigint():
    """Python's default SIGINT handler, for a test that sends SIGINT: the suite may run
    with SIGINT ignored (a background job, ``nohup``, some CI runners), and Python then
    does not install its handler at start-up. The previous handler is restored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
