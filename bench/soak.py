#!/usr/bin/env python3
"""Soak test: many calls in one process, and what they leave behind.

Runs, in one process, a mix that a long training job and its mistakes produce:

* training calls (momentum SGD, BatchNorm, deviceIterations 4) on a small classifier;
* every 10th call a failing one (an out-of-range class label in the last micro-batch,
  which must roll back: checked against the state before it);
* every 50th call an inference wrapper of the same model reads the trained weights;
* every 250th call ``destroy()`` and a recompile;
* calls from two threads at once on the same executor, every 100th call.

Resource use is read from ``/proc`` after a warm-up and at the end: resident memory
(RSS), open file descriptors, threads and child processes. Growth per 1,000 calls is
what a leak would show. Exits with status 1 if a rolled-back call changed the device
state, or if the final weights differ from a plain PyTorch run of the same steps.

Usage::

    python bench/soak.py               # 2,000 calls
    python bench/soak.py --calls 500   # quicker
"""
import argparse
import copy
import os
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

DEVICE_ITERATIONS = 4
MICRO_BATCH = 8


class Classifier(nn.Module):
    """BatchNorm + two linear layers with a cross-entropy loss."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x, y):
        """Logits and loss of ``x: [B, 16]``, ``y: [B]``."""
        out = self.fc2(torch.relu(self.fc1(self.bn(x))))
        return out, F.cross_entropy(out, y)


def resources() -> dict:
    """RSS (MiB), open fds, threads and child processes of this process."""
    rss = 0.0
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    pid = str(os.getpid())
    children = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == pid:
                        children += 1
            except OSError:
                continue
    return {"rss_mib": rss, "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task")), "children": children}


def device_state(training) -> dict:
    session = training._state.session
    state = dict(session.readWeights())
    state.update(session.readOptimizerState())
    return {k: v.clone() for k, v in state.items()}


def main(argv=None) -> int:
    """Run the soak and print the figures. Returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="training calls")
    parser.add_argument("--warmup", type=int, default=100,
                        help="calls before the first resource reading")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = Classifier()
    reference = copy.deepcopy(model)
    options = poptorch.Options().deviceIterations(DEVICE_ITERATIONS) \
        .showCompilationProgressBar(False)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    training = poptorch.trainingModel(model, options, optimizer)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    n = DEVICE_ITERATIONS * MICRO_BATCH

    def reference_step(x, y):
        for i in range(DEVICE_ITERATIONS):
            sl = slice(i * MICRO_BATCH, (i + 1) * MICRO_BATCH)
            ref_opt.zero_grad()
            reference(x[sl], y[sl])[1].backward()
            ref_opt.step()

    calls = steps = failures = rollbacks_wrong = recompiles = 0
    start_res = None
    start = time.perf_counter()
    for i in range(args.calls):
        if i == args.warmup:
            start_res = resources()
            start = time.perf_counter()
        x = torch.randn(n, 16, generator=g)
        y = torch.randint(0, 4, (n,), generator=g)
        if i % 10 == 9:
            before = device_state(training)
            bad = y.clone()
            bad[-1] = 99
            try:
                training(x, bad)
            except IndexError:
                failures += 1
            after = device_state(training)
            if any(not torch.equal(before[k], after[k]) for k in before):
                rollbacks_wrong += 1
        if i % 100 == 99:
            threads = [threading.Thread(target=training, args=(x, y)) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            reference_step(x, y)
            reference_step(x, y)
            steps += 2 * DEVICE_ITERATIONS
            calls += 2
        training(x, y)
        reference_step(x, y)
        calls += 1
        steps += DEVICE_ITERATIONS
        if i % 50 == 49:
            inference = poptorch.inferenceModel(model, poptorch.Options()
                                                .showCompilationProgressBar(False))
            inference(x, y)
            inference.destroy()
        if i % 250 == 249:
            training.destroy()
            recompiles += 1
    elapsed = time.perf_counter() - start
    end_res = resources()
    training.copyWeightsToHost()
    worst = max(float((p - q).abs().max()) for p, q in
                zip(model.state_dict().values(), reference.state_dict().values()))
    measured = max(1, args.calls - args.warmup)
    print(f"torch {torch.__version__}, poptorch {poptorch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{calls} training calls ({steps} optimizer steps), {failures} failing calls "
          f"rolled back ({rollbacks_wrong} changed the device), {recompiles} recompiles, "
          f"{args.calls // 50} inference wrappers, {args.calls // 100} two-thread bursts")
    print(f"max |poptorch - PyTorch| over all weights and buffers: {worst:.2e}")
    print(f"after {args.warmup} warm-up calls -> end ({measured} calls, "
          f"{elapsed:.0f} s):")
    for key, unit in (("rss_mib", "MiB"), ("fds", ""), ("threads", ""), ("children", "")):
        growth = end_res[key] - start_res[key]
        print(f"  {key:9s} {start_res[key]:8.1f} -> {end_res[key]:8.1f} {unit:3s} "
              f"growth {growth:+.1f} ({1000 * growth / measured:+.2f} per 1,000 calls)")
    ok = rollbacks_wrong == 0 and worst < 1e-4
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
