#!/usr/bin/env python3
"""Our backends against peers, side by side in one process (issue 11).

Models: an MLP (784-512-512-10, micro-batch 32), a CNN (2 × conv + pool, then a
linear layer; 3×32×32 input, micro-batch 16) and a BERT-style encoder (hidden 384,
6 layers, 6 heads, sequence 128, micro-batch 8, scaled-dot-product attention).

Inference, ``deviceIterations(8)``: time per sample of one call over the combined
batch (8 micro-batches). Runners: plain eager PyTorch on the combined batch under
``torch.no_grad()`` (the reference), ours with the eager compiler, ours with the
inductor compiler, ours with the ``auto`` compiler (timed once it has chosen: its
first calls run eager, Inductor compiles in the background once the program is hot,
both are timed on the real calls and the faster is kept), ``torch.compile`` of the
model, ONNX Runtime (CPU execution provider, model exported with
``torch.onnx.export``; skipped if ``onnxruntime`` is not installed:
``pip install -e ".[bench]"``).

Training, SGD (lr 0.01), one weight update per micro-batch, 8 per call: time per
micro-batch. Runners: a plain eager loop (forward, cross-entropy, backward,
``torch.optim.SGD`` step per micro-batch; the reference), ours-eager, ours-inductor,
ours-auto, and the same loop with the forward + loss compiled by ``torch.compile``.

First results: seconds from wrapping a fresh model to its first output ("first": the
first model of that runner in this process; "again": a second fresh model with the
same architecture, so the Inductor/FX caches and imports are warm). For ours-auto,
"settled" is the seconds from wrapping the model until it had chosen its backend.

The header records the commit, torch version, threads, the CPU capability PyTorch
dispatches to and the load average; the last line is the worst ratio of ours-auto to
the best peer (plain eager, torch.compile, ONNX Runtime) over every row.

Ratios are runner / reference of median times (lower is better); the sides are
interleaved (a random order per round, each timed call after an untimed one of the
same runner) so that background load affects them alike. ``torch.set_num_threads``
defaults to 1 (``--threads``) for the least noise on a shared machine; with one thread
every runner (ONNX Runtime too, on one intra-op thread) computes in the calling thread,
and steady-state times are that thread's CPU time (``--clock cpu``): on a shared 2-core
machine, wall-clock medians moved by 2× from run to run with the load (MLP inference,
ours-inductor 16.1 µs in one run and 31.5 µs in the next, load average 4.6), as
descheduled time landed on whichever runner was running.

Usage::

    python bench/peers.py                       # every model; minutes (Inductor compiles)
    python bench/peers.py --models mlp cnn --repeats 5
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import poptorch  # noqa: E402  pylint: disable=wrong-import-position

DEVICE_ITERATIONS = 8


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(),
                                 nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.net(x)


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                nn.Linear(4 * hidden, hidden))
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, h // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        att = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        x = self.norm1(x + self.out(att))
        return self.norm2(x + self.ff(x))


class Bert(nn.Module):
    """Encoder over token ids: embedding, 6 layers, a 2-class head on token 0."""

    def __init__(self, hidden=384, layers=6, heads=6, vocab=1000, seq=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.layers = nn.ModuleList([EncoderLayer(hidden, heads) for _ in range(layers)])
        self.head = nn.Linear(hidden, 2)

    def forward(self, ids):
        x = self.emb(ids) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(x[:, 0])


MODELS = {
    "mlp": ("MLP 784-512-512-10, mb 32", Mlp, 32,
            lambda n: torch.randn(n, 1, 28, 28), 10),
    "cnn": ("CNN 2×conv+pool+linear, 3×32×32, mb 16", Cnn, 16,
            lambda n: torch.randn(n, 3, 32, 32), 10),
    "bert": ("BERT encoder, hidden 384, 6 layers, seq 128, mb 8", Bert, 8,
             lambda n: torch.randint(0, 1000, (n, 128)), 2),
}


class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, t):
        out = self.model(x)
        return out, F.cross_entropy(out, t)


def _opts(compiler: str) -> poptorch.Options:
    opts = poptorch.Options().deviceIterations(DEVICE_ITERATIONS)
    opts.Backend.compiler(compiler)
    opts.showCompilationProgressBar(False)
    return opts


OURS = ("eager", "inductor", "auto")
#: What the steady-state times are read from (``--clock``).
CLOCK = time.perf_counter
PEERS = ("eager", "torch.compile", "onnxruntime")


def _settle(model, call: Callable[[], object], limit: float = 900.0) -> Optional[str]:
    """Call an ``auto`` model until it has chosen its backend (as a user's loop would;
    waiting for its background compilation, so that it does not run beside the
    timed runners); returns the choice (``None`` if undecided after ``limit``
    seconds)."""
    chooser = model._state.session.auto  # pylint: disable=protected-access
    if chooser is None:
        return "eager"
    start = time.perf_counter()
    while chooser.chosen is None and time.perf_counter() - start < limit:
        chooser.wait()
        call()
    return chooser.chosen


def _first(make: Callable[[], Callable], *args) -> float:
    start = time.perf_counter()
    make()(*args)
    return time.perf_counter() - start


def _onnx(model: nn.Module, x: torch.Tensor, threads: int) -> Optional[Callable]:
    try:
        import onnxruntime as ort  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    path = os.path.join(tempfile.mkdtemp(), "model.onnx")
    torch.onnx.export(model, (x,), path, dynamo=True, external_data=False)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    feed = x.numpy()
    return lambda: sess.run(None, {name: feed})


def _interleaved(runners: Dict[str, Callable[[], object]], repeats: int) -> Dict[str, float]:
    """Median seconds per call of each runner over ``repeats`` rounds. Each round runs
    the runners in a fresh random order (seeded), each with one untimed call before its
    timed one: the untimed call takes the cache and TLB misses left by the runner
    before it. Without it, a rotating order kept every runner behind the same
    predecessor, and whichever followed a memory-heavy eager runner paid for it (CNN
    inference, ours-inductor: 4.0 ms per call behind ours-eager, 2.7 ms behind
    itself)."""
    times: Dict[str, List[float]] = {k: [] for k in runners}
    order = list(runners)
    rng = random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for k in order:
            runners[k]()  # settle: warm caches for this runner
            start = CLOCK()
            runners[k]()
            times[k].append(CLOCK() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def inference(key: str, repeats: int, threads: int) -> Dict[str, Dict[str, float]]:
    _, cls, mb, data, _ = MODELS[key]
    torch.manual_seed(0)
    model = cls().eval()
    n = mb * DEVICE_ITERATIONS
    x = data(n)
    first: Dict[str, float] = {}
    again: Dict[str, float] = {}
    ours = {}
    for compiler in OURS:
        start = time.perf_counter()
        first[f"ours-{compiler}"] = _first(
            lambda c=compiler: ours.setdefault(c, poptorch.inferenceModel(model, _opts(c))), x)
        if compiler == "auto":
            first["chosen"] = _settle(ours["auto"], lambda: ours["auto"](x))
            first["settled"] = time.perf_counter() - start
        again[f"ours-{compiler}"] = _first(
            lambda c=compiler: poptorch.inferenceModel(cls().eval(), _opts(c)), x)
    # its own copy of the weights, as ours (device copies) and ONNX Runtime have:
    # sharing the eager reference's tensors gave torch.compile a warm heap and caches
    # right after every eager run (CNN: 3.1 ms against 4.7 ms with its own copy)
    compiled = torch.compile(copy.deepcopy(model))
    with torch.no_grad():
        first["torch.compile"] = _first(lambda: compiled, x)
        again["torch.compile"] = _first(lambda: torch.compile(cls().eval()), x)
    runners = {"eager": lambda: model(x), "ours-eager": lambda: ours["eager"](x),
               "ours-inductor": lambda: ours["inductor"](x),
               "ours-auto": lambda: ours["auto"](x),
               "torch.compile": lambda: compiled(x)}
    start = time.perf_counter()
    ort_run = _onnx(model, x, threads)
    if ort_run is not None:
        ort_run()
        first["onnxruntime"] = time.perf_counter() - start
        runners["onnxruntime"] = ort_run
    with torch.no_grad():
        times = _interleaved(runners, repeats)
    return {"time": {k: v / n for k, v in times.items()}, "first": first, "again": again}


def training(key: str, repeats: int) -> Dict[str, Dict[str, float]]:
    _, cls, mb, data, classes = MODELS[key]
    torch.manual_seed(0)
    d = DEVICE_ITERATIONS
    x, t = data(mb * d), torch.randint(0, classes, (mb * d,))
    first: Dict[str, float] = {}
    ours = {}
    for compiler in OURS:
        model = WithLoss(cls())
        start = time.perf_counter()
        first[f"ours-{compiler}"] = _first(lambda c=compiler, m=model: ours.setdefault(
            c, poptorch.trainingModel(m, _opts(c), poptorch.optim.SGD(m.parameters(),
                                                                        lr=0.01))), x, t)
        if compiler == "auto":
            first["chosen"] = _settle(ours["auto"], lambda: ours["auto"](x, t))
            first["settled"] = time.perf_counter() - start

    def loop(model, opt, fwd):
        def run():
            for i in range(d):
                opt.zero_grad()
                fwd(x[i * mb:(i + 1) * mb], t[i * mb:(i + 1) * mb])[1].backward()
                opt.step()
        return run

    plain = WithLoss(cls())
    comp = WithLoss(cls())
    comp_fwd = torch.compile(comp)
    first["torch.compile"] = _first(lambda: comp_fwd, x[:mb], t[:mb])
    runners = {
        "eager": loop(plain, torch.optim.SGD(plain.parameters(), lr=0.01), plain),
        "ours-eager": lambda: ours["eager"](x, t),
        "ours-inductor": lambda: ours["inductor"](x, t),
        "ours-auto": lambda: ours["auto"](x, t),
        "torch.compile": loop(comp, torch.optim.SGD(comp.parameters(), lr=0.01), comp_fwd),
    }
    times = _interleaved(runners, repeats)
    return {"time": {k: v / d for k, v in times.items()}, "first": first}


def _duration(seconds: float) -> str:
    """Four significant digits: ``24.61 µs``, ``31.45 ms``."""
    return f"{seconds * 1e6:.4g} µs" if seconds < 1e-3 else f"{seconds * 1e3:.4g} ms"


def _row(title: str, res: Dict[str, float], ref: str, cols: List[str]) -> str:
    cells = []
    for c in cols:
        if c not in res:
            cells.append("-")
        else:
            cells.append(f"{_duration(res[c])} ({res[c] / res[ref]:.2f})")
    return f"| {title} | " + " | ".join(cells) + " |"


def _commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def _load() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-training", action="store_true")
    parser.add_argument("--no-inference", action="store_true")
    parser.add_argument("--clock", choices=("wall", "cpu"), default=None,
                        help="steady-state times: wall clock, or the CPU time of the "
                        "calling thread (default with one thread: cpu, which leaves "
                        "out the time other processes hold the core; else wall)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    global CLOCK  # pylint: disable=global-statement
    CLOCK = time.thread_time if clock == "cpu" else time.perf_counter
    cols = ["eager", "ours-eager", "ours-inductor", "ours-auto", "torch.compile",
            "onnxruntime"]
    train_cols = cols[:-1]
    lines = [f"commit {_commit()}, torch {torch.__version__}, {args.threads} thread(s), "
             f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
             f"{os.cpu_count()} CPUs, load average {_load()} (1/5/15 min) at the start",
             f"deviceIterations {DEVICE_ITERATIONS}, median of {args.repeats}, {clock} "
             "clock; cells: time (ratio to eager)", "", "Inference, per sample:", "",
             "| model | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    firsts = []
    worst = []  # (ours-auto / best peer, row)
    for key in [] if args.no_inference else args.models:
        res = inference(key, args.repeats, args.threads)
        lines.append(_row(MODELS[key][0], res["time"], "eager", cols))
        print(lines[-1], flush=True)
        firsts.append((f"{key} inference", res["first"], res["again"]))
        worst.append((_versus_peers(res["time"]), f"{key} inference"))
    if not args.no_training:
        lines += ["", "Training (SGD), per micro-batch:", "",
                  "| model | " + " | ".join(train_cols) + " |",
                  "|---" * (len(train_cols) + 1) + "|"]
        for key in args.models:
            res = training(key, args.repeats)
            lines.append(_row(MODELS[key][0], res["time"], "eager", train_cols))
            print(lines[-1], flush=True)
            firsts.append((f"{key} training", res["first"], {}))
            worst.append((_versus_peers(res["time"]), f"{key} training"))
    lines += ["", "First result, seconds (first in this process / again with a fresh "
              "model); ours-auto: first result, then seconds until it settled and its "
              "choice:", "", "| model | ours-eager | ours-inductor | ours-auto | "
              "torch.compile | onnxruntime |", "|---|---|---|---|---|---|"]
    for title, first, again in firsts:
        cells = []
        for c in ("ours-eager", "ours-inductor", "ours-auto", "torch.compile",
                  "onnxruntime"):
            if c not in first:
                cells.append("-")
            elif c == "ours-auto":
                cells.append(f"{first[c]:.2f}, settled {first['settled']:.1f} "
                             f"({first['chosen']})")
            elif c in again:
                cells.append(f"{first[c]:.2f} / {again[c]:.2f}")
            else:
                cells.append(f"{first[c]:.2f}")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines += ["", f"load average {_load()} (1/5/15 min) at the end"]
    if worst:
        ratio, row = max(worst)
        lines.append(f"worst ours-auto / best peer: {ratio:.2f} ({row})")
    print("\n".join(lines))


def _versus_peers(times: Dict[str, float]) -> float:
    """ours-auto's time over the fastest peer's (plain eager, torch.compile, ONNX
    Runtime) in one row."""
    return times["ours-auto"] / min(times[p] for p in PEERS if p in times)


if __name__ == "__main__":
    main()
