"""``estimate`` (passes/estimate.py): the IPU Model's memory and cycles of the placed
program (``c.estimate``), the profile report when asked for (docs/semantics.md S-85) and the report
of a
program that does not fit: a warning, as Poplar's IPU Model, or the error in strict
mode."""
import json

import pytest
import torch
import torch.nn as nn

from models import MLP, export
from popart_compiler import compiler
from popart_compiler.cost.cost_model import IpuEstimate
from popart_compiler.errors import Error
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.estimate import estimate
from popart_compiler.passes.placement import place
from popart_compiler.session_options import SessionOptions


def placed(module, x, options, training=False):
    g = export(module, x)
    c = Compilation(options, training)
    place(g, c)
    return g, c


def test_estimate_of_a_placed_program(run_pass):
    g, c = placed(MLP(), torch.randn(2, 4), SessionOptions())
    before = g.module.code
    result = run_pass(estimate, g, c)
    assert result.graph is g and result.changed is False and g.module.code == before
    est = c.estimate
    assert isinstance(est, IpuEstimate) and est.fits and len(est.memory) == 1
    assert est.target.name == "ipu2" and est.micro_batch == 2 and est.replicas == 1
    assert est.cycles.run_cycles > 0 and est.samples_per_second > 0
    assert 0 < est.memory[0].total < est.memory[0].capacity


class Wide(nn.Module):
    """A 4 MiB float32 weight: more than the 4-tile IPU Model's 2.4 MiB."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1024, 1024)

    def forward(self, x):
        return self.fc(x)


def test_out_of_memory_warns_and_estimates(run_pass, compiler_logs):
    g, c = placed(Wide(), torch.randn(1, 1024), SessionOptions(small_ipu_model=True))
    run_pass(estimate, g, c)
    assert c.estimate is not None and not c.estimate.fits
    assert "The program does not fit in the IPU's memory (the IPU Model runs it" in \
        compiler_logs.text


def test_out_of_memory_in_strict_mode_raises():
    g, c = placed(Wide(), torch.randn(1, 1024),
                  SessionOptions(small_ipu_model=True, strict_memory=True))
    with pytest.raises(Error) as info:
        estimate(g, c)
    assert info.value.type == "poplar_out_of_memory"
    assert c.estimate is None
    allowed = SessionOptions(small_ipu_model=True, strict_memory=True,
                             raw={"engineOptions": {"debug.allowOutOfMemory": "true"}})
    g, c = placed(Wide(), torch.randn(1, 1024), allowed)
    estimate(g, c)
    assert not c.estimate.fits


def test_profile_report_is_written_when_asked_for(run_pass, tmp_path):
    raw = {"engineOptions": {"autoReport.all": "true",
                             "autoReport.directory": str(tmp_path)}}
    g, c = placed(MLP(), torch.randn(2, 4), SessionOptions(raw=raw))
    run_pass(estimate, g, c)
    report = json.loads((tmp_path / "inference" / "profile.json").read_text())
    assert report["model_name"] == "inference" and report["training"] is False
    assert report["cycles"]["run"] == int(c.estimate.cycles.run_cycles)
    assert sorted(p.name for p in (tmp_path / "inference").iterdir()) == \
        ["profile.html", "profile.json", "profile.pop"]


class Exps(nn.Module):
    """Four element-wise ops on a [256, 256] tensor in ``dtype``."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        y = x.to(self.dtype)
        for _ in range(4):
            y = torch.exp(y) * 0.5
        return y.float()


def test_a_demoted_float64_program_is_estimated_as_float32():
    """docs/semantics.md S-44: the IPU has no 64-bit type; a float64 program runs, and is estimated,
    as the float32 one."""
    x = torch.randn(256, 256)
    memory = {}
    for dtype in (torch.float32, torch.float64):
        exe = compiler.compile(export(Exps(dtype), x), SessionOptions(), False)
        memory[dtype] = exe.estimate.memory[0].categories["activations"]
    assert memory[torch.float64] == memory[torch.float32]
