"""The opt-in ``POPTORCH_IPU_MODEL_AS_HARDWARE=1`` reports the IPU Model's IPUs as
hardware, so frameworks that refuse to start without hardware run on the simulator
(lightning-graphcore's IPUStrategy); off by default (docs/api-sections.md api §2.5, §2.6). Physical
IPUs cannot be acquired; an offline target compiles but never runs."""
import json
import pathlib
import subprocess
import sys

import pytest
import torch

import poptorch
from models import SingleLinear

HERE = pathlib.Path(__file__).resolve().parent


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("POPTORCH_IPU_MODEL_AS_HARDWARE", raising=False)
    assert poptorch.ipuHardwareIsAvailable() is False
    assert poptorch.ipuHardwareIsAvailable(4) is False
    with pytest.raises(AssertionError, match="No IPU hardware available on this system"):
        poptorch.ipuHardwareVersion()
    monkeypatch.setenv("POPTORCH_IPU_MODEL_AS_HARDWARE", "0")
    assert poptorch.ipuHardwareIsAvailable() is False


@pytest.mark.parametrize("version, number", [("ipu1", 1), ("ipu2", 2), ("ipu21", 21),
                                             (None, 2)])
def test_opt_in_reports_the_ipu_model(monkeypatch, version, number):
    monkeypatch.setenv("POPTORCH_IPU_MODEL_AS_HARDWARE", "1")
    if version is None:
        monkeypatch.delenv("POPTORCH_IPU_MODEL_VERSION", raising=False)
    else:
        monkeypatch.setenv("POPTORCH_IPU_MODEL_VERSION", version)
    assert poptorch.ipuHardwareIsAvailable() is True
    assert poptorch.ipuHardwareIsAvailable(64) is True
    assert poptorch.ipuHardwareIsAvailable(65) is False  # more than the IPU Model has
    assert poptorch.ipuHardwareVersion() == number


@pytest.mark.slow
def test_lightning_ipu_strategy_matches_a_plain_lightning_cpu_run():
    """Trainer.fit / validate / predict of the digits CNN with lightning-graphcore's
    IPUStrategy (Lightning 2.0.9, explicit IPUPrecision plugin) equal a CPU run."""
    result = subprocess.run([sys.executable, str(HERE / "lightning_digits_run.py")],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["strategies"] == ["IPUStrategy", "SingleDeviceStrategy"]
    assert report["weights_moved"]
    assert report["weight_difference"] <= 1e-5
    ipu_metrics, cpu_metrics = report["validate"]
    assert ipu_metrics[0]["val_acc"] == pytest.approx(cpu_metrics[0]["val_acc"])
    assert report["prediction_shape"] == [64, 10]
    assert report["prediction_difference"] <= 1e-5


# -- physical IPUs and the offline target ----------------------------------------------


def test_physical_ipus_cannot_be_acquired():
    opts = poptorch.Options().useIpuModel(False)
    model = poptorch.inferenceModel(SingleLinear(), opts)
    with pytest.raises(poptorch.Error, match=r"Failed to acquire 1 IPU\(s\)"):
        model(torch.randn(1, 6))


def test_offline_model_cannot_run():
    opts = poptorch.Options().useOfflineIpuTarget()
    model = poptorch.inferenceModel(SingleLinear(), opts)
    with pytest.raises(AssertionError, match="Trying to run a model on an offline device"):
        model(torch.randn(1, 6))
    model.compile(torch.randn(1, 6))
    assert model.isCompiled() and not model.isAttachedToDevice()
    with pytest.raises(AssertionError, match=r"offline device \(ConnectionType.Never\)"):
        model.attachToDevice()
