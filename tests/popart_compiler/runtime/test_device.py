"""The IPU Model device (runtime/device.py): acquiring IPUs of a target version, the
small IPU Model, the limits and the offline target."""
import pytest

from popart_compiler.cost.ipu_model import TARGETS
from popart_compiler.errors import Error
from popart_compiler.runtime.device import acquire_device
from popart_compiler.session_options import SessionOptions


def test_ipu_model_device_selection(monkeypatch):
    device = acquire_device(2, "ipu21")
    assert device.num_ipus == 2 and device.target.clock_hz == 1.85e9
    assert TARGETS["ipu2"].memory_bytes == 1472 * 624 * 1024
    assert acquire_device(1, small=True).memory_per_ipu == 4 * 624 * 1024
    with pytest.raises(Error, match=r"Too many IPUs requested \(128\)"):
        acquire_device(128)
    with pytest.raises(Error, match=r"Failed to acquire 1 IPU\(s\)"):
        acquire_device(1, use_ipu_model=False)
    with pytest.raises(Error, match="not supported for the IPU model"):
        acquire_device(1, offline=True, explicit_model_request=True)
    assert acquire_device(1, offline=True) is None
    monkeypatch.setenv("POPTORCH_IPU_MODEL_VERSION", "ipu9")
    with pytest.raises(Error, match="Invalid IPU model version. Valid versions: ipu1, ipu2, "
                                    "ipu21."):
        SessionOptions.from_dict({})
