#!/usr/bin/env python3
"""Time to first result with the executable cache and with exported files (docs/semantics.md S-61,
S-62).

For an MLP (784-512-512-10, micro-batch 32), a small CNN (3×32×32, micro-batch 16) and
a 6-layer MiniLM-size transformer encoder (hidden 384, 12 heads, FFN 1536, sequence
128, micro-batch 8), each measured side by side in one run, in fresh processes (after
``import torch, poptorch`` and building the model, which are not timed):

"compiled" is the time to a compiled executable (``compile(x)``, or
``poptorch.load``), "result" the time to the first result (that plus the first run).

* **cold**: ``poptorch.inferenceModel(model, opts)(x)`` with an empty cache directory
  (capture with ``torch.export`` + compile + write the entry + first run);
* **warm**: the same in a new process with the entry written by the cold run (load the
  entry + compile + first run; no ``torch.export``);
* **exported**: ``poptorch.load(file)(x)`` of a file written by ``compileAndExport``.

Each is the median of ``--repeat`` processes. Ratios: cold / warm (target ≥ 5) and
exported / warm (target ≈ 1).

In a fresh process most of the time to first result is the one-off import of torch's
export stack (``torch._dynamo``, about 2.5 s on 2 busy cores), which the capture and the
deserializer of ``torch.export`` programs both need. The second table therefore repeats
the three measurements inside one process whose export stack is already imported (an
unrelated tiny model was captured and loaded first): a fresh model object and wrapper
per measurement, a fresh cache directory per cold run.

Usage::

    python bench/cache.py             # about 3 minutes on 2 cores
    python bench/cache.py --repeat 1  # quicker, noisier
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)

_MODELS = r'''
import torch


def build(name):
    torch.manual_seed(0)
    if name == "MLP":
        model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 10))
        x = torch.randn(32, 784)
    elif name == "CNN":
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10))
        x = torch.randn(16, 3, 32, 32)
    elif name == "tiny":
        model, x = torch.nn.Linear(3, 2), torch.randn(2, 3)
    else:
        layer = torch.nn.TransformerEncoderLayer(384, 12, 1536, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
        x = torch.randn(8, 128, 384)
    return model.eval(), x


def first_result(name, mode, cache, path):
    """``(seconds to a compiled executable, seconds to the first result)`` of ``mode``
    for model ``name``."""
    import time
    import poptorch
    model, x = build(name)
    opts = poptorch.Options().showCompilationProgressBar(False)
    if mode in ("cold", "warm"):
        opts.enableExecutableCaching(cache)
    start = time.perf_counter()
    if mode == "export":
        poptorch.inferenceModel(model, opts).compileAndExport(path, x)
        return time.perf_counter() - start, 0.0
    if mode == "exported":
        exe = poptorch.load(path)
    else:
        exe = poptorch.inferenceModel(model, opts)
        exe.compile(x)
    compiled = time.perf_counter() - start
    out = exe(x)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    return compiled, seconds
'''

_CHILD = _MODELS + r'''
import json, sys
print(json.dumps({"seconds": first_result(*sys.argv[1:5])}))
'''


def child(name: str, mode: str, cache: str, path: str) -> tuple:
    env = {**os.environ, "POPTORCH_LOG_LEVEL": "ERR"}
    env.pop("POPTORCH_CACHE_DIR", None)
    result = subprocess.run([sys.executable, "-c", _CHILD, name, mode, cache, path],
                            cwd=_ROOT, check=True, capture_output=True, text=True, env=env)
    return tuple(json.loads(result.stdout.strip().splitlines()[-1])["seconds"])


def measure_in_process(name: str, repeat: int, work: str) -> dict:
    """The three measurements inside this process (export stack already imported)."""
    namespace: dict = {}
    exec(compile(_MODELS, "<bench models>", "exec"), namespace)  # noqa: S102
    first_result = namespace["first_result"]
    path = os.path.join(work, f"{name}-inproc.poptorch")
    first_result(name, "export", "", path)
    times = {"cold": [], "warm": [], "exported": []}
    for i in range(repeat):
        cache = os.path.join(work, f"{name}-inproc-cache{i}")
        times["cold"].append(first_result(name, "cold", cache, path))
        times["warm"].append(first_result(name, "warm", cache, path))
        times["exported"].append(first_result(name, "exported", "", path))
    return {k: (statistics.median(c for c, _ in v), statistics.median(f for _, f in v))
            for k, v in times.items()}


def measure(name: str, repeat: int) -> dict:
    times = {"cold": [], "warm": [], "exported": []}
    work = tempfile.mkdtemp(prefix="poptorch-bench-cache-")
    try:
        path = os.path.join(work, "model.poptorch")
        child(name, "export", "", path)
        for i in range(repeat):
            cache = os.path.join(work, f"cache{i}")
            times["cold"].append(child(name, "cold", cache, path))
            times["warm"].append(child(name, "warm", cache, path))
            times["exported"].append(child(name, "exported", "", path))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {k: (statistics.median(c for c, _ in v), statistics.median(f for _, f in v))
            for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--models", default="MLP,CNN,MiniLM-6")
    args = parser.parse_args()
    names = args.models.split(",")
    header = (f"{'model':10s} {'what':8s} {'cold s':>8s} {'warm s':>8s} "
              f"{'exported s':>11s} {'cold/warm':>10s} {'exported/warm':>14s}")

    def row(name, r):
        for i, what in enumerate(("compiled", "result")):
            cold, warm, exported = r["cold"][i], r["warm"][i], r["exported"][i]
            print(f"{name:10s} {what:8s} {cold:8.3f} {warm:8.3f} {exported:11.3f} "
                  f"{cold / warm:10.2f} {exported / warm:14.2f}", flush=True)

    print("Fresh process (imports not timed; torch's export stack imported on first use)")
    print(header)
    for name in names:
        row(name, measure(name, args.repeat))
    print("\nSame process, torch's export stack already imported")
    print(header)
    os.environ.pop("POPTORCH_CACHE_DIR", None)
    import poptorch
    poptorch.setLogLevel("ERR")
    work = tempfile.mkdtemp(prefix="poptorch-bench-cache-")
    try:
        namespace: dict = {}
        exec(compile(_MODELS, "<bench models>", "exec"), namespace)  # noqa: S102
        namespace["first_result"]("tiny", "export", "", os.path.join(work, "tiny"))
        namespace["first_result"]("tiny", "exported", "", os.path.join(work, "tiny"))
        for name in names:
            row(name, measure_in_process(name, args.repeat, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
