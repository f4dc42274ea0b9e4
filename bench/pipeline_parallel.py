#!/usr/bin/env python3
"""Pipeline across processes (``Options.Distributed.pipelineAcrossProcesses``, issue
24) against the single-process run of the same pipelined model, side by side in one
run: training samples/s, and the pipeline efficiency measured against the IPU Model's
estimate for the same schedule.

Models (each ``--stages S`` pipeline stages, one ``poptorch.BeginBlock`` per IPU):

* ``mlp``: balanced stages of ``Linear(W, W)`` + ReLU blocks (``8 / S`` blocks per
  stage: the same 8-block model for 2 and 4 stages) and an MSE loss;
* ``bert``: Hugging Face ``BertForSequenceClassification`` (hidden 256, 4 layers,
  sequence 64) split as in ``examples/pipelined_bert.py`` (embeddings + first layers
  on IPU 0, classifier on the last IPU; not perfectly balanced).

Every side trains with SGD (momentum) on ``deviceIterations(D)``,
``gradientAccumulation(A)`` (the micro-batches in flight) and is timed over
``--calls`` calls after one warm-up call that compiles; each process has 1 torch
thread (the single process too: the same work per core). The single process runs the
``S`` stages one after the other; the ``S`` processes run them at once (1F1B). Each
side runs in fresh processes; ``--repeats`` interleaves them and keeps each side's
best (the machine is shared). Printed per model:

* samples/s of each side and their ratio (S processes / 1 process);
* measured pipeline efficiency = ratio / S (1: every process busy all the time);
* the IPU Model's estimate for the same schedule: ``pipeline_efficiency`` of
  ``ipuModelEstimate()`` (``M × steady-state cycles / pipeline cycles``, M = A
  micro-batches: the fill and drain bubble) and its speed-up over running the
  stages one after another, ``M × Σ stage cycles / pipeline cycles`` / S;
* CPU time per sample (``time.process_time``: this process and its gloo threads) of
  the single process and of the busiest stage process, and their ratio: what the
  wall-clock ratio approaches on idle cores if no stage waited for another (on a
  loaded, shared machine the wall-clock figures mostly measure the other load);
* the load average before and after (``os.getloadavg``).

Target (issue 24): 2 balanced stages on 2 processes ≥ 1.6× the single process. On a
2-core machine 4 processes share 2 cores, so 4 stages cannot go beyond 2×. Only the
CPU (gloo) path is measured here; the CUDA (NCCL) path needs a GPU.

Usage::

    python bench/pipeline_parallel.py                       # mlp and bert, 2 and 4 stages
    python bench/pipeline_parallel.py --models mlp --stages 2 --repeats 3
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

TARGET = 1.6
WORKER_TIMEOUT_S = 900


def _model(kind: str, stages: int, width: int):
    """The model, its inputs for one call and the micro-batch size."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import poptorch

    torch.manual_seed(0)
    if kind == "mlp":
        class Mlp(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(8)])
                for k, layer in enumerate(self.layers):
                    if k % (8 // stages) == 0:
                        poptorch.BeginBlock(layer, f"stage{k}", ipu_id=k * stages // 8)

            def forward(self, x, t):
                for layer in self.layers:
                    x = torch.relu(layer(x))
                return F.mse_loss(x, t)

        batch = 16
        return Mlp(), lambda n: (torch.randn(n, width), torch.randn(n, width)), batch
    import transformers
    from pipelined_bert import PipelinedBertForSequenceClassification

    seq, vocab = 64, 1000
    config = transformers.BertConfig(
        vocab_size=vocab, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=seq, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = PipelinedBertForSequenceClassification(config).parallelize(stages)
    batch = 8

    def data(n):
        return (torch.randint(0, vocab, (n, seq)), torch.ones(n, seq, dtype=torch.long),
                torch.randint(0, 2, (n,)))
    return model, data, batch


def _train(kind: str, stages: int, width: int, d: int, a: int, calls: int,
           pipelined: bool) -> dict:
    """One side, in this process: samples, seconds, the IPU Model's estimate."""
    import torch

    import poptorch

    torch.set_num_threads(1)
    model, data, batch = _model(kind, stages, width)
    opts = poptorch.Options().deviceIterations(d).randomSeed(0)
    opts.Training.gradientAccumulation(a)
    opts.showCompilationProgressBar(False)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
    if pipelined:
        opts.Distributed.pipelineAcrossProcesses()
    else:
        opts.Distributed.disable()
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(
        model.parameters(), lr=1e-3, momentum=0.9))
    inputs = data(batch * d * a)
    training(*inputs)  # compile + first call, not timed
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        training(*inputs)
    seconds = time.perf_counter() - start
    result = {"samples": calls * batch * d * a, "seconds": seconds,
              "cpu_s": time.process_time() - cpu}
    if not pipelined:
        cycles = training.ipuModelEstimate()["cycles"]
        # the same micro-batches with the stages one after another
        work = sum(sum(w["cycles"] for w in step["work"]) * step["repeat"]
                   for step in cycles["schedule"])
        result.update(efficiency=cycles["pipeline_efficiency"],
                      speedup=work / cycles["pipeline"] if cycles["pipeline"] else 1.0)
    training.destroy()
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, argv: list) -> list:
    """Run this script's worker in ``world`` processes (``world = 1``: the single
    process run); returns each process's result."""
    port = str(_free_port())
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *argv],
                                          env=env, stdout=subprocess.PIPE, text=True,
                                          start_new_session=True))
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
                for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,bert")
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--width", type=int, default=768, help="MLP width")
    parser.add_argument("--device-iterations", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=16)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--pipelined", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_train(args.kind, int(args.stages), args.width,
                                args.device_iterations, args.accumulation, args.calls,
                                args.pipelined)))
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min), "
          f"{os.cpu_count()} cores; D={args.device_iterations}, A={args.accumulation}, "
          f"{args.calls} timed calls, best of {args.repeats}; 1 torch thread per process")
    missed = False
    for kind in args.models.split(","):
        for stages in (int(s) for s in args.stages.split(",")):
            common = ["--kind", kind, "--stages", str(stages), "--width", str(args.width),
                      "--device-iterations", str(args.device_iterations),
                      "--accumulation", str(args.accumulation), "--calls", str(args.calls)]
            single_rate, multi_rate, estimate = 0.0, 0.0, None
            single_cpu, multi_cpu = float("inf"), float("inf")
            for _ in range(args.repeats):
                single = _launch(1, common)[0]
                single_rate = max(single_rate, single["samples"] / single["seconds"])
                single_cpu = min(single_cpu, single["cpu_s"] / single["samples"])
                estimate = single
                multi = _launch(stages, common + ["--pipelined"])
                multi_rate = max(multi_rate, multi[0]["samples"] /
                                 max(m["seconds"] for m in multi))
                multi_cpu = min(multi_cpu, max(m["cpu_s"] for m in multi) /
                                multi[0]["samples"])
            ratio = multi_rate / single_rate
            name = f"{kind}, {stages} stages" + (f" (width {args.width})"
                                                 if kind == "mlp" else "")
            print(f"{name}: 1 process {single_rate:8.1f} samples/s | {stages} processes "
                  f"{multi_rate:8.1f} samples/s | ratio {ratio:.2f}x | efficiency "
                  f"measured {ratio / stages:.2f}, IPU Model pipeline efficiency "
                  f"{estimate['efficiency']:.2f} (speed-up over sequential stages "
                  f"{estimate['speedup']:.2f}x = {estimate['speedup'] / stages:.2f} "
                  f"per stage)")
            print(f"  CPU ms per sample: 1 process {1e3 * single_cpu:.3f}, busiest of "
                  f"{stages} processes {1e3 * multi_cpu:.3f}: ratio {single_cpu / multi_cpu:.2f}x "
                  f"(what the wall-clock ratio would approach with {stages} idle cores "
                  "and no waiting)")
            if kind == "mlp" and stages == 2 and ratio < TARGET:
                missed = True
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")
    if missed:
        print(f"target missed: 2 balanced stages on 2 processes < {TARGET}x")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
