#!/usr/bin/env python3
"""Training overhead A/B: ``poptorch.trainingModel`` (eager backend) against the plain
eager loop of ``bench/peers.py`` (forward, cross-entropy, backward,
``torch.optim.SGD(lr=0.01)`` step per micro-batch), on the toy MLP and CNN rows.

Both sides run in this process on one thread, in a fresh random order each round, each
timed call after an untimed call of the same side (to take the cache misses the other
side left), timed by the calling thread's CPU time (``time.thread_time``), so that other
processes on a shared machine count less. Prints, per model, the median and fastest time per
micro-batch of each side and their ratios (ours / plain; lower is better).

Usage::

    python bench/train_ab.py                       # MLP and CNN, 41 rounds each
    python bench/train_ab.py --models mlp --rounds 101
    python bench/train_ab.py --no-rollback         # also ours without the rollback snapshot
    python bench/train_ab.py --profile mlp         # cProfile of 20 calls of ours
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import poptorch  # noqa: E402  pylint: disable=wrong-import-position

from peer_models import DEVICE_ITERATIONS, ROWS, WithLoss  # noqa: E402
from peers import interleaved_samples  # noqa: E402


def sides(key: str) -> Dict[str, Callable[[], object]]:
    """``{"plain": ..., "ours": ...}``: one call of each side (``DEVICE_ITERATIONS``
    micro-batches of the row's training micro-batch)."""
    row = ROWS[key]
    mb, d = row.training_mb, DEVICE_ITERATIONS
    torch.manual_seed(0)
    x, t = row.data(mb * d), row.targets(mb * d)
    model = WithLoss(row.make())
    opts = poptorch.Options().deviceIterations(d)
    opts.Backend.compiler("eager")
    opts.showCompilationProgressBar(False)
    ours = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.01))
    plain = WithLoss(row.make())
    opt = torch.optim.SGD(plain.parameters(), lr=0.01)

    def loop():
        for i in range(d):
            opt.zero_grad()
            plain(x[i * mb:(i + 1) * mb], t[i * mb:(i + 1) * mb])[1].backward()
            opt.step()
    run_ours = lambda: ours(x, t)  # noqa: E731
    run_ours.model = ours
    return {"plain": loop, "ours": run_ours}


def ab(key: str, rounds: int, no_rollback: bool = False) -> Dict[str, List[float]]:
    """Thread CPU seconds per call of each side over ``rounds`` alternating rounds
    (``no_rollback``: a third side, ours without the all-or-nothing snapshot)."""
    runs = sides(key)
    if no_rollback:
        runs["ours-no-rollback"] = sides(key)["ours"]
    for f in runs.values():
        for _ in range(3):
            f()
    if no_rollback:
        runs["ours-no-rollback"].model._state.session.all_or_nothing = False  # noqa
    return interleaved_samples(runs, rounds, time.thread_time)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=list(ROWS))
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--profile", default=None, choices=list(ROWS))
    parser.add_argument("--no-rollback", action="store_true",
                        help="add a side: ours without the all-or-nothing snapshot")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.profile:
        ours = sides(args.profile)["ours"]
        for _ in range(3):
            ours()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            ours()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
        return
    print(f"load average {'/'.join(f'{v:.2f}' for v in os.getloadavg())} at the start")
    for key in args.models:
        times = ab(key, args.rounds, args.no_rollback)
        d = DEVICE_ITERATIONS
        med = {k: statistics.median(v) / d for k, v in times.items()}
        low = {k: min(v) / d for k, v in times.items()}
        cells = ", ".join(f"{k} {med[k] * 1e3:.3f} ms ({med[k] / med['plain']:.3f}; fastest "
                          f"{low[k] / low['plain']:.3f})" for k in times)
        print(f"{key}, per micro-batch, median of {args.rounds} (ratio to plain): {cells}",
              flush=True)
    print(f"load average {'/'.join(f'{v:.2f}' for v in os.getloadavg())} at the end")


if __name__ == "__main__":
    main()
