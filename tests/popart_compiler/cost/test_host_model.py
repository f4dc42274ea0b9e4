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


@pytest.fixture
def no_host_copy(monkeypatch):
    """The host link alone (the host's copies made free)."""
    monkeypatch.setattr(host_model, "HOST_COPY_BYTES_PER_S", float("inf"))


def test_prefetching_hides_each_micro_batch_s_inputs_behind_the_device(no_host_copy):
    link = host_model.HOST_LINK_BYTES_PER_S
    fast = host_time(1.0, 1, HostSettings(device_iterations=10, input_bytes=MB))
    assert fast.inputs == pytest.approx(MB / link)  # only the first iteration's
    # inputs that take longer than an iteration's device time are seen in full
    slow = host_time(10 * MB / link / 4, 1, HostSettings(device_iterations=10,
                                                         input_bytes=MB))
    step = MB / link
    assert slow.inputs == pytest.approx(step + 9 * (step - step / 4))


def test_replicas_of_one_machine_share_its_host_link(no_host_copy):
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


def test_the_host_copies_every_replica_s_inputs_on_one_thread():
    copy = host_model.HOST_COPY_BYTES_PER_S
    assert copy < host_model.HOST_LINK_BYTES_PER_S  # slower than the link
    one = host_time(1.0, 1, HostSettings(device_iterations=10, input_bytes=MB))
    assert one.inputs == pytest.approx(MB / copy)  # hidden after the first
    # 4 replicas of 4 IPUs: a machine (host link) each, but one process copies for all
    four = host_time(0.0, 1, HostSettings(input_bytes=MB, replicas=4, ipus_per_replica=4))
    assert four.inputs == pytest.approx(4 * MB / copy)
    # poprun --num-instances=2: each process copies its 2 replicas' inputs
    two = host_time(0.0, 1, HostSettings(input_bytes=MB, replicas=4, ipus_per_replica=4,
                                         host_processes=2))
    assert two.inputs == pytest.approx(2 * MB / copy)
    # synthetic data copies nothing
    assert host_time(0.0, 1, HostSettings(input_bytes=MB, synthetic=True)).inputs == 0


def test_a_host_bound_call_takes_its_copies_not_its_device_run():
    # the efficient-data-loading tutorial's CNN, 2 replicas on one IPU-Machine: 50
    # micro-batches of 16 float32 128 x 128 images per replica and call (1 MiB each)
    image = 16 * 128 * 128 * 4
    settings = HostSettings(device_iterations=50, replicas=2, input_bytes=image,
                            loader_samples_per_s=42605)
    device = 0.0324
    t = host_time(device, 16, settings)
    step = 2 * image / host_model.HOST_COPY_BYTES_PER_S  # both replicas, one thread
    assert step > device / 50
    assert t.inputs == pytest.approx(step + 49 * (step - device / 50))
    # the call lasts as long as the copies of its 50 steps (not the device's run)
    assert t.device + t.inputs == pytest.approx(50 * step + device / 50)
    assert t.loop_samples_per_second == pytest.approx(
        1600 / (t.device + t.inputs + host_model.CALL_SECONDS + t.outputs + 1600 / 42605
                + 50 * host_model.STEP_SYNC_SECONDS))  # the second replica's syncs


def test_each_further_replica_of_a_process_adds_its_step_synchronisations():
    sync = host_model.STEP_SYNC_SECONDS
    one = host_time(0.02, 16, HostSettings(device_iterations=50, synthetic=True))
    assert one.sync == 0  # the device's run holds the one replica's
    two = host_time(0.02, 16, HostSettings(device_iterations=50, replicas=2,
                                           synthetic=True))
    assert two.sync == pytest.approx(50 * sync)
    assert two.total == pytest.approx(0.02 + host_model.CALL_SECONDS + 50 * sync)
    # 8 replicas over 2 processes: each process services its 4
    spread = host_time(0.02, 16, HostSettings(device_iterations=4, replicas=8,
                                              host_processes=2, synthetic=True))
    assert spread.sync == pytest.approx(3 * 4 * sync)
