"""Host reads in a pipeline across processes (issue 33): a stage's state stays in its
process; a call that reads nothing moves no weights (bytes and collectives counted),
and every kind of host read after N calls returns the single-process values, also when
only one process reads; a pattern that cannot be served fails fast naming it."""
import os

import torch

import processes
from popart_compiler.runtime import collectives

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "pipeline_state_worker.py")
EXACT = dict(rtol=0, atol=0)
#: The collective timeout of the fail-fast test: a read left waiting would take it.
TIMEOUT_S = 900


def _worker():
    return processes.load_worker(WORKER)


def _same(got, want, what):
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **EXACT, msg=f"{what}: {key}")


def test_host_reads_fetch_state_on_demand(tmp_path):
    """3 calls read nothing: no state moves (0 bytes, no gradient reduction), only
    the activations and gradients crossing the boundary (exactly their bytes). Then
    process 0 alone saves a checkpoint (model and optimizer state, implicit reads) while
    process 1 goes on; copyWeightsToHost, state_dict() and the optimizer state in both
    processes after call 4 (a second read moves nothing more); the executable saved
    after call 4 and loaded runs call 5; process 0 reads it after process 1 ended its
    script. Every value equals the single-process run exactly."""
    codes, logs = processes.launch(WORKER, "reads", tmp_path, world=2)
    assert codes == [0, 0], logs
    reference = _worker().reference()
    quiet = _worker().QUIET_CALLS
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        traffic = got["quiet"]
        assert traffic["state_bytes_received"] == traffic["reads"] == 0, traffic
        assert traffic["all_reduce_calls"] == 0, traffic
        # the compile call is one of them: every call sends exactly its messages
        assert traffic["activation_bytes_sent"] == quiet * \
            traffic["expected_activation_bytes"], traffic
        cfg = _worker().CFG
        assert traffic["messages"] == quiet * cfg["d"] * cfg["a"], traffic  # 1 per mb
        # the compute spans' CPU time: this thread's, within the spans' wall time
        assert 0 < traffic["compute_cpu_s"] <= traffic["process_cpu_s"], traffic
        assert traffic["compute_cpu_s"] <= traffic["compute_s"] * 1.01 + 1e-3, traffic
        weights, ipu_state = got["after_4"]
        _same(weights, reference[quiet][0], f"weights after call 4, process {rank}")
        _same(ipu_state, reference[quiet][1], f"optimizer state after call 4, {rank}")
        _same(got["after_4_again"][0], reference[quiet][0], f"second read, {rank}")
        before, first, second = got["reads_after_4"]
        # the other stage's weights, written buffers (BatchNorm: stage 1) and optimizer
        # state, each once; the second read moves nothing
        assert first["reads"] - before["reads"] == (3 if rank == 0 else 2), first
        assert first["state_bytes_received"] > before["state_bytes_received"]
        assert second["reads"] == first["reads"], second
        assert second["state_bytes_received"] == first["state_bytes_received"], second
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    _same(got["checkpoint"]["model"], reference[quiet - 1][0], "checkpoint (process 0)")
    _same(got["checkpoint"]["optimizer"]["ipu_state"], reference[quiet - 1][1],
          "checkpoint optimizer state")
    _same(got["loaded_5"], reference[quiet + 1][0], "loaded executable after call 5")


def test_host_write_in_one_process_then_read_fails_fast(tmp_path):
    """Process 0 alone writes the weights, then reads them after the next call while
    process 1 goes on: the read is refused (far sooner than the collective timeout it
    would otherwise wait for) saying every process must make
    the same host writes, and process 1's call fails naming process 0."""
    codes, logs = processes.launch(WORKER, "write_in_one_process", tmp_path, world=2,
                                   **{collectives.TIMEOUT_ENV: str(TIMEOUT_S)})
    assert codes == [0, 0], logs
    message = processes.read(tmp_path, 0)
    seconds = float(message.split("s ", 1)[0])
    assert seconds < TIMEOUT_S / 2, message  # refused, not left waiting for the timeout
    assert "Reading the state of a pipeline across processes failed: process 0 of 2 " \
        "(pipeline stage 0 of 2 (IPU 0)) reads the buffers of pipeline stage 1 of 2 " \
        "(IPU 1) after call 2 and 3 host writes of them, but the process of that stage is " \
        "in call 3 after 2" in message
    assert "every process of the pipeline must make the same calls and the same host " \
        "writes" in message
    other = processes.read(tmp_path, 1)
    assert "process 0 of 2" in other.lower(), other
