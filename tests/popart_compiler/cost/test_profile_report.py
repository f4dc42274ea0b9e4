"""popart_compiler/cost/profile_report.py: profile.json / .pop / .html of an estimate."""
import json

import pytest
import torch
import torch.nn as nn

from popart_compiler.cost import cost_model
from popart_compiler.cost.ipu_model import target_for
from popart_compiler.cost.profile_report import FORMAT, render_html, write_report
from popart_compiler.errors import Error
from popart_compiler.ir import Graph
from popart_compiler.session_options import SessionOptions


@pytest.fixture(scope="module")
def estimate():
    graph = Graph(torch.export.export(nn.Linear(8, 4), (torch.randn(2, 8),), strict=False))
    return cost_model.estimate(graph, SessionOptions(), False, target_for("ipu2"))


def test_the_report_holds_the_estimates_figures(tmp_path, estimate):
    path = write_report(str(tmp_path / "run"), estimate, "my<model>", training=False)
    assert path == str(tmp_path / "run" / "profile.json")
    report = json.loads((tmp_path / "run" / "profile.json").read_text())
    assert (tmp_path / "run" / "profile.pop").read_text() == \
        (tmp_path / "run" / "profile.json").read_text()
    assert report["format"] == FORMAT and report["model_name"] == "my<model>"
    assert report["training"] is False and report["micro_batch"] == 2
    assert report["cycles"]["run"] == int(estimate.cycles.run_cycles)
    assert report["memory"][0]["total"] == int(estimate.memory[0].total)
    assert report["target"]["tiles"] == 1472


def test_the_page_escapes_the_name_and_shows_the_cycles(tmp_path, estimate):
    write_report(str(tmp_path), estimate, "my<model>", training=False)
    page = (tmp_path / "profile.html").read_text()
    report = json.loads((tmp_path / "profile.json").read_text())
    assert page == render_html(report)
    assert "<title>IPU Model profile: my&lt;model&gt;</title>" in page
    assert f"<b>{report['cycles']['run']:,}</b>" in page and "<script" not in page


def test_a_directory_that_cannot_be_made_raises_an_error(tmp_path, estimate):
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(Error, match="Cannot write the profile report"):
        write_report(str(tmp_path / "file" / "run"), estimate, "m", training=False)
    assert (tmp_path / "file").read_text() == "in the way"
