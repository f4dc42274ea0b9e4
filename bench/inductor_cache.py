#!/usr/bin/env python3
"""Compile latency of the backends across processes (issue 11, item 5).

For the MLP and the CNN of ``bench/peers.py`` (deviceIterations 8; inference, and
training with SGD), each in fresh processes:

* **inductor cold / warm**: seconds of ``compile()`` with the inductor compiler in a
  process whose TorchInductor cache directory (``TORCHINDUCTOR_CACHE_DIR``) is empty,
  then in a second process that reuses it. "total" is the whole ``compile()``
  (capture, our passes, Inductor), "inductor" the part spent compiling kernels
  (``popart_compiler.runtime.warm_up``). Ratio: cold / warm (target ≥ 5).
* **eager first result vs torch.export**: seconds from wrapping a fresh model to its
  first result with the eager compiler, against ``torch.export.export`` of the same
  model on one micro-batch, each in its own fresh process (both pay the first import
  of torch's export stack). Target: first result ≤ 2 × torch.export + 1 s.

Imports of ``torch`` and ``poptorch`` are not timed. Each figure is the median of
``--repeat`` runs.

Usage::

    python bench/inductor_cache.py            # about 4 minutes on 2 cores
    python bench/inductor_cache.py --repeat 1
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

_CHILD = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/bench")
import torch
import poptorch
import poptorch._executor.compile as executor
from peers import Cnn, Mlp, WithLoss, _opts

poptorch.setLogLevel("ERR")
kind, mode = sys.argv[2], sys.argv[3]
cls = {"mlp": Mlp, "cnn": Cnn}[kind]
shape = (1, 28, 28) if kind == "mlp" else (3, 32, 32)
x, t = torch.randn(8 * 16, *shape), torch.randint(0, 10, (8 * 16,))
torch.manual_seed(0)
spent = []
warm_up = executor.warm_up


def timed(exe, runners):
    start = time.perf_counter()
    warm_up(exe, runners)
    spent.append(time.perf_counter() - start)


executor.warm_up = timed
start = time.perf_counter()
if mode == "export":
    torch.export.export(cls().eval(), (x[:16],))
elif mode == "eager":
    poptorch.inferenceModel(cls().eval(), _opts("eager"))(x)
elif mode == "inference":
    poptorch.inferenceModel(cls().eval(), _opts("inductor")).compile(x)
else:
    m = WithLoss(cls())
    poptorch.trainingModel(m, _opts("inductor"),
                           poptorch.optim.SGD(m.parameters(), lr=0.01)).compile(x, t)
print(json.dumps([time.perf_counter() - start, sum(spent)]))
'''

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def child(kind: str, mode: str, cache: str) -> list:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", _CHILD, _ROOT, kind, mode], check=True,
                         capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("Inductor compile, seconds (cold: empty Inductor cache; warm: second process)")
    print(f"{'model':5s} {'program':10s} {'cold total':>10s} {'warm total':>10s} "
          f"{'ratio':>6s} {'cold inductor':>14s} {'warm inductor':>14s} {'ratio':>6s}")
    for kind in ("mlp", "cnn"):
        for mode in ("inference", "training"):
            cold, warm = [], []
            for _ in range(args.repeat):
                cache = tempfile.mkdtemp(prefix="poptorch-bench-inductor-")
                try:
                    cold.append(child(kind, mode, cache))
                    warm.append(child(kind, mode, cache))
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
            c = [statistics.median(v[i] for v in cold) for i in (0, 1)]
            w = [statistics.median(v[i] for v in warm) for i in (0, 1)]
            print(f"{kind:5s} {mode:10s} {c[0]:10.2f} {w[0]:10.2f} {c[0] / w[0]:6.2f} "
                  f"{c[1]:14.2f} {w[1]:14.2f} {c[1] / w[1]:6.2f}", flush=True)
    print("\nEager backend: first result vs torch.export, seconds (fresh processes)")
    print(f"{'model':5s} {'torch.export':>12s} {'first result':>12s} {'limit 2x+1':>11s}")
    cache = tempfile.mkdtemp(prefix="poptorch-bench-inductor-")
    try:
        for kind in ("mlp", "cnn"):
            export = statistics.median(child(kind, "export", cache)[0]
                                       for _ in range(args.repeat))
            first = statistics.median(child(kind, "eager", cache)[0]
                                      for _ in range(args.repeat))
            print(f"{kind:5s} {export:12.2f} {first:12.2f} {2 * export + 1:11.2f}",
                  flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
