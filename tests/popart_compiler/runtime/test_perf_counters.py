"""popart_compiler/runtime/perf_counters.py: which iterations a run returns and the
per-iteration timestamps of getPerfCounters() (docs/api-sections.md api §5.19)."""
import time

from popart_compiler.enums import OutputMode
from popart_compiler.runtime.perf_counters import IterationClock, returned_iterations


def test_returned_iterations_follow_the_output_mode():
    assert returned_iterations(OutputMode.All, 1, 4) == [0, 1, 2, 3]
    assert returned_iterations(OutputMode.EveryN, 2, 6) == [1, 3, 5]
    assert returned_iterations(OutputMode.EveryN, 4, 6) == [3]
    assert returned_iterations(OutputMode.Final, 1, 5) == [4]
    assert returned_iterations(OutputMode.Sum, 1, 5) == [4]


def test_counters_per_tensor_and_iteration_in_time_order():
    clock = IterationClock(3)
    since = time.perf_counter()
    clock.mark(0, 2, since)  # iterations 0 and 1 computed together
    c = clock.counters(num_inputs=2, num_outputs=1, returned=[1, 2])
    assert sorted(c) == ["input", "input_complete", "output", "output_complete"]
    assert len(c["input"]) == 2 and len(c["input"][0]) == 3 and len(c["output"][0]) == 2
    assert c["input_complete"][0][0] == since == c["input_complete"][0][1]
    assert c["input_complete"][0][2] == clock.started  # never marked: the whole run
    for k in range(3):
        assert c["input"][0][k] <= c["input_complete"][0][k]
    assert c["output"][0][0] <= c["output_complete"][0][0]
    assert clock.counters(0, 0, [])["input"] == [[]]


def test_counters_of_a_run_that_ended_earlier():
    clock = IterationClock(2)
    end = time.perf_counter()
    c = clock.counters(1, 1, [1], done=end)
    assert c["output_complete"] == [[end]] and c["input"] == [[clock.started] * 2]


def test_a_session_s_counters_read_later_describe_its_last_run():
    """The counters' lists are built when read: read after another run they describe
    that run, and whenever read, the run's own end (not the time of reading)."""
    import torch  # pylint: disable=import-outside-toplevel

    import poptorch  # pylint: disable=import-outside-toplevel
    model = poptorch.inferenceModel(torch.nn.Linear(3, 2), poptorch.Options()
                                    .deviceIterations(2))
    x = torch.randn(4, 3)
    model(x)
    first = model.getPerfCounters()
    model(x)
    ended = time.perf_counter()
    later = model.getPerfCounters()
    assert later["output_complete"][0][0] <= ended
    assert later["input"][0][0] > first["output_complete"][0][0]
    assert len(later["input"][0]) == 2 and len(later["output"][0]) == 2
    assert model.getPerfCounters() == later  # unchanged until the next run
