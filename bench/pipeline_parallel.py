#!/usr/bin/env python3
"""Pipeline across processes (``Options.Distributed.pipelineAcrossProcesses``, issues
24 and 33) against the single-process run of the same pipelined model, side by side in
one run: training samples/s and CPU time, where each stage's time goes, and the
pipeline efficiency measured against the IPU Model's estimate for the same schedule.

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
best (the machine may be shared). Printed per model:

* the load average at the start (``os.getloadavg``; the wall-clock target is judged
  only below 1) and at the end;
* samples/s of each side and their ratio (S processes / 1 process), and the CPU-time
  ratio beside it: CPU time per sample (``time.process_time``: the process and its
  gloo threads) of the single process over that of the busiest stage process. CPU
  time depends less on the other load than wall-clock time (not at all on waiting
  for a core; still on caches and memory bandwidth shared with whatever else runs),
  so that ratio is what the wall-clock ratio approaches on idle cores if no stage
  waited;
* per stage: milliseconds per micro-batch of compute (forward, backward, gradient
  hand-over), send/recv (posting messages, packing), waiting (for a peer's
  activations or gradients), weight update, the outputs' broadcast, and host reads of
  the other stages' state (``--read-every K``: ``copyWeightsToHost`` every ``K``
  calls; none by default: a call that reads nothing moves no weights), with the bytes
  moved; and CPU ms per micro-batch of the main thread (and of its compute spans:
  ``ScheduleStats.compute_cpu_s``) and of the other threads (gloo's TCP loops: they
  read the messages and poll their sockets), in all and one by one (each thread's
  CPU-time clock, named as ``/proc/self/task`` names it); the stages' compute CPU
  summed, over the
  single process's whole CPU time per micro-batch (1.00x: the stages compute no
  slower than the single process);
* with ``--corun``: the CPU time per sample of ``S`` single-process runs at once,
  over one run alone: what sharing the caches and memory bandwidth costs any
  ``S`` processes (a floor under the busiest stage's CPU time that no schedule
  removes);
* the IPU Model's estimate for the same schedule: ``pipeline_efficiency`` of
  ``ipuModelEstimate()`` and its speed-up over running the stages one after another.

Targets (issue 33): 2 balanced stages on 2 processes: CPU-time ratio ≥ 1.8× and, on an
idle machine (load < 1 at the start), wall-clock ratio ≥ 1.7×; 4 stages of the small
BERT on 4 processes: CPU-time ratio ≥ 3.2× (4 processes on a 2-core machine cannot
reach more than 2× in wall-clock). The exit status is 1 if a target that was judged is
missed. Only the CPU (gloo) path is measured here; the CUDA (NCCL) path needs a GPU.

Usage (each target alone, a few minutes each)::

    python bench/pipeline_parallel.py --models mlp --stages 2 --repeats 3   # 2 MLP stages
    python bench/pipeline_parallel.py --models bert --stages 4 --repeats 2  # 4 BERT stages
    python bench/pipeline_parallel.py                    # mlp and bert, 2 and 4 stages
    python bench/pipeline_parallel.py --models mlp --stages 2 --read-every 1
                                                         # the cost of a host read per call
    python bench/pipeline_parallel.py --models mlp --stages 2 --repeats 3 --pin
                                      # each process on a core of its own (both sides)
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

#: (model, stages) → (CPU-time ratio, wall-clock ratio judged below load 1, or None)
TARGETS = {("mlp", 2): (1.8, 1.7), ("bert", 4): (3.2, None)}
IDLE_LOAD = 1.0
WORKER_TIMEOUT_S = 900
#: Per-stage figures printed in ms per micro-batch (ScheduleStats fields).
PHASES = (("compute", "compute_s"), ("send/recv", "transfer_s"), ("waiting", "wait_s"),
          ("update", "update_s"), ("outputs", "outputs_s"), ("host reads", "read_s"))


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


def _thread_clock(tid: int) -> int:
    """Linux's CPU-time clock of thread ``tid`` of this process (``clock_gettime``'s
    clock id ``MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)``: nanosecond resolution)."""
    return ((~tid) << 3) | 6


def _task_cpu() -> dict:
    """CPU seconds of each thread of this process by thread id, with its name:
    ``{tid: [name, seconds]}`` (names from ``/proc/self/task``; times from each
    thread's CPU-time clock, or where that fails from ``/proc``'s clock ticks, 10 ms
    on most kernels); ``{}`` where there is no ``/proc``."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                text = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()
        try:
            seconds = time.clock_gettime(_thread_clock(int(tid)))
        except (OSError, OverflowError, AttributeError):
            seconds = (int(fields[11]) + int(fields[12])) / tick
        out[tid] = [text[text.index("(") + 1:text.rindex(")")], seconds]
    return out


