"""Host time of a call (popart_compiler/cost/host_model.py): the parts a Python loop of
calls sees beyond the device's run."""
import pytest

from popart_compiler.cost import host_model
from popart_compiler.cost.host_model import HostSettings, host_time
from popart_compiler.enums import OutputMode

MB = 1_000_000


def test_a_call_costs_its_device_run_plus_its_fixed_work():
    t = host_time(0.010, 16, HostSettings(device_iterations=50, synthetic=True,
                                          input_bytes=MB, output_bytes=640))
    assert t.inputs == 0 and t.outputs == 0 and t.loading == 0
    assert t.total == pytest.approx(0.010 + host_model.CALL_SECONDS)
    assert t.samples == 16 * 50
    assert t.device_samples_per_second == pytest.approx(800 / 0.010)
    assert t.loop_samples_per_second == pytest.approx(800 / t.total)


def test_prefetching_hides_each_micro_batch_s_inputs_behind_the_device():
    link = host_model.HOST_LINK_BYTES_PER_S
    fast = host_time(1.0, 1, HostSettings(device_iterations=10, input_bytes=MB))
    assert fast.inputs == pytest.approx(MB / link)  # only the first iteration's
    # inputs that take longer than an iteration's device time are seen in full
    slow = host_time(10 * MB / link / 4, 1, HostSettings(device_iterations=10,
                                                         input_bytes=MB))
    step = MB / link
    assert slow.inputs == pytest.approx(step + 9 * (step - step / 4))


def test_replicas_of_one_machine_share_its_host_link():
    one = host_time(0.0, 1, HostSettings(input_bytes=MB))
    four = host_time(0.0, 1, HostSettings(input_bytes=MB, replicas=4))
    assert four.inputs == pytest.approx(4 * one.inputs)
    # replicas of 4 IPUs each have a machine each
    spread = host_time(0.0, 1, HostSettings(input_bytes=MB, replicas=4, ipus_per_replica=4))
    assert spread.inputs == pytest.approx(one.inputs)


@pytest.mark.parametrize("mode,period,returned", [
    (OutputMode.All, 1, 8 * 4), (OutputMode.Final, 1, 1), (OutputMode.Sum, 1, 1),
    (OutputMode.EveryN, 2, 2 * 8)])
def test_outputs_follow_the_output_mode(mode, period, returned):
    t = host_time(0.0, 1, HostSettings(micro_batches=8, device_iterations=4,
                                       output_bytes=1000, output_mode=mode,
                                       output_return_period=period))
    assert t.outputs == pytest.approx(returned * 1000 / host_model.HOST_LINK_BYTES_PER_S)


def test_a_data_loader_adds_its_loading_time():
    t = host_time(0.01, 16, HostSettings(device_iterations=50, synthetic=True,
                                         loader_samples_per_s=40000))
    assert t.loading == pytest.approx(800 / 40000)
    assert t.total == pytest.approx(0.01 + host_model.CALL_SECONDS + 0.02)
