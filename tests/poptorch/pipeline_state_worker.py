"""One process of the tests of host reads in a pipeline across processes (issue 33),
also imported by them for the single-process reference runs.

Usage: ``python pipeline_state_worker.py <scenario> <out_dir>`` with ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` in the environment; each process
writes ``<out_dir>/rank<i>.pt`` (results) or ``<out_dir>/rank<i>.txt`` (a message).
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline_worker as base  # noqa: E402  (this directory, also when imported)
import poptorch  # noqa: E402
import processes  # noqa: E402

#: Adam, BatchNorm buffers (written by the last stage), no tied weight and no clipping:
#: a call needs no gradient sum, so nothing but activations and gradients travels.
CFG = dict(stages=2, opt="adam", d=2, a=3, r=1, mode="All", bn=True)
#: Calls before the first host read.
QUIET_CALLS = 3


def _data(call):
    return [t.reshape(-1, *t.shape[4:]) for t in base.global_data(CFG, call)]


def _make(pipeline, world=1, rank=0, seed=100):
    torch.manual_seed(seed)
    model = base.Blocks(2, bn=True)
    optimizer = base._optimizer(CFG["opt"], model)
    training = poptorch.trainingModel(model, base.options(CFG, pipeline, world, rank),
                                      optimizer)
    return model, optimizer, training


def _state(model, optimizer):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {k: v.clone() for k, v in optimizer.state_dict()["ipu_state"].items()})


def _traffic(training):
    """What this process moved so far: state bytes (reads), activation and gradient
    bytes and messages, gradient reductions."""
    session = training._state.session
    sched, state = session.schedule_stats, session.state_stats
    group = session.layout.group
    return {"state_bytes_received": state.bytes_received, "state_bytes_sent": state.bytes_sent,
            "reads": state.reads, "served": state.served,
            "activation_bytes_sent": sched.bytes_sent, "messages": sched.messages,
            "all_reduce_calls": group.stats["all_reduce_calls"],
            "expected_activation_bytes": _expected_bytes(session),
            "compute_s": sched.compute_s, "compute_cpu_s": sched.compute_cpu_s,
            "process_cpu_s": time.process_time()}


def _expected_bytes(session):
    """Activation and gradient bytes a process sends per call: one message per
    micro-batch of what crosses its boundary (several values packed, each at a 64-byte
    aligned offset)."""
    program, stage = session.layout.program, session.stage

    def message(values):
        sizes = [v.shape.numel() * v.dtype.itemsize for v in values]
        return sizes[0] if len(sizes) == 1 else sum(-(-n // 64) * 64 for n in sizes)
    per_mb = 0
    if stage < program.num_units - 1:
        per_mb += message(program.sends[stage])
    grads = [v for v in program.receives[stage] if v.requires_grad]
    if grads:
        per_mb += message(grads)
    return per_mb * CFG["a"] * CFG["r"] * CFG["d"]


def reads(rank, world, out_dir):
    """``QUIET_CALLS`` calls that read nothing; process 0 alone saves a checkpoint
    (implicit reads of both stages' weights and the optimizer state) while process 1
    goes on to the next call; both read after call 4 (``copyWeightsToHost``,
    ``state_dict()``, the optimizer's state, twice: the second read moves nothing) and
    save the executable; the file is loaded for call 5; process 1 ends its script
    after call 5 while process 0 reads the weights a moment later."""
    model, optimizer, training = _make(True, world, rank, seed=100 + rank)
    result = {}
    for call in range(QUIET_CALLS):
        training(*_data(call))
    result["quiet"] = _traffic(training)
    checkpoint = os.path.join(out_dir, "checkpoint.pt")
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   checkpoint)
    training(*_data(QUIET_CALLS))
    before = _traffic(training)
    training.copyWeightsToHost()
    result["after_4"] = _state(model, optimizer)
    first = _traffic(training)
    training.copyWeightsToHost()
    result["after_4_again"] = _state(model, optimizer)
    result["reads_after_4"] = (before, first, _traffic(training))
    exported = os.path.join(out_dir, f"model{rank}.poptorch")
    training.save(exported)
    training.destroy()
    loaded = poptorch.load(exported)
    loaded(*_data(QUIET_CALLS + 1))
    if rank == 1:
        processes.write_result(out_dir, rank, result)
        sys.exit(0)  # ends while process 0 still reads
    time.sleep(1.0)
    result["loaded_5"] = {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}
    loaded.destroy()
    result["checkpoint"] = torch.load(checkpoint, weights_only=False)
    return result


def reference():
    """:func:`reads` in one process: the state after each call."""
    model, optimizer, training = _make(False)
    states = []
    for call in range(QUIET_CALLS + 2):
        training(*_data(call))
        states.append(_state(model, optimizer))
    training.destroy()
    return states


def write_in_one_process(rank, world, out_dir):
    """Process 0 alone writes the weights (``copyWeightsToDevice``) after call 1 and
    reads them after call 2; process 1 goes on to call 3. Process 0's read fails
    naming the mismatch (process 1's call then fails naming process 0)."""
    model, optimizer, training = _make(True, world, rank)
    training(*_data(0))
    if rank == 0:
        training.copyWeightsToDevice()
    training(*_data(1))
    if rank == 1:
        try:
            training(*_data(2))
        except poptorch.Error as e:
            return f"Error: {e}"
        return "no error"
    start = time.monotonic()
    try:
        model.state_dict()
    except poptorch.Error as e:
        return f"{time.monotonic() - start:.1f}s Error: {e}"
    return "no error"


def main(argv):
    scenario, out_dir = argv[1], argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    result = globals()[scenario](rank, world, out_dir)
    processes.write_result(out_dir, rank, result)


if __name__ == "__main__":
    main(sys.argv)
