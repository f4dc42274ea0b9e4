"""Options are validated where they are set (issue 14 item 4): a wrong type raises
``AssertionError``, a value out of range ``ValueError``, both naming the setter and
what is allowed; nothing is stored then, and no bad value reaches the first call. The
options given to a wrapper are checked and frozen."""
import pytest
import torch

import poptorch
from poptorch import Options, TensorLocationSettings
from models import SingleLinear

RANGE_ERRORS = [
    (lambda o: o.deviceIterations(0), "deviceIterations must be a positive integer"),
    (lambda o: o.deviceIterations(-3), "deviceIterations must be a positive integer"),
    (lambda o: o.replicationFactor(0), "replicationFactor must be a positive integer"),
    (lambda o: o.Training.gradientAccumulation(0),
     "Training.gradientAccumulation must be a positive integer"),
    (lambda o: o.setAvailableMemoryProportion({"IPU0": -1}),
     r"setAvailableMemoryProportion\['IPU0'\] must be a proportion between 0 and 1"),
    (lambda o: o.setAvailableMemoryProportion({"IPU0": 5.0}), "between 0 and 1, got 5.0"),
    (lambda o: o.setAvailableMemoryProportion({"IPU0": float("nan")}), "between 0 and 1"),
    (lambda o: o.setAvailableMemoryProportion({"IPUx": 0.5}), "non-negative integer"),
    (lambda o: o.setAvailableMemoryProportion({"IPU-1": 0.5}), "non-negative integer"),
    (lambda o: o.Distributed.configureProcessId(-1, 0),
     "configureProcessId num_processes must be a positive integer"),
    (lambda o: o.Distributed.configureProcessId(-1, 2),
     "configureProcessId process_id must be an integer >= 0"),
    (lambda o: o.Distributed.configureProcessId(2, 2), r"process_id must be in \[0, 2\)"),
    (lambda o: o.maxRepeatLogs(-1), "maxRepeatLogs must be an integer >= 0"),
    (lambda o: o.useIpuId(-1), "useIpuId must be an integer >= 0"),
    (lambda o: o.useOfflineIpuTarget(3), "ipu_version must be 1 .*, 2 .* or 21"),
    (lambda o: o.randomSeed(2 ** 64), "randomSeed must be between"),
    (lambda o: o.set(output_return_period=0), "outputMode must be a positive integer"),
    (lambda o: o.inputReplicaGrouping(0, poptorch.CommGroupType.Consecutive),
     "must be positive"),
    (lambda o: o.TensorLocations.setWeightLocation(
        TensorLocationSettings().minElementsForOffChip(-1)), "minElementsForOffChip"),
]

TYPE_ERRORS = [
    (lambda o: o.setAvailableMemoryProportion({"IPU0": "half"}), "must be float or int"),
    (lambda o: o.setAvailableMemoryProportion({"IPU0": True}), "must be float or int"),
    (lambda o: o.Distributed.configureProcessId(0.5, 2), "Unexpected type"),
    (lambda o: o.modelName(3), "modelName must be str"),
    (lambda o: o.logDir(None), "logDir must be str or PathLike"),
    (lambda o: o.useIpuModel("yes"), "useIpuModel must be bool"),
    (lambda o: o.useIpuId(True), "ipu_id must be an integer"),
    (lambda o: o.enableSyntheticData(1), "enableSyntheticData must be bool"),
    (lambda o: o.enableStableNorm(None), "enableStableNorm must be bool"),
    (lambda o: o.logCycleCount("no"), "logCycleCount must be bool"),
    (lambda o: o.enableExecutableCaching(1), "enableExecutableCaching must be"),
    (lambda o: o.enableProfiling(3), "enableProfiling must be"),
    (lambda o: o.updatableNamedBuffers("running_mean"), "updatableNamedBuffers must be"),
    (lambda o: o.updatableNamedBuffers([1]), "updatableNamedBuffers entries must be str"),
    (lambda o: o.showCompilationProgressBar("yes"), "showCompilationProgressBar must be"),
    (lambda o: o.relaxOptimizerAttributesChecks(1), "relaxOptimizerAttributesChecks"),
    (lambda o: o.sourceLocationExcludes("torch"), "sourceLocationExcludes must be"),
    (lambda o: o.appendToLocationExcludes(3), "appendToLocationExcludes entries"),
    (lambda o: o.Training.setAutomaticLossScaling(1), "setAutomaticLossScaling must be"),
    (lambda o: o.Training.setConvolutionDithering("on"), "setConvolutionDithering"),
    (lambda o: o.Precision.enableStochasticRounding(1), "enableStochasticRounding"),
    (lambda o: o.Jit.traceModel(0), "traceModel must be bool"),
    (lambda o: o._Popart.set(3, True), "_Popart.set key must be str"),
    (lambda o: o._Popart.setEngineOptions(["a"]), "setEngineOptions must be dict"),
    (lambda o: o.Distributed.setEnvVarNames(1, 2), "setEnvVarNames must be str"),
    (lambda o: o.deviceIterations(2.0), "Unexpected type"),
    (lambda o: o.randomSeed(False), "Random seed must be an integer"),
]


