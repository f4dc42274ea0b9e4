"""Logging, environment variables, package-level helpers and the error classes (spec
docs/api-sections.md api §1.2, §2.7, docs/semantics.md S-90, docs/api-sections.md options §8)."""
import logging
import os
import subprocess
import sys

import pytest
import torch

import poptorch
from models import SingleLinear


def run_python(code, **env):
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env)


@pytest.mark.parametrize("level,python_level", [
    ("TRACE", logging.DEBUG), ("DEBUG", logging.DEBUG), ("INFO", logging.INFO),
    ("WARN", logging.WARNING), ("ERR", logging.ERROR), ("OFF", logging.CRITICAL),
    (0, logging.DEBUG), (2, logging.INFO), (4, logging.ERROR), (6, logging.CRITICAL),
])
def test_set_log_level(level, python_level):
    try:
        poptorch.setLogLevel(level)
        assert poptorch.logger.level == python_level
        assert logging.getLogger("poptorch:cpp").level == python_level
    finally:
        poptorch.setLogLevel("WARN")


def test_set_log_level_errors():
    with pytest.raises(ValueError, match="Invalid log level integer"):
        poptorch.setLogLevel(5)
    with pytest.raises(ValueError, match="Unknown log level: LOUD. Valid values are DEBUG, "
                                         "ERR, INFO, OFF, TRACE and WARN"):
        poptorch.setLogLevel("LOUD")


def test_log_level_from_environment():
    code = "import poptorch, logging; print(poptorch.logger.level)"
    assert run_python(code, POPTORCH_LOG_LEVEL="INFO").stdout.strip() == str(logging.INFO)
    assert run_python(code).stdout.strip() == str(logging.WARNING)
    bad = run_python(code, POPTORCH_LOG_LEVEL="CHATTY")
    assert bad.returncode != 0 and "Unknown log level: CHATTY" in bad.stderr


def test_log_line_format_and_debug_messages():
    code = ("import torch, poptorch\n"
            "m = poptorch.inferenceModel(torch.nn.Linear(2, 2),\n"
            "    poptorch.Options().showCompilationProgressBar(False))\n"
            "m(torch.ones(1, 2))\n")
    out = run_python(code, POPTORCH_LOG_LEVEL="DEBUG").stderr
    assert "[poptorch::python] [info] Writing weights from host to IPU memory." in out
    assert "[poptorch:cpp] [debug] poptorch.Options set device_iterations to value 1" in out
    quiet = run_python(code).stderr
    assert "Writing weights" not in quiet


def test_import_side_effects():
    out = run_python("import os, poptorch; print(os.environ['RDMAV_FORK_SAFE'])",
                     RDMAV_FORK_SAFE="")
    assert out.returncode == 0
    assert "poptorch.testing" not in run_python(
        "import sys, poptorch; print([m for m in sys.modules if m == 'poptorch.testing'])"
    ).stdout.replace("[]", "")


def test_ipu_model_environment_variables():
    code = ("import torch, poptorch\n"
            "m = poptorch.inferenceModel(torch.nn.Linear(2, 2),\n"
            "    poptorch.Options().showCompilationProgressBar(False))\n"
            "print(m(torch.ones(1, 2)).shape)\n"
            "print(poptorch.ipuHardwareIsAvailable())\n")
    for env in ({"POPTORCH_IPU_MODEL": "1"}, {"POPTORCH_SMALL_IPU_MODEL": "1"}, {}):
        result = run_python(code, **env)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["torch.Size([1,", "2])", "False"]
    bad = run_python(code, POPTORCH_IPU_MODEL_VERSION="ipu3")
    assert bad.returncode != 0 and "Invalid IPU model version" in bad.stderr


def test_testing_allclose():
    import poptorch.testing as testing
    assert testing.allclose(torch.ones(2), torch.ones(2))
    assert testing.allclose((torch.ones(2), [torch.zeros(1)]), (torch.ones(2), [torch.zeros(1)]))
    assert not testing.allclose((torch.ones(2),), [torch.ones(2)])
    assert not testing.allclose(torch.ones(2), torch.zeros(2))


def test_version_and_public_names():
    assert poptorch.__version__ == "3.4.0"
    for name in ["trainingModel", "inferenceModel", "PoplarExecutor", "isRunningOnIpu",
                 "Options", "TensorLocationSettings", "ConfigFileError", "Block",
                 "BeginBlock", "BlockFunction", "removeBlocks", "Stage", "Phase",
                 "PipelinedExecution", "ShardedExecution", "SerialPhasedExecution",
                 "ParallelPhasedExecution", "identity_loss", "cond", "DataLoader",
                 "AsynchronousDataAccessor", "OutputMode", "ConnectionType", "ReductionType",
                 "MeanReductionStrategy", "DataLoaderMode", "SharingStrategy",
                 "CommGroupType", "VariableRetrievalMode", "Error", "RecoverableError",
                 "UnrecoverableError", "ipuHardwareIsAvailable", "ipuHardwareVersion",
                 "setLogLevel", "registerPreCompileHook", "registerPostCompileHook",
                 "ICustomArgParser", "registerCustomArgParser", "print", "module_repr",
                 "optim", "profiling", "enums", "ops", "options", "poptorch_core"]:
        assert hasattr(poptorch, name), name
    assert poptorch.poptorch_core.Error is poptorch.Error
    assert not hasattr(poptorch, "AnchorMode") or poptorch.AnchorMode is not None


