"""Fixtures shared by the feature tests."""
import pytest
import torch

from popart_compiler.backends import direct
from popart_compiler.backends import inductor as inductor_backend


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


@pytest.fixture
def compiled_always(monkeypatch):
    """Graphs of prepacked kernels only are compiled by TorchInductor like any other,
    instead of run as they are (:mod:`popart_compiler.backends.direct`)."""
    monkeypatch.setattr(direct, "runner", lambda gm: None)


@pytest.fixture
def stand_in(monkeypatch, compiled_always):  # pylint: disable=unused-argument
    """TorchInductor's compilation replaced by the graph itself (no compile), every
    graph handed to it (:func:`compiled_always`); yields the list of graph modules
    handed to it."""
    compiled = []

    def fake(gm, example_inputs, *, random):  # pylint: disable=unused-argument
        compiled.append(gm)
        return gm
    monkeypatch.setattr(inductor_backend, "_inductor", fake)
    return compiled
