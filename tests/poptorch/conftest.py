"""Fixtures shared by the feature tests."""
import pytest
import torch


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
