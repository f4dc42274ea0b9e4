"""Tests of ``poptorch.Options`` (docs/api-sections.md options §1–§9): defaults and the storage
model (§1, §2), freezing, cloning and pickling (§1.7, §1.8), the top-level setters (§3). The
sub-groups, ``toDict`` / ``repr``, loading and deprecated names: ``test_options_groups.py``."""
import copy
import pickle

import pytest
import torch

from poptorch import enums
from poptorch._options.execution_strategy import (ParallelPhasedExecution, Phase,
                                                  PipelinedExecution, SerialPhasedExecution,
                                                  ShardedExecution, Stage)
from poptorch.options import Options, TensorLocationSettings

pytestmark = pytest.mark.usefixtures("clean_options_env")


# ---------------------------------------------------------------------------
# Defaults and storage model (§1, §2)
# ---------------------------------------------------------------------------

def test_defaults():
    opts = Options()
    assert opts.device_iterations == 1
    assert opts.replication_factor == 1
    assert opts.input_group_size == 1
    assert opts.input_cgt is enums.CommGroupType.Consecutive
    assert opts.broadcast_buffers is True
    assert opts.output_mode == 4 and opts.output_mode == enums.OutputMode.Default
    assert type(opts.output_mode) is int
    assert opts.output_return_period == 1
    assert opts.anchored_tensors == {}
    assert opts.auto_round_num_ipus is False
    assert opts.available_memory_proportion == {}
    assert opts.log_dir == "."
    assert opts.max_repeat_logs == 4
    assert opts.connection_type == 0 and type(opts.connection_type) is int
    assert opts.sync_pattern == 0
    assert opts.defaultOutputMode() is True
    assert opts.Training.gradient_accumulation == 1
    assert opts.Training.accumulation_and_replication_reduction_type is enums.ReductionType.Mean
    assert (opts.Training.meanAccumulationAndReplicationReductionStrategy
            is enums.MeanReductionStrategy.Post)
    assert opts.Distributed.processId == 0 and opts.Distributed.numProcesses == 1
    assert opts.Distributed.ipuof_configs == {}
    assert opts._Popart.options == {"instrumentWithHardwareCycleCounter": False,
                                    "rearrangeAnchorsOnHost": False}
    assert opts.TensorLocations.toDict() == {}
    assert opts.Jit.toDict() == {} and opts.Precision.toDict() == {}
    # Private flags used by the executor.
    assert isinstance(opts._execution_strategy, PipelinedExecution)
    assert opts._execution_strategy._auto_stage is enums.AutoStage.SameAsIpu
    assert opts._show_compilation_progress_bar is True
    assert opts._relax_optimizer_attributes_checks is False
    assert opts._module_namescope_enabled is True
    assert opts._source_location_excludes == [
        "install/poptorch", "site-packages/torch", "site-packages/poptorch"]
    assert opts._is_frozen is False


def test_insertion_order_of_values():
    assert list(Options()._values) == [
        "device_iterations", "log_dir", "auto_round_num_ipus", "anchored_tensors",
        "output_mode", "output_return_period", "replication_factor", "input_group_size",
        "input_cgt", "broadcast_buffers", "connection_type", "sync_pattern",
        "available_memory_proportion", "max_repeat_logs"]


def test_type_checks():
    opts = Options()
    with pytest.raises(AssertionError, match="Unexpected type <class 'float'> for option "
                       "device_iterations. Expected <class 'int'>"):
        opts.deviceIterations(2.0)
    assert opts.device_iterations == 1
    # bool is accepted where an int is stored.
    opts.deviceIterations(True)
    assert opts.device_iterations is True
    with pytest.raises(AssertionError, match="Unexpected type"):
        opts.replication_factor = "4"
    with pytest.raises(AssertionError, match="Unexpected type"):
        opts.Training.setMeanAccumulationAndReplicationReductionStrategy(1)
    with pytest.raises(AssertionError, match="Unexpected type"):
        opts.broadcastBuffers(1)


