"""The per-thread CPU figures of ``bench/pipeline_parallel.py`` (issue 33: where a stage
process's CPU goes besides its main thread): a helper thread's CPU time is found, by
thread, and the main thread is left out; ``--pin`` pins a process's threads, those it
starts later included, to one core."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "pipeline_parallel_bench", ROOT / "bench" / "pipeline_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_a_helper_threads_cpu_time_is_reported_by_thread():
    bench = _bench()
    before = bench._task_cpu()
    spun, stop = threading.Event(), threading.Event()

    def spin():  # 0.3 s of this thread's own CPU time, whatever the load
        start = time.thread_time()
        while time.thread_time() - start < 0.3:
            continue
        spun.set()
        stop.wait()

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        spun.wait()
        threads = bench._other_threads(before, bench._task_cpu())
    finally:
        stop.set()
        worker.join()
    assert len(threads) >= 1
    name, seconds = threads[0]  # the busiest first: the spinning thread
    assert 0.25 <= seconds <= 0.5 and isinstance(name, str) and name
    text = bench._by_thread([[name, seconds]], 100)
    assert text == f" ({name} {1e3 * seconds / 100:.2f})"
    assert bench._by_thread([], 100) == ""
    assert bench._by_thread([["idle", 1e-7]], 100) == ""  # under 0.005 ms per micro-batch


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_a_threads_cpu_clock_is_its_thread_time():
    bench = _bench()
    start = time.thread_time()
    while time.thread_time() - start < 0.05:  # some CPU time of this thread
        continue
    mine = bench._task_cpu()[str(threading.get_native_id())][1]
    after = time.thread_time()
    assert start + 0.05 <= mine <= after + 1e-3  # nanoseconds, not 10 ms clock ticks


def test_the_main_thread_is_left_out():
    bench = _bench()
    main = str(os.getpid())
    before = {main: ["python", 1.0], "1": ["gloo_tcp_loop", 0.5], "2": ["idle", 0.2]}
    after = {main: ["python", 9.0], "1": ["gloo_tcp_loop", 0.75], "2": ["idle", 0.2],
             "3": ["new", 0.1]}
    assert bench._other_threads(before, after) == [["gloo_tcp_loop", 0.25], ["new", 0.1]]


_PIN = """
import importlib.util, json, os, sys, threading
spec = importlib.util.spec_from_file_location("b", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
early = threading.Event()
waiter = threading.Thread(target=early.wait)  # a thread started before pinning
waiter.start()
core = bench._pin(int(sys.argv[2]))
seen = {}
later = threading.Thread(target=lambda: seen.update(
    later=os.sched_getaffinity(threading.get_native_id())))
later.start()
later.join()
print(json.dumps([core, sorted(os.sched_getaffinity(0)),
                  sorted(os.sched_getaffinity(waiter.native_id)), sorted(seen["later"])]))
early.set()
waiter.join()
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_pin_puts_every_thread_on_one_core_of_those_allowed():
    cores = sorted(os.sched_getaffinity(0))
    index = len(cores) + 1  # wraps around the allowed cores
    bench = str(ROOT / "bench" / "pipeline_parallel.py")
    out = subprocess.run([sys.executable, "-c", _PIN, bench, str(index)],
                         capture_output=True, text=True, check=True).stdout
    core, main, early, later = json.loads(out.strip().splitlines()[-1])
    expected = cores[index % len(cores)]
    assert core == expected and main == early == later == [expected]
