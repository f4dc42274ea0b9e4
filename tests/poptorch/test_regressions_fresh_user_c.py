"""Regressions found by a fresh-user attack on the inductor warm-up (issue 11) and the
executor / optimizer refactor."""
import pytest
import torch
import torch.nn as nn

import poptorch
from popart_compiler import inductor_backend


class _Inverse(nn.Module):
    def forward(self, x):
        return torch.linalg.inv(x) * 2


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_inductor_warm_up_on_zero_inputs_does_not_fail_a_valid_model():
    """The warm-up runs the compiled kernels on zero inputs; a model that raises on
    those (``linalg.inv`` of a zero matrix is singular) but not on the user's inputs
    compiles and runs, and a kernel error of a real run is PyTorch's own error (not
    Dynamo's "Attempt to trace generator"), as on the eager backend."""
    x = torch.eye(3).expand(2, 3, 3) * torch.tensor([2.0, 4.0])[:, None, None]
    opts = poptorch.Options()
    opts.Backend.compiler("inductor")
    model = poptorch.inferenceModel(_Inverse(), opts)
    before = inductor_backend.compile_count()
    model.compile(x)
    assert inductor_backend.compile_count() == before + 1
    torch.testing.assert_close(model(x), torch.linalg.inv(x) * 2)
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        model(torch.zeros(2, 3, 3))
    torch.testing.assert_close(model(x * 2), torch.linalg.inv(x * 2) * 2)
    assert inductor_backend.compile_count() == before + 1


class _HostWork(nn.Module):
    def __init__(self, calls):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cpu = poptorch.CPU(lambda x: calls.append(x.clone()) or x * 2, "host")

    def forward(self, x):
        return self.cpu(poptorch.ipu_print_tensor(self.fc(x), "hval"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_inductor_warm_up_does_not_run_host_ops(capfd):
    """``compile()`` with the inductor compiler calls a ``poptorch.CPU`` function and
    prints an ``ipu_print_tensor`` exactly as the eager backend does: the host function
    once (the capture's example call), no print; the warm-up's trial run on zeros would
    add a host call and a print of made-up values, so such programs compile their
    kernels at the first run."""
    calls = []
    model = _HostWork(calls)
    x = torch.ones(2, 4)
    opts = poptorch.Options()
    opts.Backend.compiler("inductor")
    inference = poptorch.inferenceModel(model, opts)
    before = inductor_backend.compile_count()
    capfd.readouterr()
    inference.compile(x)
    assert len(calls) == 1 and "hval:" not in capfd.readouterr().err
    out = inference(x)
    assert inductor_backend.compile_count() == before + 1
    assert len(calls) == 2 and capfd.readouterr().err.count("hval:") == 1
    torch.testing.assert_close(calls[1], model.fc(x).detach())
    torch.testing.assert_close(out, model.fc(x).detach() * 2)