def _other_threads(before: dict, after: dict) -> list:
    """``[[name, seconds], ...]``: the CPU time each thread other than the main one
    took between two :func:`_task_cpu` readings, busiest first (threads that took
    none left out)."""
    main = str(os.getpid())
    out = [[name, seconds - before.get(tid, [name, 0.0])[1]]
           for tid, (name, seconds) in after.items() if tid != main]
    return sorted((t for t in out if t[1] > 0), key=lambda t: -t[1])


def _train(kind: str, stages: int, width: int, d: int, a: int, calls: int,
           pipelined: bool, read_every: int = 0) -> dict:
    """One side, in this process: samples, seconds, CPU seconds (all threads, main
    thread), the IPU Model's estimate (single process) or where the stage's time
    went (pipelined)."""
    import dataclasses

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
    session = training._state.session
    before = dataclasses.asdict(session.schedule_stats) if pipelined else {}
    reads_before = dataclasses.asdict(session.state_stats) if pipelined else {}
    tasks = _task_cpu()
    start, cpu, main_cpu = time.perf_counter(), time.process_time(), time.thread_time()
    for call in range(calls):
        training(*inputs)
        if pipelined and read_every and (call + 1) % read_every == 0:
            training.copyWeightsToHost()
    seconds = time.perf_counter() - start
    result = {"samples": calls * batch * d * a, "seconds": seconds,
              "cpu_s": time.process_time() - cpu, "main_cpu_s": time.thread_time() - main_cpu,
              "micro_batches": calls * d * a, "threads": _other_threads(tasks, _task_cpu())}
    if pipelined:
        stats = {k: v - before[k] for k, v in dataclasses.asdict(session.schedule_stats).items()}
        reads = {k: v - reads_before[k]
                 for k, v in dataclasses.asdict(session.state_stats).items()}
        stats.update(read_s=reads["seconds"], read_bytes=reads["bytes_received"],
                     served_bytes=reads["bytes_sent"], stage=session.stage)
        result["stats"] = stats
    else:
        cycles = training.ipuModelEstimate()["cycles"]
        # the same micro-batches with the stages one after another
        work = sum(sum(w["cycles"] for w in step["work"]) * step["repeat"]
                   for step in cycles["schedule"])
        result.update(efficiency=cycles["pipeline_efficiency"],
                      speedup=work / cycles["pipeline"] if cycles["pipeline"] else 1.0)
    training.destroy()
    return result


def _pin(index: int) -> int:
    """Pin every thread of this process (and so the threads it starts later, gloo's
    included) to one core: the ``index``-th (modulo their number) of the cores this
    process may run on. Returns that core.

    Raises:
        OSError: the system refused the affinity.
    """
    cores = sorted(os.sched_getaffinity(0))
    core = cores[index % len(cores)]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return core


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, argv: list, independent: bool = False) -> list:
    """Run this script's worker in ``world`` processes (``world = 1``: the single
    process run; ``independent``: ``world`` single-process runs at once); returns each
    process's result."""
    port = str(_free_port())
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ, RANK="0" if independent else str(rank), BENCH_INDEX=str(rank),
                       WORLD_SIZE="1" if independent else str(world),
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


