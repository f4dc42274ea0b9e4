"""``estimate`` (passes/estimate.py): the IPU Model's memory and cycles of the placed
program (``estimate``, returned on the compilation). The pass writes no file and
raises nothing for a program that does not fit: the runtime reports it
(``tests/popart_compiler/runtime/test_reports.py``)."""
import torch
import torch.nn as nn

from models import MLP, export
from popart_compiler import compiler
from popart_compiler.cost.cost_model import IpuEstimate
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.estimate import estimate
from popart_compiler.passes.placement import place
from popart_compiler.session_options import SessionOptions


def placed(module, x, options, training=False):
    g = export(module, x)
    c = Compilation(options, training)
    return g, place(g, c).compilation


def test_estimate_of_a_placed_program(run_pass):
    g, c = placed(MLP(), torch.randn(2, 4), SessionOptions())
    before = g.module.code
    result = run_pass(estimate, g, c)
    assert result.graph is g and result.changed is False and g.module.code == before
    est = result.compilation.estimate
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


def test_a_program_that_does_not_fit_is_estimated_quietly(run_pass, compiler_logs):
    """The pass only estimates: the runtime reports a program that does not fit
    (``runtime/reports.py``), even in strict mode."""
    g, c = placed(Wide(), torch.randn(1, 1024),
                  SessionOptions(small_ipu_model=True, strict_memory=True))
    c = run_pass(estimate, g, c).compilation
    assert c.estimate is not None and not c.estimate.fits
    assert "does not fit" not in compiler_logs.text


def test_the_pass_writes_no_report(run_pass, tmp_path):
    raw = {"engineOptions": {"autoReport.all": "true",
                             "autoReport.directory": str(tmp_path)}}
    g, c = placed(MLP(), torch.randn(2, 4), SessionOptions(raw=raw))
    c = run_pass(estimate, g, c).compilation
    assert c.estimate is not None and list(tmp_path.iterdir()) == []


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