def test_unknown_key_and_attributes():
    opts = Options()
    with pytest.raises(AssertionError, match="Invalid option foo, valid options are"):
        opts.set(foo=1)
    with pytest.raises(AttributeError, match=r"Invalid attribute foo\."):
        _ = opts.foo
    with pytest.raises(AttributeError, match=r"Invalid attribute random_seed\."):
        _ = opts.random_seed
    with pytest.raises(AttributeError, match="Invalid private attribute _foo. Valid attributes:"):
        opts._foo = 3
    with pytest.raises(AttributeError, match="Invalid private attribute _bar"):
        opts.Training._bar = 3
    with pytest.raises(AssertionError, match="Invalid option bar"):
        opts.bar = 1
    # existing private attributes can be reassigned while unfrozen
    opts._module_namescope_enabled = False
    assert opts._module_namescope_enabled is False


def test_attribute_assignment_and_call():
    opts = Options()
    opts.replication_factor = 4
    assert opts.replication_factor == 4
    assert opts("replication_factor") == 4
    opts.Training.gradient_accumulation = 3
    assert opts.Training("gradient_accumulation") == 3
    with pytest.raises(AssertionError, match="Invalid option nope"):
        opts("nope")


def test_helpers():
    opts = Options()
    assert opts.exists("device_iterations") and not opts.exists("model_name")
    opts.createOrSet(model_name="abc")
    assert opts.model_name == "abc"
    opts.createOrSet(model_name="xyz")
    assert opts.model_name == "xyz"
    with pytest.raises(AssertionError, match="Unexpected type"):
        opts.createOrSet(model_name=3)
    opts.deleteIfExists("model_name")
    opts.deleteIfExists("model_name")
    assert not opts.exists("model_name")
    merged = opts.Training.update({"a": 1})
    assert merged == {"a": 1, "gradient_accumulation": 1,
                      "accumulation_and_replication_reduction_type": enums.ReductionType.Mean,
                      "meanAccumulationAndReplicationReductionStrategy":
                      enums.MeanReductionStrategy.Post}
    with pytest.raises(AssertionError, match="Can't merge dictionaries, they have some keys "
                       "in common"):
        opts.Training.update({"gradient_accumulation": 5})
    assert opts.Training.toDict()["gradient_accumulation"] == 1


# ---------------------------------------------------------------------------
# Freezing, cloning, pickling (§1.7, §1.8)
# ---------------------------------------------------------------------------

FROZEN = "Can't modify frozen Options"


@pytest.mark.parametrize("mutation", [
    lambda o: o.deviceIterations(2),
    lambda o: o.set(device_iterations=2),
    lambda o: o.createOrSet(model_name="x"),
    lambda o: setattr(o, "replication_factor", 2),
    lambda o: o.randomSeed(3),
    lambda o: o.deleteIfExists("log_dir"),
    lambda o: o.setExecutionStrategy(ShardedExecution()),
    lambda o: o.showCompilationProgressBar(False),
    lambda o: o.relaxOptimizerAttributesChecks(),
    lambda o: o.disableModuleNamescope(),
    lambda o: o.sourceLocationExcludes(["a"]),
    lambda o: o.appendToLocationExcludes("a"),
    lambda o: setattr(o, "_module_namescope_enabled", False),
    lambda o: o.Training.gradientAccumulation(2),
    lambda o: o.Training.setAutomaticLossScaling(True),
    lambda o: o.Precision.enableStochasticRounding(True),
    lambda o: o.Precision.setPartialsType(torch.half),
    lambda o: o.Distributed.configureProcessId(1, 2),
    lambda o: o.TensorLocations.numIOTiles(32),
    lambda o: o._Popart.set("enableOutlining", False),
    lambda o: o._Popart.setPatterns({"a": True}),
    lambda o: o.enableExecutableCaching("/tmp/x"),
    lambda o: o.enableProfiling(),
])
def test_frozen_rejects_mutation(mutation):
    opts = Options()
    before = repr(opts)
    opts._freeze()
    assert opts._is_frozen and opts.Training._is_frozen and opts._Popart._is_frozen
    with pytest.raises(AttributeError, match=FROZEN):
        mutation(opts)
    assert repr(opts) == before
    assert opts._module_namescope_enabled is True
    assert isinstance(opts._execution_strategy, PipelinedExecution)
    assert not isinstance(opts._execution_strategy, ShardedExecution)


def test_frozen_allows_anchor_tensor_and_reads():
    opts = Options()
    opts._freeze()
    assert opts.anchorTensor("g", "Gradient___x") is None
    assert opts.anchored_tensors == {"g": ["Gradient___x", True, None, 1]}
    assert opts.device_iterations == 1
    opts._unfreeze()
    assert not opts._is_frozen and not opts.Training._is_frozen and not opts._Popart._is_frozen
    opts.deviceIterations(5)
    assert opts.device_iterations == 5


