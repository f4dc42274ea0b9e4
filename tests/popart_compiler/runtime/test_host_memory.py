"""``popart_compiler.runtime.host_memory``: the allocator keeps freed host memory once a
CPU program is lowered, unless ``POPTORCH_RETAIN_HOST_MEMORY=0``."""
import pytest
import torch

import poptorch
from popart_compiler.runtime import host_memory


@pytest.fixture
def fresh(monkeypatch):
    """A process in which nothing was set yet; ``calls`` records mallopt's arguments."""
    calls = []
    real = host_memory._glibc_mallopt()

    def spy():
        if real is None:
            return None

        def mallopt(option, value):
            calls.append((option, value))
            return real(option, value)
        return mallopt
    monkeypatch.setattr(host_memory, "_state", None)
    monkeypatch.setattr(host_memory, "_glibc_mallopt", spy)
    return calls, real


def test_the_first_cpu_lowering_sets_the_allocator_once(fresh, monkeypatch):
    calls, real = fresh
    monkeypatch.delenv(host_memory.ENV, raising=False)
    model = poptorch.inferenceModel(torch.nn.Linear(3, 2))
    model(torch.randn(4, 3))
    poptorch.inferenceModel(torch.nn.Linear(3, 2))(torch.randn(4, 3))
    if real is None:
        pytest.skip("the C library is not glibc")
    assert calls == [(-3, host_memory.MMAP_THRESHOLD), (-1, host_memory.TRIM_THRESHOLD)]
    assert host_memory.retain_freed_memory() is True


@pytest.mark.parametrize("value", ["0", "false"])
def test_turned_off_the_allocator_keeps_its_defaults(fresh, monkeypatch, value):
    calls, _ = fresh
    monkeypatch.setenv(host_memory.ENV, value)
    model = poptorch.inferenceModel(torch.nn.Linear(3, 2))
    x = torch.randn(4, 3)
    torch.testing.assert_close(model(x), model.model(x).detach())
    assert calls == [] and host_memory.retain_freed_memory() is False


def test_a_bad_value_is_a_clear_error(fresh, monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "sometimes")
    with pytest.raises(poptorch.Error, match=host_memory.ENV):
        host_memory.retain_freed_memory()
