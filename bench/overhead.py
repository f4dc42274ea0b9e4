#!/usr/bin/env python3
"""Overhead of PopTorch (simulated IPU Model) against plain PyTorch on the CPU.

Measured side by side in one run, for an MLP (784-512-512-10, micro-batch 32) and a
small CNN (3×32×32 input, micro-batch 16):

(a) Time to first result: the first call of ``poptorch.inferenceModel(model)(x)`` on a
    fresh model (capture with ``torch.export`` + compile + first run), against
    ``torch.export.export(model, (x,), strict=False)`` alone and against plain
    PyTorch's first ``model(x)``.
    * "cold": the first ``torch.export`` of a process pays a one-off warm-up (imports,
      dispatcher and fake-tensor caches); each cold number is measured in its own
      fresh subprocess (after ``import torch, poptorch``, which is not timed).
    * "warm": in this process, after exporting an unrelated tiny module once; median
      of several fresh models.
    Target: poptorch ≤ 2 × torch.export + 1 s. A further row times the first call at
    deviceIterations 64, which also computes 64 micro-batches: its reference is
    torch.export + one eager call on the same 64 micro-batches.
(b) Steady-state inference time per sample at deviceIterations 1, 16 and 64: one call
    consumes ``micro-batch × deviceIterations`` samples; the reference is plain eager
    PyTorch on the same combined batch under ``torch.no_grad()``. Median of many
    repetitions (``time.perf_counter``), after warm-up, with the sides interleaved so
    that background load affects them alike. Target: ratio ≤ 1.10 at
    deviceIterations ≥ 16. For information, also against an eager loop over the
    micro-batches ("eager loop": what deviceIterations means on an IPU).
(c) Training time per micro-batch: ``poptorch.trainingModel`` with
    ``poptorch.optim.SGD(lr=0.01)`` and deviceIterations 16, against a plain eager loop
    doing the same micro-batching (forward, backward and ``torch.optim.SGD`` step per
    micro-batch). No target (reported for information).
(d) Cost of making every call all-or-nothing: a momentum-SGD training call at
    deviceIterations 1 and 16 with the rollback snapshot (the default) against the
    same call with it turned off. No target (reported for information).

Ratios are poptorch / reference (lower is better); "ratio" compares medians (targets
are judged on it), "ratio(min)" compares the fastest repetitions, the estimate least
disturbed by other processes on a shared machine. ``torch.set_num_threads`` is left at
its default. The compilation progress bar is turned off (it only draws on stderr).

Usage::

    python bench/overhead.py            # about 40 s on 2 idle cores
    python bench/overhead.py --quick    # about 25 s, noisier
    python bench/overhead.py --no-cold  # skip the fresh-process measurements
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

import poptorch

#: Model name → (micro-batch size, per-sample input shape).
MODELS: Dict[str, Tuple[int, Tuple[int, ...]]] = {
    "MLP": (32, (784, )),
    "CNN": (16, (3, 32, 32)),
}
DEVICE_ITERATIONS = (1, 16, 64)
TRAIN_DEVICE_ITERATIONS = 16
STEADY_TARGET = 1.10


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------
class MLP(torch.nn.Module):
    """784-512-512-10 multi-layer perceptron with ReLU activations."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(784, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 10))

    def forward(self, x):
        """Logits of a batch ``[B, 784]``."""
        return self.net(x)


class CNN(torch.nn.Module):
    """Small CIFAR-style CNN: two conv/ReLU/max-pool stages, then 4096-128-10."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.classifier = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 128), torch.nn.ReLU(),
            torch.nn.Linear(128, 10))

    def forward(self, x):
        """Logits of a batch ``[B, 3, 32, 32]``."""
        return self.classifier(self.features(x))


class WithLoss(torch.nn.Module):
    """Wraps a classifier so that ``forward(x, y)`` returns ``(logits, loss)``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        """``(logits, mean cross-entropy)``."""
        logits = self.model(x)
        return logits, self.loss(logits, y)


def make_model(name: str) -> torch.nn.Module:
    """A freshly initialised model by name (``"MLP"`` or ``"CNN"``), in eval mode."""
    return {"MLP": MLP, "CNN": CNN}[name]().eval()


