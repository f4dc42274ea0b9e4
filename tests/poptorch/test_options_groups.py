"""Tests of ``poptorch.Options`` (docs/api-sections.md options §1–§9): the sub-groups (§4),
``toDict`` / ``repr`` (§7), loading from files and the environment (§6, §2, §8) and the deprecated
names (§9)."""
import json

import pytest
import torch

from poptorch import enums
from poptorch._options.execution_strategy import (ParallelPhasedExecution, PipelinedExecution,
                                          SerialPhasedExecution, ShardedExecution)
from poptorch.options import ConfigFileError, Options, TensorLocationSettings
from popart_compiler.errors import Error

pytestmark = pytest.mark.usefixtures("clean_options_env")


# ---------------------------------------------------------------------------
# Sub-groups (§4)
# ---------------------------------------------------------------------------

def test_training_options():
    opts = Options()
    tr = opts.Training
    tr.gradientAccumulation(4)
    assert tr.gradient_accumulation == 4
    with pytest.raises(AssertionError, match="Unexpected type"):
        tr.gradientAccumulation(4.0)
    tr.accumulationAndReplicationReductionType(enums.ReductionType.Sum)
    assert tr.accumulation_and_replication_reduction_type is enums.ReductionType.Sum
    for bad in (enums.ReductionType.NoReduction, 0, "Sum"):
        with pytest.raises(ValueError, match="accumulationAndReplicationReductionType.*"
                           "ReductionType.Sum.*ReductionType.Mean"):
            tr.accumulationAndReplicationReductionType(bad)
    tr.setMeanAccumulationAndReplicationReductionStrategy(enums.MeanReductionStrategy.Running)
    assert (tr.meanAccumulationAndReplicationReductionStrategy
            is enums.MeanReductionStrategy.Running)
    tr.setMeanAccumulationAndReplicationReductionStrategy(
        enums.MeanReductionStrategy.PostAndLoss)
    with pytest.raises(AssertionError, match="Unexpected type"):
        tr.setMeanAccumulationAndReplicationReductionStrategy(enums.ReductionType.Mean)
    tr.setAutomaticLossScaling(True)
    assert opts._Popart.options["automaticLossScalingSettings.enabled"] is True


def test_convolution_options_last_call_wins():
    opts = Options()
    opts.Training.setConvolutionDithering(True)
    assert opts._Popart.options["convolutionOptions"] == {"enableConvDithering": True}
    opts.Precision.setPartialsType(torch.half)
    assert opts._Popart.options["convolutionOptions"] == {"partialsType": "half"}
    assert opts._Popart.options["partialsTypeMatMuls"] == "half"
    opts.Training.setConvolutionDithering(False)
    assert opts._Popart.options["convolutionOptions"] == {"enableConvDithering": False}


def test_precision_options(capsys):
    opts = Options()
    pr = opts.Precision
    pr.enableFloatingPointExceptions(True)
    assert opts._Popart.options["enableFloatingPointChecks"] is True
    with pytest.raises(AssertionError, match="enableFloatingPointExceptions needs to be set "
                       "to a bool"):
        pr.enableFloatingPointExceptions(1)
    pr.enableStochasticRounding(True)
    assert opts._Popart.options["enableStochasticRounding"] is True
    for dtype, name in ((torch.float, "float"), (torch.float32, "float"),
                        (torch.half, "half"), (torch.float16, "half")):
        pr.setPartialsType(dtype)
        assert opts._Popart.options["partialsTypeMatMuls"] == name
        assert opts._Popart.options["convolutionOptions"] == {"partialsType": name}
    for bad in (torch.bfloat16, torch.int32, "float"):
        with pytest.raises(ValueError):
            pr.setPartialsType(bad)
    capsys.readouterr()
    assert pr.halfFloatCasting(enums.HalfFloatCastingBehavior.HalfUpcastToFloat) is pr
    assert "deprecated" in capsys.readouterr().err
    with pytest.raises(ValueError):
        pr.runningStatisticsAlwaysFloat(1)
    assert pr.runningStatisticsAlwaysFloat(True) is pr
    assert "deprecated" in capsys.readouterr().err


