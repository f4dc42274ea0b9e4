"""The compiler applies PopTorch's implicit session-option defaults, logs each one as
PopTorch does and the IPU Model's estimate follows them."""
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


def test_the_compiler_logs_and_applies_the_defaults(poptorch_logs):
    training = _compile(_TwoStages(), _accumulating(8))
    text = poptorch_logs.text
    assert "autoRecomputation set to value Pipeline" in text
    assert "enablePipelining set to value true" in text
    assert "enableGradientAccumulation set to value true" in text
    assert "engineOptions[debug.retainDebugInformation] set to value false" in text
    report = training.ipuModelEstimate()
    assert report["implicit_defaults"]["autoRecomputation"] == "Pipeline"
    assert report["implicit_defaults"]["virtualGraphMode"] == "Manual"
    training.destroy()


def test_the_user_s_recomputation_choice_wins():
    opts = _accumulating(8)
    opts._Popart.set("autoRecomputation", 0)
    off = _compile(_TwoStages(), opts).ipuModelEstimate()
    on = _compile(_TwoStages(), _accumulating(8)).ipuModelEstimate()
    assert "autoRecomputation" not in off["implicit_defaults"]
    # without recomputation stage 0 also stashes what it computes, not only its input
    assert off["memory"][0]["categories"]["pipeline stash"] > \
        on["memory"][0]["categories"]["pipeline stash"] > 0
