"""Fixtures shared by the feature tests; ``import processes`` gives the helpers that
start the multi-process tests' processes (``tests/poptorch/processes.py``, loaded here
by its path as ``tests/conftest.py`` loads ``models``)."""
import importlib.util
import os
import sys

import pytest
import torch


def _load_processes():
    if "processes" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "processes.py")
        spec = importlib.util.spec_from_file_location("processes", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["processes"] = module
        spec.loader.exec_module(module)


_load_processes()


@pytest.fixture
def captures(monkeypatch):
    """Counts calls of ``torch.export.export`` (PopTorch's capture)."""
    calls = []
    real = torch.export.export

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(torch.export, "export", counting)
    return calls


@pytest.fixture
def clean_options_env(monkeypatch):
    """No environment variable that changes ``poptorch.Options`` (default options, the
    cache directory, Open MPI's process count and rank, Poplar engine options, the
    variables the option files of ``test_options*.py`` read)."""
    for var in ("POPTORCH_DEFAULT_OPTIONS", "POPTORCH_CACHE_DIR", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_RANK", "POPLAR_ENGINE_OPTIONS", "MY_NUM", "MY_ID"):
        monkeypatch.delenv(var, raising=False)
