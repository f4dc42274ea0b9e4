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