def test_clone_and_deepcopy_are_unfrozen_and_deep():
    opts = Options().deviceIterations(3).setExecutionStrategy(ShardedExecution("a", "b"))
    opts.Training.gradientAccumulation(2)
    opts._freeze()
    for clone in (opts.clone(), copy.deepcopy(opts)):
        assert repr(clone) == repr(opts)
        assert not clone._is_frozen
        assert all(not g._is_frozen for g in clone._groups())
        assert isinstance(clone._execution_strategy, ShardedExecution)
        assert clone._execution_strategy is not opts._execution_strategy
        clone.deviceIterations(7)
        clone.Training.gradientAccumulation(9)
        clone._Popart.set("x", 1)
        clone.anchorTensor("a", "b")
        assert opts.device_iterations == 3
        assert opts.Training.gradient_accumulation == 2
        assert "x" not in opts._Popart.options
        assert opts.anchored_tensors == {}
        # Training/Precision still share the clone's own _Popart
        clone.Training.setAutomaticLossScaling(True)
        assert clone._Popart.options["automaticLossScalingSettings.enabled"] is True
        assert "automaticLossScalingSettings.enabled" not in opts._Popart.options


def test_pickle_round_trip():
    opts = Options().deviceIterations(4).randomSeed(42).modelName("m")
    opts.outputMode(enums.OutputMode.EveryN, 2)
    opts.Training.gradientAccumulation(3)
    opts.TensorLocations.setWeightLocation(TensorLocationSettings().useOnChipStorage(False))
    opts.setExecutionStrategy(SerialPhasedExecution(["0"], ["1"]).useSeparateBackwardPhase())
    opts.disableModuleNamescope()
    opts._freeze()
    loaded = pickle.loads(pickle.dumps(opts))
    assert repr(loaded) == repr(opts)
    assert loaded.random_seed == 42 and loaded.model_name == "m"
    assert loaded._is_frozen and loaded.Training._is_frozen
    assert loaded._module_namescope_enabled is False
    assert isinstance(loaded._execution_strategy, SerialPhasedExecution)
    assert loaded._execution_strategy._separate_backward_phase is True
    assert loaded.Training._popart is loaded._popart
    loaded._unfreeze()
    loaded.deviceIterations(1)


# ---------------------------------------------------------------------------
# Top-level setters (§3)
# ---------------------------------------------------------------------------

def test_chaining_returns_self():
    opts = Options()
    chain = [
        opts.deviceIterations(2), opts.replicationFactor(4),
        opts.inputReplicaGrouping(2, enums.CommGroupType.Orthogonal),
        opts.broadcastBuffers(False), opts.outputMode(enums.OutputMode.All),
        opts.randomSeed(1), opts.autoRoundNumIPUs(),
        opts.setExecutionStrategy(PipelinedExecution()),
        opts.setAvailableMemoryProportion({"IPU0": 0.3}), opts.logDir("/tmp"),
        opts.maxRepeatLogs(3), opts.modelName("x"), opts.enableExecutableCaching(None),
        opts.useIpuModel(True), opts.connectionType(enums.ConnectionType.OnDemand),
        opts.syncPattern(enums.SyncPattern.SinglePipeline), opts.useIpuId(1),
        opts.useOfflineIpuTarget(), opts.enableStableNorm(True),
        opts.enableSyntheticData(True), opts.logCycleCount(True), opts.enableProfiling(),
        opts.disableModuleNamescope(), opts.updatableNamedBuffers(["b"]),
        opts.showCompilationProgressBar(), opts.relaxOptimizerAttributesChecks(),
        opts.sourceLocationExcludes([]), opts.appendToLocationExcludes("a"),
    ]
    assert all(c is opts for c in chain)
    assert opts.anchorTensor("a", "b") is None
    assert opts.Training.gradientAccumulation(2) is opts.Training
    assert opts.Precision.enableStochasticRounding(True) is opts.Precision
    assert opts.TensorLocations.numIOTiles(64) is opts.TensorLocations
    assert opts.Distributed.disable() is opts.Distributed
    assert opts.Jit.traceModel(False) is opts.Jit
    assert opts._Popart.set("a", 1) is opts._Popart