def test_tensor_locations():
    opts = Options()
    tl = opts.TensorLocations
    tl.numIOTiles(32)
    assert tl("numIOTiles") == 32
    assert tl.toDict()["numIOTiles"] == 32
    tl.numIOTiles(192)
    assert tl("numIOTiles") == 192
    for bad in (30, 33, 194, 64.0):
        with pytest.raises(AssertionError,
                           match=r"numIOTiles must be an even number between 32 and 192\."):
            tl.numIOTiles(bad)
    settings = (TensorLocationSettings().minElementsForOffChip(10)
                .minElementsForReplicatedTensorSharding(20).useOnChipStorage(False)
                .useReplicatedTensorSharding().useIOTilesToLoad().useIOTilesToStore(False))
    expected = {"minElementsForOffChip": 10, "minElementsForReplicatedTensorSharding": 20,
                "onChip": 0, "useReplicatedTensorSharding": 1, "useIOTilesToLoad": 1,
                "useIOTilesToStore": 0}
    assert settings.toDict() == expected
    for method, key in ((tl.setActivationLocation, "location_activation"),
                        (tl.setWeightLocation, "location_weight"),
                        (tl.setOptimizerLocation, "location_optimizer"),
                        (tl.setAccumulatorLocation, "location_accumulator")):
        assert method(settings) is tl
        assert tl(key) == expected
        with pytest.raises(AssertionError):
            method({"onChip": 0})
    # later changes to the settings object do not propagate
    settings.useOnChipStorage(True)
    assert tl("location_weight")["onChip"] == 0
    settings.useOnChipStorage(None)
    assert not settings.exists("onChip")


def test_tensor_location_settings_validation():
    s = TensorLocationSettings()
    with pytest.raises(AssertionError):
        s.minElementsForOffChip(1.5)
    with pytest.raises(AssertionError):
        s.minElementsForReplicatedTensorSharding("1")
    for method in (s.useOnChipStorage, s.useReplicatedTensorSharding, s.useIOTilesToLoad,
                   s.useIOTilesToStore):
        with pytest.raises(AssertionError):
            method(1)
    assert repr(TensorLocationSettings().useOnChipStorage(True)) == \
        "TensorLocationSettings(onChip=1)"


def test_distributed_options(monkeypatch):
    opts = Options()
    d = opts.Distributed
    d.configureProcessId(2, 4)
    assert d.processId == 2 and d.numProcesses == 4
    assert d.distributed_process_id == 2 and d.num_distributed_processes == 4
    d.disable()
    assert d.processId == 0 and d.numProcesses == 1
    with pytest.raises(AssertionError, match="Unexpected type"):
        d.configureProcessId("1", 2)
    monkeypatch.setenv("MY_NUM", "8")
    monkeypatch.setenv("MY_ID", "5")
    d.setEnvVarNames("MY_NUM", "MY_ID")
    assert d.processId == 5 and d.numProcesses == 8
    monkeypatch.delenv("MY_ID")
    d.setEnvVarNames("MY_NUM", "MY_ID")
    assert d.processId == 0 and d.numProcesses == 8
    monkeypatch.delenv("MY_NUM")
    d.setEnvVarNames("MY_NUM", "MY_ID")
    assert d.processId == 0 and d.numProcesses == 1


def test_distributed_reads_ompi_env(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    opts = Options()
    assert opts.Distributed.numProcesses == 4
    assert opts.Distributed.processId == 3
    assert opts.Distributed.num_distributed_processes == 4


def test_jit_options(capsys):
    opts = Options()
    assert opts.Jit.traceModel(False) is opts.Jit
    assert "deprecated" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"options.Jit.traceModel\(True\) is no longer "
                       "supported"):
        opts.Jit.traceModel(True)


