#!/usr/bin/env python3
"""Our backends against peers, side by side in one process (issues 11, 23 and 30).

Models (``bench/peer_models.py``): toy rows (default, ``--rows toy``): an MLP
(784-512-512-10, micro-batch 32), a CNN (2 × conv + pool, then a linear layer; 3×32×32
input, micro-batch 16) and a BERT-style encoder (hidden 384, 6 layers, 6 heads,
sequence 128, micro-batch 8), deviceIterations 8; real sizes (``--rows real``, or
``all`` for both): ResNet-50 v1.5 (inference at micro-batch 32, training at 8),
BERT-base (hidden 768, 12 layers, sequence 128, micro-batch 8) and GPT-2 small
(training, sequence 256, micro-batch 4), deviceIterations 2.

Inference: time per sample of one call over the combined batch (deviceIterations
micro-batches). Runners: plain eager PyTorch on the combined batch under
``torch.no_grad()`` (the reference), ours with the eager compiler, ours with the
inductor compiler, ours with the ``auto`` compiler (timed once it has chosen: its
first calls run eager, Inductor compiles in the background once the program is hot,
both are timed on the real calls and the faster is kept; the run uses a fresh decision
store unless ``--reuse-decisions``; it compiles once hot, 3 calls and 1 s, instead of
after 20 times the expected compilation time as by default, unless ``--amortize``: the
steady state is the same), ``torch.compile`` of the model, ONNX Runtime (CPU
execution provider, model exported with ``torch.onnx.export``; skipped if
``onnxruntime`` is not installed: ``pip install -e ".[bench]"``).

``--device cuda``: every runner computes on the GPU (wall clock): ours with
``Options.Backend.executionDevice("cuda")``; the peers are given the same host inputs,
copy them to the GPU and return host outputs, as ours does; ``torch.compile`` runs in
its default mode and with ``mode="reduce-overhead"`` (CUDA graphs,
``torch.compile-ro``); no ONNX Runtime.

Training, SGD (lr 0.01), one weight update per micro-batch, deviceIterations per call:
time per micro-batch (loss: cross-entropy; GPT-2: next-token, over every position).
Runners: a plain eager loop (forward, cross-entropy, backward,
``torch.optim.SGD`` step per micro-batch; the reference), ours-eager, ours-inductor,
ours-auto, and the same loop with the forward + loss compiled by ``torch.compile`` (on
CUDA in both modes).

First results: seconds from wrapping a fresh model to its first output ("first": the
first model of that runner in this process; "again": a second fresh model with the
same architecture, so the Inductor/FX caches and imports are warm). For ours-auto,
"settled" is the seconds from wrapping the model until it had chosen its backend.

The header records the commit, torch version, threads, the CPU capability PyTorch
dispatches to and the load average; the last line is the worst ratio of ours-auto to
the best peer (plain eager, torch.compile in either mode, ONNX Runtime) over every row,
toy and real.

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

    python bench/peers.py                       # toy rows; minutes (Inductor compiles)
    python bench/peers.py --models mlp cnn --repeats 5
    python bench/peers.py --rows real           # real sizes; an hour or more on 2 cores
    python bench/peers.py --models resnet50 --no-training --quick --micro-batch 2
    python bench/peers.py --device cuda --rows all      # on a GPU machine
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import poptorch  # noqa: E402  pylint: disable=wrong-import-position
from popart_compiler.backends import auto  # noqa: E402  pylint: disable=wrong-import-position

from peer_models import (DEVICE_ITERATIONS, MODELS, REAL, ROWS, TOY,  # noqa: E402
                         Bert, Cnn, Mlp, WithLoss)  # pylint: disable=unused-import

def _opts(compiler: str, iterations: int = DEVICE_ITERATIONS) -> poptorch.Options:
    opts = poptorch.Options().deviceIterations(iterations)
    opts.Backend.compiler(compiler)
    opts.Backend.executionDevice(DEVICE)
    opts.showCompilationProgressBar(False)
    return opts


OURS = ("eager", "inductor", "auto")
#: What the steady-state times are read from (``--clock``).
CLOCK = time.perf_counter
#: Where every runner computes (``--device``): ``cpu`` or ``cuda``.
DEVICE = "cpu"
PEERS = ("eager", "torch.compile", "torch.compile-ro", "onnxruntime")


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
    _sync()
    return time.perf_counter() - start


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _on_device(fn: Callable) -> Callable:
    """``fn`` on host tensors, as ours is called: inputs copied to the device, outputs
    back to the host (on the CPU: ``fn`` itself)."""
    if DEVICE == "cpu":
        return fn

    def run(*args):
        out = fn(*[a.to(DEVICE, non_blocking=True) for a in args])
        return out.cpu() if isinstance(out, torch.Tensor) else out
    return run


def _compile_modes() -> Dict[str, str]:
    """The ``torch.compile`` peers of this device: name → mode (on CUDA also
    ``mode="reduce-overhead"``, CUDA graphs, as ``torch.compile-ro``)."""
    modes = {"torch.compile": "default"}
    if DEVICE == "cuda":
        modes["torch.compile-ro"] = "reduce-overhead"
    return modes


def _compiled_peers(make: Callable[[], nn.Module]) -> Dict[str, Callable]:
    """``torch.compile`` of a fresh device copy per mode of :func:`_compile_modes`."""
    return {name: torch.compile(make(), mode=mode) for name, mode in _compile_modes().items()}


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


def interleaved_samples(runners: Dict[str, Callable[[], object]], repeats: int,
                        clock: Optional[Callable[[], float]] = None
                        ) -> Dict[str, List[float]]:
    """Seconds of each runner's timed call in each of ``repeats`` rounds (``clock``:
    default :data:`CLOCK`). Each round runs the runners in a fresh random order
    (seeded), each with one untimed call before its timed one: the untimed call takes
    the cache and TLB misses left by the runner before it. Without it, a rotating order
    kept every runner behind the same predecessor, and whichever followed a memory-heavy
    eager runner paid for it (CNN inference, ours-inductor: 4.0 ms per call behind
    ours-eager, 2.7 ms behind itself)."""
    clock = clock or CLOCK
    times: Dict[str, List[float]] = {k: [] for k in runners}
    order = list(runners)
    rng = random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for k in order:
            runners[k]()  # settle: warm caches for this runner
            start = clock()
            runners[k]()
            times[k].append(clock() - start)
    return times


def _interleaved(runners: Dict[str, Callable[[], object]], repeats: int) -> Dict[str, float]:
    """Median seconds per call of each runner (:func:`interleaved_samples`)."""
    return {k: statistics.median(v) for k, v in interleaved_samples(runners, repeats).items()}


def _try_first(runners: Dict[str, Callable], first: Dict[str, float], name: str,
               fn: Callable, *args) -> None:
    """Time the first call of peer ``name`` and add it to ``runners``; a peer that
    raises (a torch.compile mode this model does not support) is left out, saying
    why."""
    try:
        first[name] = _first(lambda: fn, *args)
    except Exception as e:  # pylint: disable=broad-except
        print(f"{name} left out: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return
    runners[name] = fn


def inference(key: str, repeats: int, threads: int, quick: bool = False,
              micro_batch: Optional[int] = None,
              iterations: Optional[int] = None) -> Dict[str, Dict[str, float]]:
    row = ROWS[key]
    mb = micro_batch or row.inference_mb
    d = iterations or row.iterations
    torch.manual_seed(0)
    model = row.make().eval()
    n = mb * d
    x = row.data(n)
    first: Dict[str, float] = {}
    again: Dict[str, float] = {}
    ours = {}
    for compiler in OURS:
        start = time.perf_counter()
        first[f"ours-{compiler}"] = _first(lambda c=compiler: ours.setdefault(
            c, poptorch.inferenceModel(model, _opts(c, d))), x)
        if compiler == "auto":
            first["chosen"] = _settle(ours["auto"], lambda: ours["auto"](x))
            first["settled"] = time.perf_counter() - start
        if not quick:
            again[f"ours-{compiler}"] = _first(
                lambda c=compiler: poptorch.inferenceModel(row.make().eval(), _opts(c, d)), x)
    # its own copy of the weights, as ours (device copies) and ONNX Runtime have:
    # sharing the eager reference's tensors gave torch.compile a warm heap and caches
    # right after every eager run (CNN: 3.1 ms against 4.7 ms with its own copy)
    reference = copy.deepcopy(model).to(DEVICE)
    compiled = _compiled_peers(lambda: copy.deepcopy(model).to(DEVICE))
    runners = {"eager": _on_device(reference),
               **{f"ours-{c}": ours[c] for c in OURS}}
    with torch.no_grad():
        for name, fn in compiled.items():
            _try_first(runners, first, name, _on_device(fn), x)
        if not quick:
            again["torch.compile"] = _first(
                lambda: _on_device(torch.compile(row.make().eval().to(DEVICE))), x)
    start = time.perf_counter()
    ort_run = _onnx(model, x, threads) if DEVICE == "cpu" else None
    if ort_run is not None:
        ort_run()
        first["onnxruntime"] = time.perf_counter() - start
    with torch.no_grad():
        calls = {k: (lambda f=f: f(x)) for k, f in runners.items()}
        if ort_run is not None:
            calls["onnxruntime"] = ort_run
        times = _interleaved(calls, repeats)
    return {"time": {k: v / n for k, v in times.items()}, "first": first, "again": again}


def training(key: str, repeats: int, micro_batch: Optional[int] = None,
             iterations: Optional[int] = None) -> Dict[str, Dict[str, float]]:
    row = ROWS[key]
    mb = micro_batch or row.training_mb
    d = iterations or row.iterations
    torch.manual_seed(0)
    x, t = row.data(mb * d), row.targets(mb * d)
    first: Dict[str, float] = {}
    ours = {}
    for compiler in OURS:
        model = WithLoss(row.make())
        start = time.perf_counter()
        first[f"ours-{compiler}"] = _first(lambda c=compiler, m=model: ours.setdefault(
            c, poptorch.trainingModel(m, _opts(c, d), poptorch.optim.SGD(m.parameters(),
                                                                           lr=0.01))), x, t)
        if compiler == "auto":
            first["chosen"] = _settle(ours["auto"], lambda: ours["auto"](x, t))
            first["settled"] = time.perf_counter() - start

    def loop(model, fwd):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def run():
            xd, td = x.to(DEVICE, non_blocking=True), t.to(DEVICE, non_blocking=True)
            for i in range(d):
                opt.zero_grad()
                fwd(xd[i * mb:(i + 1) * mb], td[i * mb:(i + 1) * mb])[1].backward()
                opt.step()
            _sync()
        return run

    plain = WithLoss(row.make()).to(DEVICE)
    runners = {"eager": loop(plain, plain),
               **{f"ours-{c}": (lambda c=c: ours[c](x, t)) for c in OURS}}
    for name, mode in _compile_modes().items():
        comp = WithLoss(row.make()).to(DEVICE)
        fwd = torch.compile(comp, mode=mode)
        _try_first(runners, first, name, loop(comp, fwd))
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


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", choices=("toy", "real", "all"), default="toy",
                        help="which models by default: the toy rows, the real sizes "
                        "(ResNet-50, BERT-base, GPT-2 small) or both")
    parser.add_argument("--models", nargs="+", default=None, choices=list(ROWS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true",
                        help="check that rows run: 1 repeat, no 'again' first results")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="override every row's micro-batch (checks only)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="override every row's deviceIterations (checks only)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where every runner computes (cuda: the wall clock; "
                        "peers are given host inputs and return host outputs, as ours)")
    parser.add_argument("--reuse-decisions", action="store_true",
                        help="let ours-auto reuse the decisions recorded in the user's "
                        "store (default: a fresh store, so that every run decides)")
    parser.add_argument("--amortize", action="store_true",
                        help="ours-auto under the default policy (compiles once its calls "
                        "took 20 times the expected compilation time; rows then take "
                        "minutes to settle); default: it compiles once hot (3 calls, 1 s)")
    parser.add_argument("--no-training", action="store_true")
    parser.add_argument("--no-inference", action="store_true")
    parser.add_argument("--clock", choices=("wall", "cpu"), default=None,
                        help="steady-state times: wall clock, or the CPU time of the "
                        "calling thread (default with one thread on the CPU: cpu, "
                        "which leaves out the time other processes hold the core; "
                        "else wall)")
    args = parser.parse_args(argv)
    if args.models is None:
        args.models = {"toy": TOY, "real": REAL, "all": TOY + REAL}[args.rows]
    if args.quick:
        args.repeats = 1
    return args


def main(argv=None) -> None:
    args = _parse(argv)
    global CLOCK, DEVICE  # pylint: disable=global-statement
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: PyTorch sees no CUDA device")
    if not args.reuse_decisions:
        os.environ["POPTORCH_AUTO_DECISIONS_DIR"] = tempfile.mkdtemp(prefix="decisions-")
    if not args.amortize:
        # steady state within the row: compile once hot (3 calls, 1 s), not after 20 times
        # the expected compilation time as a user's run does (it then runs the same)
        auto.POLICY = dataclasses.replace(auto.POLICY, compile_seconds=0.0)
    torch.set_num_threads(args.threads)
    clock = args.clock or ("cpu" if args.threads == 1 and DEVICE == "cpu" else "wall")
    CLOCK = time.thread_time if clock == "cpu" else time.perf_counter
    cols = ["eager", "ours-eager", "ours-inductor", "ours-auto", "torch.compile"]
    cols += ["torch.compile-ro"] if DEVICE == "cuda" else ["onnxruntime"]
    train_cols = [c for c in cols if c != "onnxruntime"]
    gpu = f", GPU {torch.cuda.get_device_name()}" if DEVICE == "cuda" else ""
    lines = [f"commit {_commit()}, torch {torch.__version__}, {args.threads} thread(s), "
             f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
             f"{os.cpu_count()} CPUs{gpu}, load average {_load()} (1/5/15 min) at the start",
             f"device {DEVICE}; deviceIterations per row (toy {DEVICE_ITERATIONS}, real "
             f"{ROWS['resnet50'].iterations}), median of {args.repeats}, {clock} clock; "
             "cells: time (ratio to eager)" + (" [--quick / overridden sizes: a check, "
                                                "not figures]" if args.quick or
                                                args.micro_batch or args.iterations else ""),
             "", "Inference, per sample:", "",
             "| model | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    firsts = []
    worst = []  # (ours-auto / best peer, row)
    sizes = dict(micro_batch=args.micro_batch, iterations=args.iterations)
    for key in [] if args.no_inference else args.models:
        if ROWS[key].inference_mb is None:
            continue
        res = inference(key, args.repeats, args.threads, quick=args.quick, **sizes)
        lines.append(_row(ROWS[key].title, res["time"], "eager", cols))
        print(lines[-1], flush=True)
        firsts.append((f"{key} inference", res["first"], res["again"]))
        worst.append((_versus_peers(res["time"]), f"{key} inference"))
    if not args.no_training:
        lines += ["", "Training (SGD), per micro-batch:", "",
                  "| model | " + " | ".join(train_cols) + " |",
                  "|---" * (len(train_cols) + 1) + "|"]
        for key in args.models:
            if ROWS[key].training_mb is None:
                continue
            res = training(key, args.repeats, **sizes)
            lines.append(_row(ROWS[key].title, res["time"], "eager", train_cols))
            print(lines[-1], flush=True)
            firsts.append((f"{key} training", res["first"], {}))
            worst.append((_versus_peers(res["time"]), f"{key} training"))
    lines += _first_table(firsts, cols[4:])
    lines += ["", f"load average {_load()} (1/5/15 min) at the end"]
    if worst:
        ratio, row = max(worst)
        lines.append(f"worst ours-auto / best peer: {ratio:.2f} ({row})")
    print("\n".join(lines))


def _first_table(firsts, peers: List[str]) -> List[str]:
    names = ["ours-eager", "ours-inductor", "ours-auto"] + peers
    lines = ["", "First result, seconds (first in this process / again with a fresh "
             "model); ours-auto: first result, then seconds until it settled and its "
             "choice:", "", "| model | " + " | ".join(names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for title, first, again in firsts:
        cells = []
        for c in names:
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
    return lines


def _versus_peers(times: Dict[str, float]) -> float:
    """ours-auto's time over the fastest peer's (plain eager, torch.compile in either
    mode, ONNX Runtime) in one row."""
    return times["ours-auto"] / min(times[p] for p in PEERS if p in times)


if __name__ == "__main__":
    main()