def test_device_iterations_and_replication():
    opts = Options().deviceIterations(8).replicationFactor(2)
    assert opts.device_iterations == 8 and opts.replication_factor == 2


def test_input_replica_grouping():
    opts = Options().replicationFactor(8)
    opts.inputReplicaGrouping(4, enums.CommGroupType.Orthogonal)
    assert opts.input_group_size == 4 and opts.input_cgt is enums.CommGroupType.Orthogonal
    opts.inputReplicaGrouping(4, enums.CommGroupType.NoGrouping)
    assert opts.input_group_size == 1 and opts.input_cgt is enums.CommGroupType.Consecutive
    with pytest.raises(ValueError, match="input_group_type cannot be All"):
        opts.inputReplicaGrouping(2, enums.CommGroupType.All)
    with pytest.raises(ValueError, match="cannot be greater"):
        opts.inputReplicaGrouping(16, enums.CommGroupType.Consecutive)
    with pytest.raises(ValueError, match="divisible"):
        opts.inputReplicaGrouping(3, enums.CommGroupType.Consecutive)
    # replication factor must be set first
    with pytest.raises(ValueError):
        Options().inputReplicaGrouping(2, enums.CommGroupType.Consecutive)


def test_output_mode():
    opts = Options()
    opts.outputMode(enums.OutputMode.All)
    assert opts.output_mode == 2 and type(opts.output_mode) is int
    assert opts.output_mode == enums.OutputMode.All
    assert opts.output_return_period == 1
    assert opts.defaultOutputMode() is False
    opts.outputMode(enums.OutputMode.EveryN, 5)
    assert opts.output_mode == 1 and opts.output_return_period == 5
    # a period with another mode is ignored but still stored
    opts.outputMode(enums.OutputMode.Final, 3)
    assert opts.output_mode == 0 and opts.output_return_period == 3
    for bad in (None, 0, -1):
        with pytest.raises(AssertionError, match="EveryN anchor must have "
                           "output_return_period set to valid positive integer"):
            opts.outputMode(enums.OutputMode.EveryN, bad)
    with pytest.raises(AssertionError):
        opts.outputMode(2)
    opts.outputMode(enums.OutputMode.Default)
    assert opts.defaultOutputMode() is True


def test_anchor_tensor():
    opts = Options()
    opts.anchorTensor("grad", "Gradient___w")
    opts.anchorTensor("every", "x", enums.OutputMode.EveryN, 3)
    opts.anchorTensor("all", "y", enums.OutputMode.All, 3)
    assert opts.anchored_tensors == {
        "grad": ["Gradient___w", True, None, 1],
        "every": ["x", False, enums.OutputMode.EveryN, 3],
        "all": ["y", False, enums.OutputMode.All, 1],
    }
    with pytest.raises(AssertionError):
        opts.anchorTensor("z", "z", 2)
    with pytest.raises(AssertionError, match="EveryN"):
        opts.anchorTensor("z", "z", enums.OutputMode.EveryN, 0)


def test_random_seed_seeds_torch():
    opts = Options().randomSeed(1234)
    assert opts.random_seed == 1234
    a = torch.rand(3)
    torch.manual_seed(1234)
    assert torch.equal(a, torch.rand(3))
    with pytest.raises(AssertionError):
        opts.randomSeed(1.5)
    assert opts.random_seed == 1234


def test_auto_round_and_misc_values():
    opts = Options().autoRoundNumIPUs()
    assert opts.auto_round_num_ipus is True
    opts.autoRoundNumIPUs(False)
    assert opts.auto_round_num_ipus is False
    opts.logDir("/tmp/logs")
    assert opts.log_dir == "/tmp/logs"
    opts.maxRepeatLogs(10)
    assert opts.max_repeat_logs == 10
    opts.maxRepeatLogs(None)
    assert opts.max_repeat_logs == 2**64 - 1
    opts.modelName("resnet")
    assert opts.model_name == "resnet"
    opts.useIpuModel(False)
    assert opts.use_model is False
    opts.useIpuId(3)
    assert opts.ipu_id == 3
    with pytest.raises(AssertionError):
        opts.useIpuId("3")
    opts.broadcastBuffers(False)
    assert opts.broadcast_buffers is False


