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
