"""popart_compiler/runtime/pipeline.py: what a pipeline across processes refuses
before any process waits (no process group is created here)."""
import dataclasses

import pytest

from popart_compiler.enums import CommGroupType, OutputMode
from popart_compiler.errors import Error
from popart_compiler.runtime.pipeline import _check, join_pipeline
from popart_compiler.session_options import Anchor, ReplicaGrouping

OPTION = "Options.Distributed.pipelineAcrossProcesses"


def _with(exe, **options):
    return dataclasses.replace(exe, options=dataclasses.replace(exe.options, **options))


def test_a_model_of_one_stage_is_refused(compile_blocks):
    _, exe = compile_blocks(["a", "a"], num_processes=2)
    with pytest.raises(Error, match=f"{OPTION} runs each pipeline stage in its own "
                                    "process, but this model has one pipeline stage"):
        _check(exe)


def test_one_process_replica_groupings_and_weight_anchors_are_refused(pipelined):
    _, exe = pipelined
    with pytest.raises(Error, match="runs as 3 pipeline stages, one per process, but only "
                                    "1 process was started"):
        _check(exe)
    grouped = _with(exe, num_processes=3, replica_groupings={
        "layers.0.weight": ReplicaGrouping(CommGroupType.All, 1)})
    with pytest.raises(Error, match=r"does not support replica-grouped weights "
                                    r"\(layers.0.weight\)"):
        _check(grouped)
    anchored = dataclasses.replace(_with(exe, num_processes=3), state_anchors=[
        Anchor("layers.0.weight", OutputMode.All)])
    with pytest.raises(Error, match="cannot anchor weights"):
        _check(anchored)
    _check(_with(exe, num_processes=3))  # three processes: accepted


def test_processes_per_pipeline_must_equal_its_stages(pipelined):
    _, exe = pipelined
    with pytest.raises(Error, match=r"runs as 3 pipeline stages \(IPU 0 → IPU 1 → IPU 0; "
                                    r".*but 2 processes per pipeline were started"):
        join_pipeline(_with(exe, num_processes=2), None, "cpu")
    with pytest.raises(Error, match="but 2 processes per pipeline were declared. Start 3 "
                                    "processes per pipeline replica"):
        join_pipeline(_with(exe, num_processes=6, pipeline_stages=2), None, "cpu")