def test_execution_strategy_setter():
    opts = Options()
    for strategy in (ShardedExecution(), SerialPhasedExecution(["0"]),
                     ParallelPhasedExecution(["0"]), PipelinedExecution("0", "1")):
        assert opts.setExecutionStrategy(strategy) is opts
        assert opts._execution_strategy is strategy
    for bad in ("pipelined", enums.AutoStage.AutoIncrement, Stage("0"), Phase("0")):
        with pytest.raises(AssertionError):
            opts.setExecutionStrategy(bad)


def test_available_memory_proportion():
    opts = Options().setAvailableMemoryProportion({"IPU0": 0.5, "IPU3": 0.2})
    assert opts.available_memory_proportion == {0: 0.5, 3: 0.2}
    with pytest.raises(AssertionError, match=r'\{"IPU0": 0.5\}'):
        opts.setAvailableMemoryProportion({"GPU0": 0.5})
    with pytest.raises(AssertionError):
        opts.setAvailableMemoryProportion({0: 0.5})
    with pytest.raises(ValueError):
        opts.setAvailableMemoryProportion({"IPUx": 0.5})
    assert opts.available_memory_proportion == {0: 0.5, 3: 0.2}


def test_connection_type_and_sync_pattern():
    opts = Options().connectionType(enums.ConnectionType.OnDemand)
    assert opts.connection_type == 1 and type(opts.connection_type) is int
    with pytest.raises(AssertionError):
        opts.connectionType(1)
    opts.syncPattern(enums.SyncPattern.ReplicaAndLadder)
    assert opts.sync_pattern == 2 and type(opts.sync_pattern) is int
    with pytest.raises(AssertionError):
        opts.syncPattern("Full")


def test_offline_target():
    opts = Options().useOfflineIpuTarget()
    assert opts.connection_type == enums.ConnectionType.Never
    assert opts.ipu_version == 2
    opts.useOfflineIpuTarget(21)
    assert opts.ipu_version == 21


def test_popart_writing_setters():
    opts = Options()
    opts.enableExecutableCaching("/tmp/cache")
    assert opts._Popart.options["cachePath"] == "/tmp/cache"
    assert opts._Popart.options["enableEngineCaching"] is True
    opts.enableExecutableCaching(None)
    assert opts._Popart.options["enableEngineCaching"] is False
    opts.enableStableNorm(True)
    assert opts._Popart.options["enableStableNorm"] is True
    opts.enableSyntheticData(True)
    assert opts._Popart.options["syntheticDataMode"] == 2
    opts.enableSyntheticData(False)
    assert opts._Popart.options["syntheticDataMode"] == 0
    opts.logCycleCount(True)
    assert opts._Popart.options["instrumentWithHardwareCycleCounter"] is True
    opts.updatableNamedBuffers(["running_mean"])
    assert opts._Popart.options["updatableNamedBuffers"] == ["running_mean"]


def test_enable_profiling(monkeypatch, capsys):
    opts = Options()
    opts._Popart.setEngineOptions({"target.x": "1"})
    opts.enableProfiling("/tmp/prof")
    assert opts._Popart.options["engineOptions"] == {
        "target.x": "1", "debug.allowOutOfMemory": "true",
        "autoReport.directory": "/tmp/prof", "autoReport.all": "true"}
    opts2 = Options().enableProfiling()
    assert opts2._Popart.options["engineOptions"]["autoReport.directory"] == "."
    assert "POPLAR_ENGINE_OPTIONS" not in capsys.readouterr().err
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", '{"autoReport.all": "true"}')
    Options().enableProfiling()
    assert "autoReport.all" in capsys.readouterr().err


def test_private_flag_setters():
    opts = Options()
    opts.disableModuleNamescope()
    assert opts._module_namescope_enabled is False
    opts.showCompilationProgressBar(False)
    assert opts._show_compilation_progress_bar is False
    opts.showCompilationProgressBar()
    assert opts._show_compilation_progress_bar is True
    opts.relaxOptimizerAttributesChecks()
    assert opts._relax_optimizer_attributes_checks is True
    opts.relaxOptimizerAttributesChecks(False)
    assert opts._relax_optimizer_attributes_checks is False
    opts.sourceLocationExcludes(["a", "b"])
    assert opts._source_location_excludes == ["a", "b"]
    opts.appendToLocationExcludes("c", "d")
    assert opts._source_location_excludes == ["a", "b", "c", "d"]
    # the default list is not shared between instances
    Options().appendToLocationExcludes("zzz")
    assert "zzz" not in Options()._source_location_excludes
