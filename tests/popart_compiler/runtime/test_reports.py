"""``report`` (runtime/reports.py): what the runtime reports about an executable it is
given: the profile report when asked for (docs/semantics.md S-85), then a program that does not fit:
    a
warning, as Poplar's IPU Model, or the error in strict mode (after the report)."""
import json

import pytest
import torch
import torch.nn as nn

from models import MLP, export
from popart_compiler import compiler
from popart_compiler.errors import Error
from popart_compiler.runtime.reports import report
from popart_compiler.session_options import SessionOptions


class Wide(nn.Module):
    """A 4 MiB float32 weight: more than the 4-tile IPU Model's 2.4 MiB."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1024, 1024)

    def forward(self, x):
        return self.fc(x)


def profiling(tmp_path, **engine):
    return {"engineOptions": {"autoReport.all": "true",
                              "autoReport.directory": str(tmp_path), **engine}}


def test_profile_report_is_written_when_asked_for(tmp_path):
    exe = compiler.compile(export(MLP(), torch.randn(2, 4)),
                           SessionOptions(raw=profiling(tmp_path)), False)
    assert list(tmp_path.iterdir()) == []  # the compiler writes nothing
    report(exe)
    written = json.loads((tmp_path / "inference" / "profile.json").read_text())
    assert written["model_name"] == "inference" and written["training"] is False
    assert written["cycles"]["run"] == int(exe.estimate.cycles.run_cycles)
    assert sorted(p.name for p in (tmp_path / "inference").iterdir()) == \
        ["profile.html", "profile.json", "profile.pop"]


def test_nothing_is_written_unless_asked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report(compiler.compile(export(MLP(), torch.randn(2, 4)), SessionOptions(), False))
    assert list(tmp_path.iterdir()) == []


def test_out_of_memory_warns(compiler_logs):
    exe = compiler.compile(export(Wide(), torch.randn(1, 1024)),
                           SessionOptions(small_ipu_model=True), False)
    assert not exe.estimate.fits
    report(exe)
    assert "The program does not fit in the IPU's memory (the IPU Model runs it" in \
        compiler_logs.text


def test_out_of_memory_in_strict_mode_raises_after_writing_the_report(tmp_path):
    options = SessionOptions(small_ipu_model=True, strict_memory=True,
                             raw=profiling(tmp_path))
    exe = compiler.compile(export(Wide(), torch.randn(1, 1024)), options, False)
    with pytest.raises(Error) as info:
        report(exe)
    assert info.value.type == "poplar_out_of_memory"
    written = json.loads((tmp_path / "inference" / "profile.json").read_text())
    assert written["fits"] is False
    allowed = SessionOptions(small_ipu_model=True, strict_memory=True,
                             raw={"engineOptions": {"debug.allowOutOfMemory": "true"}})
    report(compiler.compile(export(Wide(), torch.randn(1, 1024)), allowed, False))