def test_popart_options():
    opts = Options()
    p = opts._Popart
    p.set("enableOutlining", False)
    p.set("engineOptions", {"a": "b"})
    assert p.options["enableOutlining"] is False
    p.setEngineOptions({"c": "d"})
    assert p.options["engineOptions"] == {"c": "d"}
    p.setPatterns({"PadSum": True})
    assert p.options["patterns"] == {"PadSum": True} and p.options["patterns_level"] == 2
    p.setPatterns({"PadSum": False}, 1)
    assert p.options["patterns_level"] == 1
    with pytest.raises(AssertionError):
        p.setPatterns({"PadSum": True}, "2")
    with pytest.raises(AssertionError):
        p.setPatterns(["PadSum"])
    fresh = Options()._Popart
    fresh.set("x", 1.5)
    assert repr(fresh) == ("_PopartOptions(instrumentWithHardwareCycleCounter=False, "
                           "rearrangeAnchorsOnHost=False, x=1.5)")


# ---------------------------------------------------------------------------
# toDict / repr (§7)
# ---------------------------------------------------------------------------

def test_to_dict_requires_output_mode():
    with pytest.raises(AssertionError, match="An output mode must be picked before "
                       "serialisation"):
        Options().toDict()


def test_to_dict_merge():
    opts = Options().outputMode(enums.OutputMode.Final).deviceIterations(3)
    opts.Training.gradientAccumulation(2)
    opts.TensorLocations.numIOTiles(64)
    opts.Distributed.configureProcessId(1, 2)
    opts.Precision.enableStochasticRounding(True)
    d = opts.toDict()
    assert d["execution_mode"] == 0
    assert d["device_iterations"] == 3 and d["output_mode"] == 0
    assert d["gradient_accumulation"] == 2
    assert d["numIOTiles"] == 64
    assert d["distributed_process_id"] == 1 and d["num_distributed_processes"] == 2
    assert d["enableStochasticRounding"] is True
    assert d["rearrangeAnchorsOnHost"] is False
    assert callable(d["compilation_progress_bar_fn"])
    assert list(d)[0] == "execution_mode"
    assert list(d)[-1] == "compilation_progress_bar_fn"
    # Jit/Precision have no values of their own; nothing else leaks in
    expected = (1 + len(opts._Popart.options) + len(opts._values)
                + len(opts.Training._values) + len(opts.Distributed._values)
                + len(opts.TensorLocations._values) + len(opts.Backend._values) + 1)
    assert len(d) == expected
    opts.showCompilationProgressBar(False)
    assert "compilation_progress_bar_fn" not in opts.toDict()


def test_to_dict_strategy_values():
    opts = Options().outputMode(enums.OutputMode.All)
    opts.setExecutionStrategy(ShardedExecution())
    assert opts.toDict()["execution_mode"] == 1
    opts.setExecutionStrategy(SerialPhasedExecution(["0"]).setTensorsLiveness(
        enums.Liveness.OffChipAfterEachPhase))
    d = opts.toDict()
    assert (d["execution_mode"], d["separate_backward_phase"], d["tensors_liveness"],
            d["serial_phases_execution"]) == (2, False, 3, True)
    opts.setExecutionStrategy(ParallelPhasedExecution(["0"]).useSeparateBackwardPhase()
                              .sendTensorsOffChipAfterFwd())
    d = opts.toDict()
    assert (d["execution_mode"], d["separate_backward_phase"], d["tensors_liveness"],
            d["serial_phases_execution"]) == (2, True, 1, False)


def test_to_dict_collision():
    opts = Options().outputMode(enums.OutputMode.All)
    opts._Popart.set("device_iterations", 2)
    with pytest.raises(AssertionError, match="Can't merge dictionaries, they have some keys "
                       "in common"):
        opts.toDict()


def test_progress_bar_fn(capsys):
    opts = Options().outputMode(enums.OutputMode.All)
    fn = opts.toDict()["compilation_progress_bar_fn"]
    for i in range(0, 101, 25):
        fn(i, 100)
    assert "Graph compilation" in capsys.readouterr().err


