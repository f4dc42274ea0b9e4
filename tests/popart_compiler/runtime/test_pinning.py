"""Which cores a pipeline process is pinned to (``POPTORCH_PIPELINE_PIN_CORES``), and
that nothing is pinned by default or without enough cores."""
import json
import os
import subprocess
import sys

import pytest

from popart_compiler.runtime import pinning


def test_cores_for_gives_each_local_process_its_own_block():
    allowed = {5, 1, 3, 7}
    assert pinning.cores_for(0, 2, 1, allowed) == [1]
    assert pinning.cores_for(1, 2, 1, allowed) == [3]
    assert pinning.cores_for(1, 2, 2, allowed) == [5, 7]
    assert pinning.cores_for(0, 4, 1, allowed) == [1]
    assert pinning.cores_for(3, 4, 1, allowed) == [7]


def test_cores_for_refuses_too_few_cores_and_bad_indices():
    assert pinning.cores_for(0, 3, 2, {0, 1, 2, 3}) is None  # 6 cores needed
    assert pinning.cores_for(2, 2, 1, {0, 1}) is None
    assert pinning.cores_for(-1, 2, 1, {0, 1}) is None
    assert pinning.cores_for(0, 1, 0, {0, 1}) is None


def test_nothing_is_pinned_by_default(monkeypatch):
    monkeypatch.delenv(pinning.PIN_ENV, raising=False)
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert pinning.pin_stage_process(0, 2) is None
    if before is not None:
        assert os.sched_getaffinity(0) == before


_CHILD = """
import json, os, sys, threading
import torch
torch.set_num_threads(1)
from popart_compiler.runtime import pinning
early = threading.Event()
waiter = threading.Thread(target=early.wait)
waiter.start()
cores = pinning.pin_stage_process(int(sys.argv[1]), int(sys.argv[2]))
print(json.dumps([cores, sorted(os.sched_getaffinity(0)),
                  sorted(os.sched_getaffinity(waiter.native_id))]))
early.set()
waiter.join()
"""


def _child(rank, size, **env):
    environ = {k: v for k, v in os.environ.items()
               if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(rank), str(size)],
                         capture_output=True, text=True, check=True, env=environ)
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 cores")
def test_pinning_on_pins_every_thread_of_the_process():
    allowed = sorted(os.sched_getaffinity(0))
    (cores, main, other), _ = _child(1, 2, POPTORCH_PIPELINE_PIN_CORES="1")
    assert cores == main == other == [allowed[1]]
    # torchrun's local index and count win over the rank and size
    (cores, main, _), _ = _child(1, 2, POPTORCH_PIPELINE_PIN_CORES="1", LOCAL_RANK="0",
                                 LOCAL_WORLD_SIZE="1")
    assert cores == main == [allowed[0]]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity")
def test_too_few_cores_warns_and_pins_nothing():
    allowed = sorted(os.sched_getaffinity(0))
    size = len(allowed) + 1
    (cores, main, _), err = _child(0, size, POPTORCH_PIPELINE_PIN_CORES="1")
    assert cores is None and main == allowed
    assert f"{size} processes of 1 threads on this host need {size} cores" in err
