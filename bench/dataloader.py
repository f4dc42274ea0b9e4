"""Benchmark: poptorch.DataLoader in Sync vs Async vs AsyncRebatched mode.

A training-like loop consumes combined batches and spends a fixed simulated compute
time per step, while the dataset's ``__getitem__`` costs a fixed time per sample. In
Sync mode loading and compute add up; in the asynchronous modes the worker process loads
the next batches while the loop computes, so an epoch takes about
``max(load, compute)`` per step instead of ``load + compute``.

Two variants:

* ``sleep`` (the target scenario): loading and compute are sleeps (I/O-bound loading,
  compute on the device);
* ``cpu`` (informational): loading and compute burn CPU, so they only overlap when two
  cores are idle; other load on the machine lowers its speed-up.

Run: ``python bench/dataloader.py [--steps 60] [--sample-ms 2.5] [--compute-ms 20]
[--variants sleep,cpu] [--progress]``. Construction (worker start-up) is reported
separately and excluded from the epoch times. Target (``sleep`` variant): the
asynchronous modes >= 1.8x faster than Sync; the exit status is 1 if it is missed.
"""
import argparse
import os
import sys
import time

import torch
import torch.utils.data

import poptorch

TARGET = 1.8


def burn(seconds):
    end = time.perf_counter() + seconds
    spins = 0
    while time.perf_counter() < end:
        spins += 1  # keep the core busy


class CostlyDataset(torch.utils.data.Dataset):
    """``__getitem__`` costs ``sample_s`` seconds (sleep or CPU burn)."""

    def __init__(self, size, sample_s, cpu):
        self.size, self.sample_s, self.cpu = size, sample_s, cpu

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        if self.cpu:
            burn(self.sample_s)
        else:
            time.sleep(self.sample_s)
        return torch.full((64, ), float(index)), torch.tensor(index)


def run_epoch(loader, compute_s, cpu):
    steps = 0
    checksum = 0
    start = time.perf_counter()
    for x, y in loader:
        checksum += int(y[0])  # touch the data, as a model call would
        if cpu:
            burn(compute_s)
        else:
            time.sleep(compute_s)
        steps += 1
    return time.perf_counter() - start, steps, checksum


def bench_variant(variant, args):
    cpu = variant == "cpu"
    opts = poptorch.Options()
    opts.deviceIterations(args.device_iterations)
    combined = args.batch_size * args.device_iterations
    dataset = CostlyDataset(args.steps * combined, args.sample_ms / 1000, cpu)
    modes = [
        ("Sync", dict(mode=poptorch.DataLoaderMode.Sync)),
        ("Async", dict(mode=poptorch.DataLoaderMode.Async)),
        ("AsyncRebatched", dict(mode=poptorch.DataLoaderMode.AsyncRebatched,
                                rebatched_worker_size=max(1, combined // 4))),
    ]
    results = {}
    for name, kwargs in modes:
        t0 = time.perf_counter()
        loader = poptorch.DataLoader(opts, dataset, batch_size=args.batch_size,
                                     progress_bar={"desc": f"{variant}/{name}"}
                                     if args.progress else False, **kwargs)
        construct = time.perf_counter() - t0
        epoch_times = []
        for _ in range(args.epochs):
            elapsed, steps, _ = run_epoch(loader, args.compute_ms / 1000, cpu)
            assert steps == args.steps, (steps, args.steps)
            epoch_times.append(elapsed)
        loader.terminate()
        results[name] = (construct, epoch_times)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--device-iterations", type=int, default=4)
    parser.add_argument("--sample-ms", type=float, default=2.5,
                        help="cost of one __getitem__")
    parser.add_argument("--compute-ms", type=float, default=20.0,
                        help="simulated compute per step")
    parser.add_argument("--variants", default="sleep,cpu")
    parser.add_argument("--progress", action="store_true", help="show tqdm progress bars")
    args = parser.parse_args(argv)

    combined = args.batch_size * args.device_iterations
    load_ms = combined * args.sample_ms
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"cores={os.cpu_count()} load average={load} steps/epoch={args.steps} "
          f"combined batch={combined} "
          f"load/step={load_ms:.1f} ms compute/step={args.compute_ms:.1f} ms "
          f"epochs={args.epochs}")
    print(f"ideal: sync {args.steps * (load_ms + args.compute_ms) / 1000:.2f} s/epoch, "
          f"async {args.steps * max(load_ms, args.compute_ms) / 1000:.2f} s/epoch")
    ok = True
    for variant in args.variants.split(","):
        results = bench_variant(variant, args)
        sync_time = sum(results["Sync"][1]) / len(results["Sync"][1])
        print(f"\n[{variant}] {'mode':<15} {'construct s':>11} {'epoch s (each)':>22} "
              f"{'mean s':>8} {'speed-up':>9}")
        for name, (construct, times) in results.items():
            mean = sum(times) / len(times)
            each = " ".join(f"{t:.2f}" for t in times)
            speedup = sync_time / mean
            print(f"[{variant}] {name:<15} {construct:>11.2f} {each:>22} {mean:>8.2f} "
                  f"{speedup:>8.2f}x")
            if variant == "sleep" and name != "Sync" and speedup < TARGET:
                ok = False
    if "sleep" in args.variants.split(","):
        print(f"\ntarget (sleep variant): asynchronous modes >= {TARGET}x faster than Sync: "
              f"{'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