def test_custom_arg_parser():
    class Box:
        def __init__(self, a, b):
            self.a, self.b = a, b

    class BoxParser(poptorch.ICustomArgParser):
        def yieldTensors(self, struct):
            yield struct.a
            yield struct.b

        def reconstruct(self, original, tensors):
            return Box(next(tensors), next(tensors))

    with pytest.raises(poptorch.Error, match="arg_parser must inherit from ICustomArgParser"):
        poptorch.registerCustomArgParser(Box, object())
    poptorch.registerCustomArgParser(Box, BoxParser())
    try:
        class M(torch.nn.Module):
            def forward(self, box):
                return Box(box.a + 1, box.b * 2)

        out = poptorch.inferenceModel(M())(Box(torch.ones(2), torch.ones(2)))
        assert isinstance(out, Box)
        assert out.a.tolist() == [2.0, 2.0] and out.b.tolist() == [2.0, 2.0]
    finally:
        poptorch.registerCustomArgParser(Box, None)
    poptorch.registerCustomArgParser(Box, None)  # removing twice is fine


# -- errors, model selection and POPTORCH_DEFAULT_OPTIONS ------------------------------

def test_error_attributes():
    try:
        poptorch.inferenceModel(SingleLinear(), options=3)
    except poptorch.Error as e:
        assert e.type == "poptorch_py_error" and e.location == ""
        assert str(e) == f"'poptorch_py_error': {e.message}"
    else:
        pytest.fail("no error")
    assert issubclass(poptorch.RecoverableError, poptorch.Error)
    assert issubclass(poptorch.UnrecoverableError, poptorch.Error)
    err = poptorch.RecoverableError("link lost", recovery_action="LINK_RESET")
    assert err.recovery_action == "LINK_RESET" and "Recovery action required: LINK_RESET" \
        in str(err)


def test_model_selection_logs(poptorch_logs):
    model = poptorch.inferenceModel(SingleLinear(), poptorch.Options().useIpuModel(True))
    model(torch.randn(1, 6))
    assert "From the user configuration: Ipu model: Enabled" in poptorch_logs.text


def test_default_options_that_are_not_json(monkeypatch):
    """A malformed POPTORCH_DEFAULT_OPTIONS raised a TypeError from re-raising a
    json.JSONDecodeError; it is a ValueError naming the variable."""
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", "notjson")
    with pytest.raises(ValueError, match="POPTORCH_DEFAULT_OPTIONS='notjson': Expecting"):
        poptorch.Options()


@pytest.mark.parametrize("value, on", [
    ("1", True), ("true", True), ("YES", True), (" On ", True), ("2", True),
    ("0", False), ("false", False), ("No", False), ("off", False), ("", False)])
def test_flag_variables_accept_the_usual_spellings(monkeypatch, value, on):
    """Every on / off variable reads the same spellings (``true`` was silently off for
    POPTORCH_IPU_MODEL_STRICT_MEMORY)."""
    from popart_compiler import config as compiler_config
    from poptorch._options import environment
    for name in ("POPTORCH_IPU_MODEL_STRICT_MEMORY", "POPTORCH_SMALL_IPU_MODEL",
                 "POPTORCH_VERIFY", "POPTORCH_IPU_MODEL_AS_HARDWARE",
                 "POPTORCH_EXPORT_PROTO_AS_BINARY"):
        monkeypatch.setenv(name, value)
        assert environment.flag(name) is on, name
    assert compiler_config.strict_memory() is on
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "no")
    assert compiler_config.ipu_model_flags() == (False, on)
    assert compiler_config.verify_graphs() is on
    assert environment.proto_export()[1] is on


def test_flag_variables_refuse_other_values(monkeypatch):
    from popart_compiler import config as compiler_config
    monkeypatch.setenv("POPTORCH_IPU_MODEL_STRICT_MEMORY", "enabled")
    with pytest.raises(poptorch.Error, match="POPTORCH_IPU_MODEL_STRICT_MEMORY='enabled' "
                       "is not an on / off value: set it to 1, true, yes, on"):
        compiler_config.strict_memory()


def test_flag_error_says_any_non_zero_integer_is_on(monkeypatch):
    """POPTORCH_IPU_MODEL_STRICT_MEMORY=2 is on: the refusal of other values says so."""
    from popart_compiler import config as compiler_config
    monkeypatch.setenv("POPTORCH_IPU_MODEL_STRICT_MEMORY", "2")
    assert compiler_config.strict_memory() is True
    monkeypatch.setenv("POPTORCH_IPU_MODEL_STRICT_MEMORY", "nope")
    with pytest.raises(poptorch.Error, match="so is any non-zero integer"):
        compiler_config.strict_memory()


def test_strict_memory_spelled_true_is_strict(monkeypatch):
    monkeypatch.setenv("POPTORCH_SMALL_IPU_MODEL", "1")
    monkeypatch.setenv("POPTORCH_IPU_MODEL_STRICT_MEMORY", "true")
    model = poptorch.inferenceModel(torch.nn.Linear(1024, 1024),
                                    poptorch.Options().showCompilationProgressBar(False))
    with pytest.raises(poptorch.Error) as info:
        model(torch.randn(4, 1024))
    assert info.value.type == "poplar_out_of_memory"