@pytest.mark.parametrize("setter,message", RANGE_ERRORS)
def test_out_of_range_values_raise_value_error(setter, message):
    opts = Options()
    before = repr(opts)
    with pytest.raises(ValueError, match=message):
        setter(opts)
    assert repr(opts) == before  # nothing stored


@pytest.mark.parametrize("setter,message", TYPE_ERRORS)
def test_wrong_types_raise_assertion_error(setter, message):
    opts = Options()
    with pytest.raises(AssertionError, match=message):
        setter(opts)


def test_attribute_assignment_is_range_checked():
    opts = Options()
    with pytest.raises(ValueError, match="deviceIterations must be a positive integer"):
        opts.device_iterations = 0
    with pytest.raises(ValueError, match="gradientAccumulation must be a positive"):
        opts.Training.set(gradient_accumulation=0)
    assert opts.device_iterations == 1 and opts.Training.gradient_accumulation == 1


@pytest.mark.parametrize("json_text,message", [
    ('{"deviceIterations": 0}', "deviceIterations must be a positive integer"),
    ('{"replicationFactor": 0}', "replicationFactor must be a positive integer"),
    ('{"Training.gradientAccumulation": 0}', "gradientAccumulation must be a positive"),
])
def test_default_options_from_environment_are_checked(monkeypatch, json_text, message):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", json_text)
    with pytest.raises(ValueError, match="POPTORCH_DEFAULT_OPTIONS=.*" + message):
        Options()


def test_valid_edge_values_are_accepted():
    opts = Options().deviceIterations(1).replicationFactor(1).maxRepeatLogs(0)
    opts.setAvailableMemoryProportion({"IPU0": 0.0, "IPU1": 1, "IPU2": 0.6})
    assert opts.available_memory_proportion == {0: 0.0, 1: 1.0, 2: 0.6}
    opts.Distributed.configureProcessId(1, 2)
    opts.useOfflineIpuTarget(21).randomSeed(-1).useIpuId(0)
    opts.deviceIterations(True)  # a bool is an int for the type check (PopTorch)
    assert opts.device_iterations == 1


def test_bad_gradient_accumulation_never_reaches_the_first_call():
    """Before: ZeroDivisionError at the first call."""
    opts = Options()
    with pytest.raises(ValueError):
        opts.Training.gradientAccumulation(0)
    model = torch.nn.Linear(2, 2)
    out = poptorch.inferenceModel(model, opts)(torch.ones(1, 2))
    torch.testing.assert_close(out, model(torch.ones(1, 2)))


# -- the options argument of a wrapper -------------------------------------------------

def test_invalid_options_type():
    with pytest.raises(poptorch.Error, match="Invalid type: 'options' is of type"):
        poptorch.inferenceModel(SingleLinear(), options={"deviceIterations": 2})


def test_options_passed_are_frozen_and_cloned():
    opts = poptorch.Options().deviceIterations(2)
    model = poptorch.inferenceModel(SingleLinear(), opts)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.deviceIterations(3)
    assert model.options is not opts and model.options.device_iterations == 2


def test_gradient_accumulation_is_rejected_for_inference():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match="gradientAccumulation to 1.*deviceIterations"):
        poptorch.inferenceModel(SingleLinear(), opts)
    # The advice PopTorch 3.x gives for pipelined execution, word for word.
    with pytest.raises(poptorch.Error) as info:
        poptorch.inferenceModel(SingleLinear(), opts)
    assert str(info.value).endswith(
        "Use poptorch.Options().deviceIterations to process a sufficient number of batches "
        "each run for pipelined execution instead.")
