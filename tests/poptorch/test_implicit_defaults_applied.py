"""The compiler applies PopTorch's implicit session-option defaults, logs each one as
PopTorch does and the IPU Model's estimate follows them."""
import json
import os

import torch
import torch.nn as nn

import poptorch


class _TwoStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        x = poptorch.BeginBlock(self.a, ipu_id=0)(x)
        x = poptorch.BeginBlock(self.b, ipu_id=1)(x)
        return poptorch.identity_loss(x.sum(), reduction="none")


def _compile(model, opts):
    opts.showCompilationProgressBar(False)
    training = poptorch.trainingModel(model, opts,
                                      torch.optim.SGD(model.parameters(), lr=0.1))
    training.compile(torch.randn(64 * opts.Training.gradient_accumulation, 64))
    return training


def _accumulating(n):
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(n)
    return opts


def _defaults_in_report(opts, directory):
    """Compile with the profile report on; the report's implicit defaults."""
    opts.enableProfiling(str(directory)).modelName("two")
    training = _compile(_TwoStages(), opts)
    with open(os.path.join(directory, "two", "profile.json"), encoding="utf-8") as f:
        report = json.load(f)
    return training, report


def test_the_compiler_logs_and_applies_the_defaults(poptorch_logs, tmp_path):
    training, report = _defaults_in_report(_accumulating(8), tmp_path)
    text = poptorch_logs.text
    assert "autoRecomputation set to value Pipeline" in text
    assert "enablePipelining set to value true" in text
    assert "enableGradientAccumulation set to value true" in text
    assert "engineOptions[debug.retainDebugInformation] set to value false" in text
    assert report["implicit_defaults"]["autoRecomputation"] == "Pipeline"
    assert report["implicit_defaults"]["virtualGraphMode"] == "Manual"
    training.destroy()


def test_the_user_s_recomputation_choice_wins(tmp_path):
    opts = _accumulating(8)
    opts._Popart.set("autoRecomputation", 0)
    _, off = _defaults_in_report(opts, tmp_path / "off")
    _, on = _defaults_in_report(_accumulating(8), tmp_path / "on")
    assert "autoRecomputation" not in off["implicit_defaults"]
    # without recomputation stage 0 also stashes what it computes, not only its input
    assert off["memory"][0]["categories"]["pipeline stash"] > \
        on["memory"][0]["categories"]["pipeline stash"] > 0
