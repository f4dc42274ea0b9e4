"""``check_overlapped_io`` (passes/compiler_hints.py): docs/semantics.md S-66's rules for the
``set_overlap_for_input`` / ``set_overlap_for_output`` markers. The graphs hold the
``poptorch::`` ops, so this file imports their registration (``poptorch._ops.library``)."""
import pytest
import torch
import torch.nn as nn

import poptorch._ops.library as ops_library  # registers the poptorch:: ops
from models import MLP, export
from popart_compiler.enums import OutputMode
from popart_compiler.errors import Error
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.compiler_hints import check_overlapped_io
from popart_compiler.popart_options import PopartOptions
from popart_compiler.session_options import SessionOptions, StrategySettings

MODE = "OverlapAccumulationLoop"


class Overlap(nn.Module):
    def __init__(self, mode=MODE, input_twice=False, return_twice=False, internal=False):
        super().__init__()
        self.mode, self.input_twice = mode, input_twice
        self.return_twice, self.internal = return_twice, internal

    def forward(self, x):
        y = ops_library.OVERLAP_INPUT(x * 1 if self.internal else x, self.mode)
        if self.input_twice:
            y = y + x
        out = ops_library.OVERLAP_OUTPUT(y * 2, self.mode)
        if self.return_twice:
            return out, out
        return out if not self.internal else out + 1


def compilation(mode=OutputMode.Sum, raw=None):
    raw = {"execution_mode": 1, "numIOTiles": 32} if raw is None else raw
    return Compilation(SessionOptions(output_mode=mode, raw=raw,
                                      popart=PopartOptions.from_raw(raw),
                                      strategy=StrategySettings.from_raw(raw)), False)


@pytest.mark.parametrize("module,c", [
    (Overlap(), compilation(OutputMode.Sum)),
    (Overlap(), compilation(OutputMode.All, {"execution_mode": 2, "numIOTiles": 64})),
    (Overlap("NoOverlap"), compilation(OutputMode.Final, {})),  # no overlap: no rules
    (MLP(), compilation(OutputMode.Final, {})),
], ids=["sharded_sum", "phased_all", "no_overlap", "no_markers"])
def test_overlap_that_follows_the_rules(run_pass, module, c):
    g = export(module, torch.randn(2, 4))
    before = g.module.code
    result = run_pass(check_overlapped_io, g, c)
    assert result.graph is g and result.changed is False and g.module.code == before


@pytest.mark.parametrize("raw,mode,message", [
    ({"execution_mode": 0, "numIOTiles": 32}, OutputMode.All,
     r"Overlapped IO is not supported with poptorch\.PipelinedExecution"),
    ({"execution_mode": 1}, OutputMode.All,
     r"No IO tiles allocated\. You must allocate at least 32 IO tiles using "
     r"poptorch\.Options\(\)\.TensorLocations\.numIOTiles"),
    ({"execution_mode": 1, "numIOTiles": 16}, OutputMode.All, "No IO tiles allocated"),
    ({"execution_mode": 1, "numIOTiles": 32}, OutputMode.Final,
     r"Unsupported output mode for overlapped IO: use poptorch\.OutputMode\.All or "
     r"poptorch\.OutputMode\.Sum"),
])
def test_options_that_break_the_rules(raw, mode, message):
    g = export(Overlap(), torch.randn(2))
    with pytest.raises(Error, match=message):
        check_overlapped_io(g, compilation(mode, raw))


@pytest.mark.parametrize("module,message", [
    # PopTorch's wording
    (Overlap(internal=True), r"poptorch\.set_overlap_for_input applied on a node which is "
                             r"not a tensor input to the model"),
    (Overlap(input_twice=True), r"poptorch\.set_overlap_for_input must be the only op "
                                r"applied to an input\. This is not the case for input x"),
    (Overlap(return_twice=True), r"poptorch\.set_overlap_for_output cannot be used with a "
                                 r"tensor that is returned twice"),
], ids=["internal_input", "input_used_twice", "returned_twice"])
def test_markers_in_the_wrong_place(module, message):
    g = export(module, torch.randn(2))
    with pytest.raises(Error, match=message):
        check_overlapped_io(g, compilation())


def test_output_marker_on_a_value_that_is_not_returned():
    class Internal(nn.Module):
        def forward(self, x):
            return ops_library.OVERLAP_OUTPUT(x * 2, MODE) + 1

    g = export(Internal(), torch.randn(2))
    with pytest.raises(Error, match=r"poptorch\.set_overlap_for_output applied on a node "
                                    r"which is not a tensor output to the model"):
        check_overlapped_io(g, compilation())