def make_inputs(name: str, samples: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random inputs ``[samples, *shape]`` and labels ``[samples]`` for a model."""
    _, shape = MODELS[name]
    return torch.randn(samples, *shape), torch.randint(0, 10, (samples, ))


def quiet_options() -> poptorch.Options:
    """Default ``poptorch.Options`` without the compilation progress bar."""
    return poptorch.Options().showCompilationProgressBar(False)


# --------------------------------------------------------------------------------------
# (a) time to first result
# --------------------------------------------------------------------------------------
def first_result_time(name: str, what: str, device_iterations: int = 1) -> float:
    """Seconds for one first-result measurement on a fresh model.

    ``what``: ``"export"`` (``torch.export.export(strict=False)``), ``"poptorch"``
    (first call of ``poptorch.inferenceModel``) or ``"plain"`` (first eager call), on a
    combined batch of ``micro-batch × device_iterations`` samples.
    """
    micro_batch, _ = MODELS[name]
    model = make_model(name)
    x, _ = make_inputs(name, micro_batch * device_iterations)
    start = time.perf_counter()
    if what == "export":
        torch.export.export(model, (x, ), strict=False)
    elif what == "poptorch":
        opts = quiet_options().deviceIterations(device_iterations)
        poptorch.inferenceModel(model, opts)(x)
    elif what == "plain":
        with torch.no_grad():
            model(x)
    else:
        raise ValueError(what)
    return time.perf_counter() - start


def warm_up_export() -> None:
    """Pay torch.export's one-off process warm-up on an unrelated tiny module."""
    torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2), ), strict=False)
    with torch.no_grad():
        torch.nn.Linear(2, 2)(torch.randn(1, 2))