def _by_thread(threads: list, micro_batches: int) -> str:
    """`` (gloo_tcp_loop 0.30, gloo_tcp_loop 0.10)``: the other threads' CPU ms per
    micro-batch one by one (those above 0.005), ``""`` if none."""
    parts = [f"{name} {1e3 * s / micro_batches:.2f}" for name, s in threads
             if 1e3 * s / micro_batches >= 0.005]
    return f" ({', '.join(parts)})" if parts else ""


def _stage_lines(multi: list, single_cpu: float) -> list:
    """Where each stage's time went, in ms per micro-batch; ``single_cpu``: the single
    process's CPU seconds per micro-batch (all stages)."""
    lines = []
    compute = 0.0
    for m in sorted(multi, key=lambda r: r["stats"]["stage"]):
        st, n = m["stats"], m["micro_batches"]
        phases = ", ".join(f"{name} {1e3 * st[key] / n:.3f}" for name, key in PHASES)
        other = m["cpu_s"] - m["main_cpu_s"]
        compute += st["compute_cpu_s"] / n
        lines.append(
            f"    stage {st['stage']}: {phases} ms/micro-batch (wall); CPU "
            f"{1e3 * m['cpu_s'] / n:.3f} ms/micro-batch = main thread "
            f"{1e3 * m['main_cpu_s'] / n:.3f} (compute {1e3 * st['compute_cpu_s'] / n:.3f}) "
            f"+ other threads (gloo's) {1e3 * other / n:.3f}{_by_thread(m['threads'], n)}; "
            f"{st['messages'] / n:.1f} messages, {st['bytes_sent'] / n / 1024:.1f} KiB sent "
            f"per micro-batch; host reads moved {st['read_bytes'] / 2 ** 20:.1f} MiB in, "
            f"{st['served_bytes'] / 2 ** 20:.1f} MiB out")
    lines.append(f"    the stages' compute CPU summed: {1e3 * compute:.3f} ms/micro-batch = "
                 f"{compute / single_cpu:.2f}x the 1 process's whole CPU time per "
                 f"micro-batch ({1e3 * single_cpu:.3f} ms)")
    return lines


