"""The ``session_defaults`` pass: PopTorch's implicit session-option defaults
(Compiler.cpp initSession's setOptionIfNotSet), one test per default, and the pass
applying them (over several IPUs: tests/poptorch/test_implicit_defaults_applied.py)."""
import torch
import torch.nn as nn

from popart_compiler import compiler
from popart_compiler.ir import Graph
from popart_compiler.session_options import SessionOptions
from popart_compiler.implicit_defaults import (ProgramFacts, implicit_defaults,
                                               with_defaults)


def options(raw):
    """The session options of an option dictionary, as ``poptorch`` builds them."""
    return SessionOptions.from_dict(raw)


def _of(raw, **facts):
    found = implicit_defaults(options(raw), ProgramFacts(**{"training": True, **facts}))
    return {d.key: d.value for d in found}


PIPELINED, SHARDED, PHASED = 0, 1, 2


def test_retain_debug_information_defaults_to_false_unless_given():
    assert _of({})["engineOptions[debug.retainDebugInformation]"] == "false"
    given = {"engineOptions": {"debug.retainDebugInformation": "true"}}
    assert "engineOptions[debug.retainDebugInformation]" not in _of(given)
    none = options({})
    assert with_defaults(none, implicit_defaults(none, ProgramFacts(True))).raw[
        "engineOptions"] == {"debug.retainDebugInformation": "false"}


def test_pipelining_follows_the_ipus_used():
    assert _of({"execution_mode": PIPELINED}, used_ipus=1)["enablePipelining"] is False
    assert _of({"execution_mode": PIPELINED}, used_ipus=4)["enablePipelining"] is True
    assert _of({"execution_mode": SHARDED}, used_ipus=4)["enablePipelining"] is False
    assert _of({"execution_mode": PHASED}, used_ipus=2)["enablePipelining"] is False
    assert "enablePipelining" not in _of({"enablePipelining": False}, used_ipus=4)


def test_recomputation_defaults_to_pipeline_over_several_ipus_only():
    assert _of({}, used_ipus=4)["autoRecomputation"] == 3  # RecomputationType.Pipeline
    assert "autoRecomputation" not in _of({}, used_ipus=1)
    assert "autoRecomputation" not in _of({"execution_mode": SHARDED}, used_ipus=4)
    assert "autoRecomputation" not in _of({"autoRecomputation": 0}, used_ipus=4)


def test_virtual_graph_mode_follows_the_strategy():
    auto, manual, phases = 2, 1, 3
    assert _of({}, used_ipus=1)["virtualGraphMode"] == auto
    assert _of({}, used_ipus=2)["virtualGraphMode"] == manual
    assert _of({"execution_mode": SHARDED}, used_ipus=1)["virtualGraphMode"] == auto
    assert _of({"execution_mode": SHARDED}, used_ipus=1,
               overlapped_io=True)["virtualGraphMode"] == manual
    assert _of({"execution_mode": PHASED}, used_ipus=2)["virtualGraphMode"] == phases
    assert "virtualGraphMode" not in _of({"virtualGraphMode": 0})


def test_phased_execution_counts_phases_and_moves_tensors_off_chip():
    serial = _of({"execution_mode": PHASED}, used_ipus=2, max_phase=3)
    assert serial["executionPhaseSettings.phases"] == 4
    assert serial["executionPhaseSettings.stages"] == 1
    parallel = _of({"execution_mode": PHASED, "serial_phases_execution": False,
                    "separate_backward_phase": True}, used_ipus=2, max_phase=3)
    assert parallel["executionPhaseSettings.phases"] == 5
    assert parallel["executionPhaseSettings.stages"] == 2
    off_chip_after = _of({"execution_mode": PHASED, "tensors_liveness": 1}, max_phase=3)
    assert off_chip_after["executionPhaseSettings.phases"] == 7
    for key in ("location_activation", "location_weight", "location_optimizer",
                "location_accumulator"):
        assert serial[key] == "OffChip"
    user = {"execution_mode": PHASED, "location_weight": {"onChip": 1}}
    assert "location_weight" not in _of(user)
    phased = with_defaults(options(user), implicit_defaults(options(user), ProgramFacts(True)))
    assert phased.raw["location_weight"] == {"onChip": 1}
    assert phased.raw["location_optimizer"] == {"onChip": 0}
    assert phased.popart.location_weight.on_chip is True
    assert phased.popart.location_optimizer.on_chip is False


def test_clipping_with_pipelining_schedules_the_outer_fragment():
    key = "accumulateOuterFragmentSettings.schedule"
    assert _of({}, used_ipus=2, clipping=True)[key] == 0  # Scheduler
    assert key not in _of({}, used_ipus=2, clipping=False)
    assert key not in _of({key: 3}, used_ipus=2, clipping=True)


def test_rng_state_offload_defaults_on():
    assert _of({})["enableLoadAndOffloadRNGState"] is True
    assert "enableLoadAndOffloadRNGState" not in _of({"enableLoadAndOffloadRNGState": False})


def test_replication_defaults():
    raw = {"replication_factor": 4, "num_distributed_processes": 2,
           "distributed_process_id": 1}
    found = _of(raw)
    assert found["enableDistributedReplicatedGraphs"] is True
    assert found["globalReplicationFactor"] == 8
    assert found["globalReplicaOffset"] == 4
    assert found["enableReplicatedGraphs"] is True
    single = _of({})
    assert single["enableReplicatedGraphs"] is False
    assert single["globalReplicationFactor"] == 1
    assert "globalReplicationFactor" not in _of({"globalReplicationFactor": 16})


def test_constant_weights_default_off():
    assert _of({})["constantWeights"] is False


def test_gradient_accumulation_flag_follows_the_factor():
    assert _of({"gradient_accumulation": 8})["enableGradientAccumulation"] is True
    assert _of({"gradient_accumulation": 1})["enableGradientAccumulation"] is False
    inference = implicit_defaults(options({"gradient_accumulation": 8}), ProgramFacts(False))
    assert {d.key: d.value for d in inference}["enableGradientAccumulation"] is False


def test_host_copy_ops_and_explicit_loops_only_with_overlapped_io():
    assert "useHostCopyOps" not in _of({})
    found = _of({"execution_mode": SHARDED}, overlapped_io=True)
    assert found["useHostCopyOps"] is True and found["enableExplicitMainLoops"] is True
    assert "useHostCopyOps" not in _of({"useHostCopyOps": False}, overlapped_io=True)


def test_a_program_on_no_ipu_gets_no_defaults():
    assert implicit_defaults(options({}), ProgramFacts(True, used_ipus=0)) == ()



def test_the_pass_logs_and_records_the_defaults_of_a_one_ipu_program(compiler_logs):
    module = nn.Linear(4, 2)
    graph = Graph(torch.export.export(module, (torch.randn(3, 4),)))
    exe = compiler.compile(graph, SessionOptions(), False)
    found = {d.key: d.value for d in exe.defaults}
    assert found["enablePipelining"] is False and "autoRecomputation" not in found
    assert exe.options.raw["enableLoadAndOffloadRNGState"] is True
    assert exe.options.raw["virtualGraphMode"] == 2  # Auto
    assert exe.options.popart.rng_state is True and exe.options.popart.enable_pipelining is False
    assert "virtualGraphMode" in exe.options.popart.set_keys
    assert "enablePipelining set to value false" in compiler_logs.text
    assert {d.key: d.shown for d in exe.estimate.defaults}["constantWeights"] == "false"