def cold_time(name: str, what: str) -> float:
    """:func:`first_result_time` as the first thing a fresh Python process does
    (after ``import torch, poptorch``)."""
    out = subprocess.run([sys.executable, __file__, "--cold", name, what],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def warm_time(name: str, what: str, repeats: int,
              device_iterations: int = 1) -> Tuple[float, float]:
    """``(median, minimum)`` of ``repeats`` :func:`first_result_time` measurements in
    this (warmed up) process, each on a fresh model."""
    times = [first_result_time(name, what, device_iterations) for _ in range(repeats)]
    return statistics.median(times), min(times)


# --------------------------------------------------------------------------------------
# (b), (c) steady state
# --------------------------------------------------------------------------------------
def interleaved_medians(fns: List[Callable[[], None]], warmup: int, min_rounds: int,
                        budget_s: float, max_rounds: int = 500) -> List[Tuple[float, float]]:
    """``(median, minimum)`` wall time (s) of each function, calling them in turn.

    After ``warmup`` rounds, measured rounds run until at least ``min_rounds`` are done
    and ``budget_s`` seconds have passed (at most ``max_rounds``). Every other round
    calls the functions in reverse order, so that neither side always runs first.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: List[List[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    deadline = time.perf_counter() + budget_s
    rounds = 0
    while rounds < min_rounds or (time.perf_counter() < deadline and rounds < max_rounds):
        for i in (order if rounds % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - start)
        rounds += 1
    return [(statistics.median(ts), min(ts)) for ts in times]


def inference_per_sample(name: str, device_iterations: int, min_rounds: int,
                         budget_s: float) -> Dict[str, Tuple[float, float]]:
    """Seconds per sample of steady-state inference, each as ``(median, minimum)``.

    Keys: ``"poptorch"``; ``"eager"``: plain PyTorch on the combined batch (the
    reference of the target); ``"loop"`` (deviceIterations > 1 only): plain PyTorch
    looping over the micro-batches, which is what the IPU semantics describe.
    """
    micro_batch, _ = MODELS[name]
    samples = micro_batch * device_iterations
    model = make_model(name)
    x, _ = make_inputs(name, samples)
    ipu = poptorch.inferenceModel(model, quiet_options().deviceIterations(device_iterations))
    ipu(x)  # compile
    micro_batches = x.split(micro_batch)

    def run_poptorch():
        ipu(x)

    def run_eager():
        with torch.no_grad():
            model(x)

    def run_loop():
        with torch.no_grad():
            for xb in micro_batches:
                model(xb)

    fns = {"poptorch": run_poptorch, "eager": run_eager}
    if device_iterations > 1:
        fns["loop"] = run_loop
    stats = interleaved_medians(list(fns.values()), warmup=2, min_rounds=min_rounds,
                                budget_s=budget_s)
    ipu.destroy()
    return {key: _per(st, samples) for key, st in zip(fns, stats)}


def training_per_micro_batch(name: str, device_iterations: int, min_rounds: int,
                             budget_s: float) -> Tuple[Tuple[float, float], Tuple[float, float]]:
    """``(poptorch, plain)`` seconds per training micro-batch (SGD, lr 0.01), each as
    ``(median, minimum)``."""
    micro_batch, _ = MODELS[name]
    x, y = make_inputs(name, micro_batch * device_iterations)

    ipu_model = WithLoss(make_model(name)).train()
    opts = quiet_options().deviceIterations(device_iterations)
    ipu = poptorch.trainingModel(ipu_model, opts,
                                 poptorch.optim.SGD(ipu_model.parameters(), lr=0.01))
    ipu(x, y)  # compile

    plain_model = WithLoss(make_model(name)).train()
    optimizer = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    xs, ys = x.split(micro_batch), y.split(micro_batch)

    def run_poptorch():
        ipu(x, y)

    def run_plain():
        for xb, yb in zip(xs, ys):
            optimizer.zero_grad()
            _, loss = plain_model(xb, yb)
            loss.backward()
            optimizer.step()

    t_ipu, t_plain = interleaved_medians([run_poptorch, run_plain], warmup=2,
                                         min_rounds=min_rounds, budget_s=budget_s)
    ipu.destroy()
    return _per(t_ipu, device_iterations), _per(t_plain, device_iterations)


def rollback_cost(name: str, device_iterations: int, min_rounds: int,
                  budget_s: float) -> Tuple[Tuple[float, float], Tuple[float, float]]:
    """``(with, without)`` seconds per training call with and without the snapshot
    that makes a call all-or-nothing (docs/semantics.md S-73), each as ``(median, minimum)``: two
    executors of the same model, one with the rollback turned off."""
    micro_batch, _ = MODELS[name]
    x, y = make_inputs(name, micro_batch * device_iterations)
    executors = []
    for rollback in (True, False):
        model = WithLoss(make_model(name)).train()
        ipu = poptorch.trainingModel(
            model, quiet_options().deviceIterations(device_iterations),
            poptorch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        ipu(x, y)  # compile
        ipu._state.session.all_or_nothing = rollback
        executors.append(ipu)
    stats = interleaved_medians([lambda e=e: e(x, y) for e in executors], warmup=2,
                                min_rounds=min_rounds, budget_s=budget_s)
    for ipu in executors:
        ipu.destroy()
    return stats[0], stats[1]


def _per(stats: Tuple[float, float], n: int) -> Tuple[float, float]:
    """``(median, minimum)`` divided by ``n``."""
    return stats[0] / n, stats[1] / n


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------
def fmt_time(seconds: float) -> str:
    """Human-readable duration (s, ms or µs)."""
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} µs"


class Table:
    """Accumulates rows and prints them as an aligned text table.

    Times are given as ``(median, minimum)`` pairs (a bare float for single-shot
    measurements). The verdict uses the medians; the ratio of the minima is shown too,
    because on a shared machine the minimum is the estimate least affected by other
    processes.
    """

    HEADER = ("model", "measurement", "poptorch", "reference", "ratio", "ratio(min)",
              "target", "")

    def __init__(self):
        self.rows: List[Tuple[str, ...]] = []
        self.failures: List[str] = []

    def add(self, model: str, what: str, ours, ref, ref_name: str,
            limit: Optional[float] = None, limit_text: str = "") -> None:
        """Add a row. ``ours``/``ref``: seconds or ``(median, min)``; ``limit``: the
        largest acceptable median poptorch time (seconds), or ``None``."""
        ours_med, ours_min = ours if isinstance(ours, tuple) else (ours, None)
        ref_med, ref_min = ref if isinstance(ref, tuple) else (ref, None)
        verdict = ""
        if limit is not None:
            verdict = "OK" if ours_med <= limit else "MISS"
            if verdict == "MISS":
                self.failures.append(f"{model} {what}")
        ratio_min = (f"{ours_min / ref_min:.2f}x" if ours_min is not None
                     and ref_min is not None else "")
        self.rows.append((model, what, fmt_time(ours_med),
                          f"{fmt_time(ref_med)} ({ref_name})", f"{ours_med / ref_med:.2f}x",
                          ratio_min, limit_text, verdict))

    def print(self) -> None:
        """Print the table."""
        widths = [max(len(r[i]) for r in self.rows + [self.HEADER])
                  for i in range(len(self.HEADER))]
        line = "  ".join("-" * w for w in widths)
        print(line)
        print("  ".join(h.ljust(w) for h, w in zip(self.HEADER, widths)))
        print(line)
        for row in self.rows:
            print("  ".join(c.ljust(w) if i < 2 or i > 5 else c.rjust(w)
                            for i, (c, w) in enumerate(zip(row, widths))))
        print(line)


def main(argv=None) -> int:
    """Run all measurements and print the table. Returns 0 (targets are reported, not
    enforced)."""
    parser = argparse.ArgumentParser(description="PopTorch overhead benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-cold", action="store_true",
                        help="skip the cold (fresh-process) first-result measurements")
    parser.add_argument("--cold", nargs=2, metavar=("MODEL", "WHAT"),
                        help=argparse.SUPPRESS)  # internal: one cold measurement
    args = parser.parse_args(argv)

    if args.cold:
        print(json.dumps({"seconds": first_result_time(*args.cold)}))
        return 0

    torch.manual_seed(0)
    quick = args.quick
    repeats = 2 if quick else 3  # fresh models per warm first-result measurement
    min_rounds = 3 if quick else 5  # steady state: at least this many timed rounds,
    budget = 0.6 if quick else 2.5  # and as many more as fit in this many seconds
    table = Table()
    start = time.perf_counter()
    print(f"torch {torch.__version__}, poptorch {poptorch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}{', quick' if quick else ''}", flush=True)

    # (a) time to first result
    if not args.no_cold:
        for name in MODELS:
            ours, export, plain = (cold_time(name, w) for w in ("poptorch", "export", "plain"))
            table.add(name, "(a) 1st result, cold", ours, export, "export",
                      2 * export + 1.0, "<= 2*export+1s")
            table.add(name, "(a) 1st result, cold", ours, plain, "eager")
    warm_up_export()
    for name in MODELS:
        ours = warm_time(name, "poptorch", repeats)
        export = warm_time(name, "export", repeats)
        plain = warm_time(name, "plain", repeats)
        table.add(name, "(a) 1st result, warm", ours, export, "export",
                  2 * export[0] + 1.0, "<= 2*export+1s")
        table.add(name, "(a) 1st result, warm", ours, plain, "eager")
        # With deviceIterations 64 the first call also computes 64 micro-batches (and
        # compiles a vectorized graph over them): compare with export + one eager call
        # on the same combined batch.
        ours64 = warm_time(name, "poptorch", repeats, device_iterations=64)
        plain64 = warm_time(name, "plain", repeats, device_iterations=64)
        ref64 = (export[0] + plain64[0], export[1] + plain64[1])
        table.add(name, "(a) 1st result, warm, D=64", ours64, ref64, "export+eager",
                  2 * export[0] + plain64[0] + 1.0, "<= 2*export+eager+1s")
    print(f"(a) done in {time.perf_counter() - start:.0f} s", flush=True)

    # (b) steady-state inference
    for name in MODELS:
        for d in DEVICE_ITERATIONS:
            res = inference_per_sample(name, d, min_rounds, budget)
            limit = STEADY_TARGET * res["eager"][0] if d >= 16 else None
            table.add(name, f"(b) inference/sample, D={d}", res["poptorch"], res["eager"],
                      "eager", limit, f"<= {STEADY_TARGET:.2f}x" if limit else "")
            if "loop" in res:
                table.add(name, f"(b) inference/sample, D={d}", res["poptorch"],
                          res["loop"], "eager loop")
    print(f"(b) done in {time.perf_counter() - start:.0f} s", flush=True)

    # (c) training
    for name in MODELS:
        ours, plain = training_per_micro_batch(name, TRAIN_DEVICE_ITERATIONS, min_rounds,
                                               budget)
        table.add(name, f"(c) train/micro-batch, D={TRAIN_DEVICE_ITERATIONS}", ours,
                  plain, "eager")
    print(f"(c) done in {time.perf_counter() - start:.0f} s", flush=True)

    # (d) cost of the all-or-nothing snapshot (a copy of weights, momentum and mutated
    # buffers per call), worst case: one micro-batch per call
    for name in MODELS:
        for d in (1, TRAIN_DEVICE_ITERATIONS):
            ours, without = rollback_cost(name, d, min_rounds, budget)
            table.add(name, f"(d) train call with rollback snapshot, D={d}", ours,
                      without, "no snapshot")
    print(f"(d) done in {time.perf_counter() - start:.0f} s\n", flush=True)

    micro = ", ".join(f"{n} micro-batch {b}, input {list(s)}" for n, (b, s) in MODELS.items())
    print(f"{micro}; ratio = poptorch / reference")
    table.print()
    if table.failures:
        print("targets missed: " + "; ".join(table.failures))
    else:
        print("all targets met")
    print(f"total {time.perf_counter() - start:.0f} s, load average now "
          f"{os.getloadavg()[0]:.2f} (other processes on the machine add noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