def _measure(kind: str, stages: int, args) -> dict:
    """Both sides, interleaved ``--repeats`` times: each side's best."""
    common = ["--kind", kind, "--stages", str(stages), "--width", str(args.width),
              "--device-iterations", str(args.device_iterations),
              "--accumulation", str(args.accumulation), "--calls", str(args.calls),
              "--read-every", str(args.read_every)] + (["--pin"] if args.pin else [])
    best = {"single_rate": 0.0, "multi_rate": 0.0, "single_cpu": float("inf"),
            "multi_cpu": float("inf"), "estimate": None, "multi": None,
            "corun_cpu": float("inf")}
    for _ in range(args.repeats):
        single = _launch(1, common)[0]
        best["single_rate"] = max(best["single_rate"], single["samples"] / single["seconds"])
        best["single_cpu"] = min(best["single_cpu"], single["cpu_s"] / single["samples"])
        best["estimate"] = single
        multi = _launch(stages, common + ["--pipelined"])
        best["multi_rate"] = max(best["multi_rate"], multi[0]["samples"] /
                                 max(m["seconds"] for m in multi))
        cpu = max(m["cpu_s"] for m in multi) / multi[0]["samples"]
        if cpu < best["multi_cpu"]:
            best["multi_cpu"], best["multi"] = cpu, multi
        if args.corun:
            runs = _launch(stages, common, independent=True)
            best["corun_cpu"] = min(best["corun_cpu"],
                                    max(r["cpu_s"] / r["samples"] for r in runs))
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Targets (issue 33)"):],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,bert", help="mlp, bert (comma-separated)")
    parser.add_argument("--stages", default="2,4", help="pipeline stages = processes")
    parser.add_argument("--width", type=int, default=768, help="MLP width")
    parser.add_argument("--device-iterations", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=16,
                        help="gradientAccumulation: micro-batches per weight update")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per side")
    parser.add_argument("--repeats", type=int, default=2,
                        help="interleaved repeats of both sides (each side's best kept)")
    parser.add_argument("--read-every", type=int, default=0,
                        help="copyWeightsToHost every K calls in the pipelined side "
                        "(0: no host reads)")
    parser.add_argument("--corun", action="store_true",
                        help="also run S single-process runs at once: the CPU time per "
                        "sample when S processes share the machine's caches and memory")
    parser.add_argument("--pin", action="store_true",
                        help="pin each process (all its threads) to one core of its own: "
                        "process k of a launch to the k-th core it may run on (the "
                        "pipelined side by POPTORCH_PIPELINE_PIN_CORES=1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--pipelined", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if args.pin and args.pipelined:  # the product pins its stage processes
            os.environ["POPTORCH_PIPELINE_PIN_CORES"] = "1"
        elif args.pin:
            _pin(int(os.environ.get("BENCH_INDEX", "0")))
        print(json.dumps(_train(args.kind, int(args.stages), args.width,
                                args.device_iterations, args.accumulation, args.calls,
                                args.pipelined, args.read_every)))
        return 0
    load = os.getloadavg()[0]
    print(f"load average at start: {load:.2f} (1 min), {os.cpu_count()} cores; "
          f"D={args.device_iterations}, A={args.accumulation}, {args.calls} timed calls, "
          f"best of {args.repeats}; 1 torch thread per process"
          + ("; each process pinned to a core of its own" if args.pin else ""))
    missed = []
    for kind in args.models.split(","):
        for stages in (int(s) for s in args.stages.split(",")):
            best = _measure(kind, stages, args)
            ratio = best["multi_rate"] / best["single_rate"]
            cpu_ratio = best["single_cpu"] / best["multi_cpu"]
            estimate = best["estimate"]
            name = f"{kind}, {stages} stages" + (f" (width {args.width})"
                                                 if kind == "mlp" else "")
            print(f"{name}: 1 process {best['single_rate']:8.1f} samples/s | {stages} "
                  f"processes {best['multi_rate']:8.1f} samples/s | wall-clock ratio "
                  f"{ratio:.2f}x | CPU-time ratio {cpu_ratio:.2f}x (CPU ms per sample: 1 "
                  f"process {1e3 * best['single_cpu']:.3f}, busiest stage "
                  f"{1e3 * best['multi_cpu']:.3f})")
            print(f"  efficiency measured {ratio / stages:.2f} (wall), "
                  f"{cpu_ratio / stages:.2f} (CPU); IPU Model pipeline efficiency "
                  f"{estimate['efficiency']:.2f} (speed-up over sequential stages "
                  f"{estimate['speedup']:.2f}x)")
            single_mb = best["single_cpu"] * best["multi"][0]["samples"] / \
                best["multi"][0]["micro_batches"]
            print("\n".join(_stage_lines(best["multi"], single_mb)))
            if args.corun:
                print(f"  {stages} single-process runs at once: CPU ms per sample "
                      f"{1e3 * best['corun_cpu']:.3f} (the slowest; "
                      f"{best['corun_cpu'] / best['single_cpu']:.2f}x one run alone): the "
                      "co-running cost that no schedule removes")
            cpu_target, wall_target = TARGETS.get((kind, stages), (None, None))
            if cpu_target is not None and cpu_ratio < cpu_target:
                missed.append(f"{name}: CPU-time ratio {cpu_ratio:.2f}x < {cpu_target}x")
            if wall_target is not None:
                if load >= IDLE_LOAD:
                    print(f"  wall-clock target {wall_target}x not judged: load {load:.2f} "
                          f">= {IDLE_LOAD} at the start")
                elif ratio < wall_target:
                    missed.append(f"{name}: wall-clock ratio {ratio:.2f}x < {wall_target}x")
    print(f"load average at end: {os.getloadavg()[0]:.2f} (1 min)")
    for line in missed:
        print(f"target missed: {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
