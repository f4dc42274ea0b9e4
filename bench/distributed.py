#!/usr/bin/env python3
"""Data-parallel training throughput: 1 process × 2 replicas against 2 processes × 1
replica (torch.distributed, gloo on 127.0.0.1), on the digits CNN of
``examples/digits.py``, measured side by side in one run.

Both sides train on the same global batch per weight update (micro-batch 16 ×
gradientAccumulation 2 × 2 replicas = 64 samples; deviceIterations 4 updates per
call) for ``--epochs`` epochs after one warm-up call that compiles. Reported:

* samples/s of each side (2 processes: all samples of both processes / the slower
  process's wall time) and their ratio (2 processes / 1 process; > 1: faster);
* the all-reduce share of step time in the 2-process run: seconds inside the gradient
  ``all_reduce`` / seconds of the training calls, per process;
* bytes all-reduced per weight update (4 × parameter count for float32 gradients).

Each of the 2 processes gets half of the machine's cores as torch threads
(``OMP_NUM_THREADS``); the single process is measured with torch's default thread
count (all cores) and with 1 thread (on a loaded machine, several threads per process
can be far slower than one). On a shared or 2-core machine the figures are noisy:
compare the ratios, not absolute values.

Usage::

    python bench/distributed.py             # 3 epochs
    python bench/distributed.py --epochs 1  # quicker, noisier
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

MICRO_BATCH, ACCUMULATION, DEVICE_ITERATIONS = 16, 2, 4


def _train(replicas: int, epochs: int) -> dict:
    """Train in this process (``Options`` read the launcher's RANK / WORLD_SIZE);
    returns samples, seconds, all-reduce statistics."""
    import torch

    import poptorch
    from digits import DigitsCNN, load_data

    train_set, _ = load_data()
    opts = poptorch.Options().replicationFactor(replicas).deviceIterations(
        DEVICE_ITERATIONS).randomSeed(0)
    opts.Training.gradientAccumulation(ACCUMULATION)
    opts.showCompilationProgressBar(False)
    model = DigitsCNN()
    loader = poptorch.DataLoader(opts, train_set, batch_size=MICRO_BATCH, shuffle=True)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(
        model.parameters(), lr=0.01, momentum=0.9))
    x, y = next(iter(loader))
    training(x, y)  # compile + first call, not timed
    group = training._state.session.process_group
    before = dict(group.stats) if group else None
    samples, start = 0, time.perf_counter()
    for _ in range(epochs):
        for x, y in loader:
            training(x, y)
            samples += x.shape[0]
    seconds = time.perf_counter() - start
    result = {"samples": samples, "seconds": seconds,
              "parameters": sum(p.numel() for p in model.parameters())}
    if group:
        result.update({k: group.stats[k] - before[k] for k in before})
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(epochs: int) -> list:
    port = str(_free_port())
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    procs = []
    try:
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port, OMP_NUM_THREADS=threads,
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", "--epochs", str(epochs)],
                env=env, stdout=subprocess.PIPE, text=True, start_new_session=True))
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_train(1, args.epochs)))
        return
    import torch
    default_threads = torch.get_num_threads()
    one = _train(2, args.epochs)
    torch.set_num_threads(1)
    single = _train(2, args.epochs)
    torch.set_num_threads(default_threads)
    workers = _two_processes(args.epochs)
    two_rate = sum(w["samples"] for w in workers) / max(w["seconds"] for w in workers)
    updates = workers[0]["all_reduce_calls"]
    print(f"digits CNN, {one['parameters']} parameters, global batch per weight update "
          f"{MICRO_BATCH * ACCUMULATION * 2}, {args.epochs} epoch(s)")
    print(f"2 processes x 1 replica:                {two_rate:8.1f} samples/s")
    for name, r in ((f"{default_threads} threads", one), ("1 thread", single)):
        rate = r["samples"] / r["seconds"]
        print(f"1 process  x 2 replicas, {name:>10}: {rate:8.1f} samples/s   ratio "
              f"(2 processes / 1 process) {two_rate / rate:.2f}")
    for rank, w in enumerate(workers):
        print(f"  process {rank}: all-reduce {w['all_reduce_seconds']:.3f} s of "
              f"{w['seconds']:.2f} s training calls = "
              f"{100 * w['all_reduce_seconds'] / w['seconds']:.1f} % of step time; "
              f"{w['all_reduce_calls']} all_reduce calls")
    print(f"bytes all-reduced per weight update: "
          f"{workers[0]['all_reduce_bytes'] / max(1, updates):.0f} "
          f"(4 x {one['parameters']} float32 gradients)")


if __name__ == "__main__":
    main()