def test_repr_format():
    opts = Options()
    text = repr(opts)
    assert text.startswith("Options(device_iterations=1, log_dir='.', ")
    assert str(opts) == text
    tail = text[text.index("Distributed="):]
    names = [part.split("=")[0] for part in
             ("Distributed=", "Jit=", "Precision=", "TensorLocations=", "Training=",
              "_Popart=")]
    positions = [tail.index(n + "=") for n in names]
    assert positions == sorted(positions)
    assert "Jit=_JitOptions()" in text
    assert "Training=_TrainingOptions(gradient_accumulation=1, " in text
    assert text.endswith("_Popart=_PopartOptions(instrumentWithHardwareCycleCounter=False, "
                         "rearrangeAnchorsOnHost=False))")


def test_repr_identical_and_sensitive():
    assert repr(Options()) == repr(Options())
    a = Options().deviceIterations(2)
    b = Options().deviceIterations(2)
    assert repr(a) == repr(b)
    for change in (lambda o: o.deviceIterations(3),
                   lambda o: o.Training.gradientAccumulation(2),
                   lambda o: o.Precision.enableStochasticRounding(True),
                   lambda o: o.TensorLocations.numIOTiles(32),
                   lambda o: o.Distributed.configureProcessId(0, 2),
                   lambda o: o._Popart.set("a", 1)):
        c = Options().deviceIterations(2)
        change(c)
        assert repr(c) != repr(a)


# ---------------------------------------------------------------------------
# Loading (§6) and environment (§2, §8)
# ---------------------------------------------------------------------------

def _configure_by_calls(opts):
    opts.deviceIterations(32)
    opts.Training.gradientAccumulation(4)
    opts.connectionType(enums.ConnectionType.OnDemand)
    opts.Precision.enableFloatingPointExceptions(True)
    opts._Popart.set("saveInitializersToFile", "my_file.onnx")
    opts.outputMode(enums.OutputMode.EveryN, 2)
    opts.setExecutionStrategy(ShardedExecution())
    return opts


def _ensure_package_names(monkeypatch):
    """The snippet sees the ``poptorch`` package: make sure the names used exist even
    before the lead exports them from ``__init__``."""
    import poptorch
    for name, value in (("ShardedExecution", ShardedExecution),
                        ("ConnectionType", enums.ConnectionType),
                        ("OutputMode", enums.OutputMode)):
        if not hasattr(poptorch, name):
            monkeypatch.setattr(poptorch, name, value, raising=False)


def test_load_from_file(tmp_path, monkeypatch):
    cfg = tmp_path / "opts.txt"
    cfg.write_text(
        "deviceIterations(32)\n"
        "\n"
        "   # a comment\n"
        "Training.gradientAccumulation(4)  # inline comment\n"
        "connectionType(poptorch.ConnectionType.OnDemand)\n"
        "Precision.enableFloatingPointExceptions(True)\n"
        "_Popart.set('saveInitializersToFile', 'my_file.onnx')\n"
        "   outputMode(poptorch.OutputMode.EveryN, 2)\n"
        "setExecutionStrategy(poptorch.ShardedExecution())\n")
    _ensure_package_names(monkeypatch)
    opts = Options()
    assert opts.loadFromFile(str(cfg)) is opts
    ref = _configure_by_calls(Options())
    assert repr(opts) == repr(ref)
    assert isinstance(opts._execution_strategy, ShardedExecution)
    # loading accumulates
    cfg2 = tmp_path / "more.txt"
    cfg2.write_text("replicationFactor(2)\n")
    opts.loadFromFile(str(cfg2))
    assert opts.replication_factor == 2 and opts.device_iterations == 32


