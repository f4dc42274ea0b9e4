"""Regressions found by a fresh user trying estimates, distributed training, op
coverage and backends (adversarial testing)."""
import pytest
import torch

import poptorch


def test_profile_report_directory_is_a_file_raises_poptorch_error(tmp_path):
    """enableProfiling pointing at a file: a poptorch.Error naming the directory, not a
    bare NotADirectoryError, and the model can be compiled again once fixed."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    model = torch.nn.Linear(4, 2)
    opts = poptorch.Options()
    opts.enableProfiling(str(blocker))
    ipu = poptorch.inferenceModel(model, opts)
    x = torch.randn(2, 4)
    with pytest.raises(poptorch.Error, match="Cannot write the profile report to"):
        ipu(x)
    good = poptorch.Options()
    good.enableProfiling(str(tmp_path / "reports"))
    out = poptorch.inferenceModel(model, good)(x)
    assert torch.allclose(out, model(x))
    assert (tmp_path / "reports" / "inference" / "profile.json").is_file()


class _NumpyInForward(torch.nn.Module):
    def forward(self, x):
        return torch.from_numpy(x.detach().cpu().numpy() * 2)  # the user's line


class _NumpyOfConstant(torch.nn.Module):
    def forward(self, x):
        k = torch.tensor([1.0, 2.0]).numpy()  # same on every run: known at capture
        return x * float(k.sum())


def test_numpy_of_run_time_tensor_names_the_read_and_the_line():
    """x.numpy() in forward was a bare "Failed to capture ...: .numpy() is not supported
    for tensor subclasses"; it is a data-dependence error like .tolist()."""
    with pytest.raises(poptorch.Error) as info:
        poptorch.inferenceModel(_NumpyInForward())(torch.ones(2))
    text = str(info.value)
    assert "tensor.numpy()" in text
    assert "test_regressions_fresh_user_b.py" in text and "the user's line" in text
    assert "torch.where" in text


def test_numpy_of_constant_tensor_is_known_at_capture():
    x = torch.randn(2)
    out = poptorch.inferenceModel(_NumpyOfConstant())(x)
    assert torch.allclose(out, x * 3.0)


def test_process_count_differing_from_torchrun_fails_at_once(monkeypatch):
    """configureProcessId(i, 3) under `torchrun --nproc-per-node 2` waited for a third
    process until the rendezvous timeout, then blamed MASTER_ADDR / MASTER_PORT."""
    import torch.distributed as dist
    from popart_compiler.runtime.collectives import ProcessGroup
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "fresh-user-b")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # never contacted: the check comes first
    with pytest.raises(poptorch.Error,
                       match=r"started this process as process 1 of 2 \(RANK / WORLD_SIZE\) "
                             r"but the options say process 1 of 3"):
        ProcessGroup(1, 3)
    assert not dist.is_initialized()