def test_load_from_file_syntax_error_line_number(tmp_path, monkeypatch):
    _ensure_package_names(monkeypatch)
    cfg = tmp_path / "bad.cfg"
    cfg.write_text("deviceIterations(4)\n"
                   "\n"
                   "# gradient accumulation\n"
                   "Training.gradientAccumulation(2)\n"
                   "outputMode(poptorch.OutputMode.All\n")
    opts = Options()
    with pytest.raises(ConfigFileError) as info:
        opts.loadFromFile(str(cfg))
    message = str(info.value)
    assert message.startswith("SyntaxError at line 3 of bad.cfg: ")
    assert message.endswith("\n> options.outputMode(poptorch.OutputMode.All")
    # the snippet did not run at all
    assert opts.device_iterations == 1
    assert issubclass(ConfigFileError, Exception)


def test_load_from_file_other_errors_propagate(tmp_path):
    cfg = tmp_path / "bad.cfg"
    cfg.write_text("deviceIterations(2.5)\n")
    with pytest.raises(AssertionError, match="Unexpected type"):
        Options().loadFromFile(str(cfg))
    cfg.write_text("noSuchMethod(2)\n")
    with pytest.raises(AttributeError, match="Invalid attribute noSuchMethod"):
        Options().loadFromFile(str(cfg))


def test_from_json():
    opts = Options()
    assert opts.from_json(json.dumps({
        "deviceIterations": 32,
        "Training.gradientAccumulation": 4,
        "connectionType": "ConnectionType.OnDemand",
        "Precision.enableFloatingPointExceptions": True,
        "_Popart.set": ["saveInitializersToFile", "my_file.onnx"],
        "outputMode": ["OutputMode.EveryN", 2],
    })) is opts
    ref = _configure_by_calls(Options())
    ref.setExecutionStrategy(PipelinedExecution())
    assert repr(opts) == repr(ref)
    assert opts.connection_type == enums.ConnectionType.OnDemand
    # non-enum dotted strings pass through
    opts.from_json('{"logDir": "some.dir"}')
    assert opts.log_dir == "some.dir"
    with pytest.raises(AttributeError):
        opts.from_json('{"noSuchMethod": 1}')
    with pytest.raises(ValueError):
        opts.from_json('{"connectionType": "ConnectionType.Sometimes"}')


def test_default_options_env(monkeypatch):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", json.dumps({
        "deviceIterations": 2, "connectionType": "ConnectionType.OnDemand",
        "Training.gradientAccumulation": 3}))
    opts = Options()
    assert opts.device_iterations == 2
    assert opts.connection_type == enums.ConnectionType.OnDemand
    assert opts.Training.gradient_accumulation == 3
    monkeypatch.delenv("POPTORCH_DEFAULT_OPTIONS")
    ref = Options().deviceIterations(2).connectionType(enums.ConnectionType.OnDemand)
    ref.Training.gradientAccumulation(3)
    assert repr(opts) == repr(ref)
    # explicit calls afterwards override the environment defaults
    opts.deviceIterations(5)
    assert opts.device_iterations == 5


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    opts = Options()
    assert opts._Popart.options["cachePath"] == str(tmp_path)
    assert opts._Popart.options["enableEngineCaching"] is True
    monkeypatch.setenv("POPTORCH_CACHE_DIR", "")
    assert "cachePath" not in Options()._Popart.options


# ---------------------------------------------------------------------------
# Deprecated names (§9)
# ---------------------------------------------------------------------------

def test_anchor_mode_shims(capsys):
    opts = Options()
    assert opts.defaultAnchorMode() is True
    assert "defaultAnchorMode is deprecated" in capsys.readouterr().err
    assert opts.anchorMode(enums.OutputMode.EveryN, 4) is opts
    err = capsys.readouterr().err
    assert "anchorMode is deprecated since version 2.4" in err
    assert "Use outputMode instead" in err
    assert opts.output_mode == enums.OutputMode.EveryN and opts.output_return_period == 4
    opts.anchorMode(2)
    assert opts.output_mode == enums.OutputMode.All


def test_errors_are_not_poptorch_errors():
    # Option validation uses built-in exception types, never poptorch.Error.
    with pytest.raises(AssertionError) as info:
        Options().deviceIterations("x")
    assert not isinstance(info.value, Error)
