"""One process of the pipeline-across-processes tests (issue 24), also imported by
them for the single-process reference runs.

Usage: ``python pipeline_worker.py <scenario> <out_dir>`` with ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` in the environment. Each process
writes ``<out_dir>/rank<i>.pt`` (results) or ``<out_dir>/rank<i>.txt`` (an error
message).
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import poptorch
import processes

VOCAB, WIDTH, TOKENS, BATCH = 10, 8, 3, 2
CALLS = 2

#: Training configurations run with 2 processes (2 stages) and compared with one
#: process: optimizer, device iterations, gradient accumulation, local replicas,
#: output mode, a head tied to the embedding (stages 0 and 1), BatchNorm (buffers);
#: the SGD ones clip the gradient norm.
CONFIGS = {
    "sgd_bn": dict(stages=2, opt="sgd", d=2, a=3, r=1, mode="All", bn=True),
    "adam_sum_replicas_tied": dict(stages=2, opt="adam", d=2, a=3, r=2, mode="Final",
                                   sum=True, tied=True),
    "lamb_running_tied": dict(stages=2, opt="lamb", d=1, a=4, r=1, mode="Sum",
                                   running=True, tied=True),
    "sgd_combined_every2": dict(stages=2, opt="sgd_combined", d=4, a=3, r=1,
                                mode="EveryN"),
}
#: Run with 4 processes: 4 stages (tied weight on stages 0 and 3), and 2 stages × 2
#: data-parallel pipelines (compared with 1 process × 2 replicas).
CONFIGS_4 = {
    "four_stages_adam_tied": dict(stages=4, opt="adam", d=1, a=7, r=1, mode="All",
                                  tied=True),
    "two_stages_two_pipelines": dict(stages=2, opt="sgd", d=2, a=3, r=2, mode="All",
                                     pipelines=2),
}


class Blocks(nn.Module):
    """An embedding, ``stages`` linear blocks (block ``k`` on IPU ``k``), optionally a
    BatchNorm, a head (optionally tied to the embedding) and a cross-entropy loss.
    The embedding output skips to the last stage and a boolean mask made in stage 0
    is used in the last stage: both cross every stage boundary."""

    def __init__(self, stages, tied=False, bn=False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(stages)])
        self.bn = nn.BatchNorm1d(WIDTH) if bn else None
        self.head = nn.Linear(WIDTH, VOCAB)
        if tied:
            self.head.weight = self.emb.weight
        for k, block in enumerate(self.blocks):
            poptorch.BeginBlock(block, f"block{k}", ipu_id=k)

    def forward(self, tokens, target):
        e = self.emb(tokens).sum(1)
        keep = tokens[:, 0] > 4
        h = e
        for block in self.blocks:
            h = torch.tanh(block(h))
        if self.bn is not None:
            h = self.bn(h)
        h = h + e * keep.unsqueeze(1).to(h.dtype)
        logits = self.head(h)
        return logits, F.cross_entropy(logits, target)


def _optimizer(kind, model):
    """The optimizer ``kind``; the SGD ones clip the global gradient norm (every
    stage's gradients count)."""
    if kind == "sgd":
        return poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                  weight_decay=0.01, max_grad_norm=0.5)
    if kind == "sgd_combined":
        return poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5,
                                  use_combined_accum=True, max_grad_norm=0.5)
    if kind == "adam":
        return poptorch.optim.Adam(model.parameters(), lr=0.01)
    return poptorch.optim.LAMB(model.parameters(), lr=0.01)


def options(cfg, pipeline, world=1, rank=0):
    """The options of ``cfg``: pipelined over ``world`` processes, or one process
    with every pipeline's replicas."""
    pipelines = cfg.get("pipelines", 1)
    opts = poptorch.Options().deviceIterations(cfg["d"])
    opts.Training.gradientAccumulation(cfg["a"])
    opts.outputMode(getattr(poptorch.OutputMode, cfg["mode"]), 2)
    if cfg.get("sum"):
        opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
    if cfg.get("running"):
        opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
            poptorch.MeanReductionStrategy.Running)
    if pipeline:
        opts.replicationFactor(cfg["r"] // pipelines)
        opts.Distributed.configureProcessId(rank, world)
        opts.Distributed.pipelineAcrossProcesses(stages=cfg["stages"])
    else:
        opts.replicationFactor(cfg["r"])
        opts.Distributed.disable()
    return opts


def global_data(cfg, call):
    """Inputs of one call for every replica: ``[D, A, R, B, ...]``."""
    gen = torch.Generator().manual_seed(1000 + call)
    shape = (cfg["d"], cfg["a"], cfg["r"], BATCH)
    return (torch.randint(0, VOCAB, (*shape, TOKENS), generator=gen),
            torch.randint(0, VOCAB, shape, generator=gen))


def replica_slice(t, replica, pipelines):
    """Pipeline ``replica``'s part of a ``[D, A, R, ...]`` tensor in the combined
    batch layout (docs/semantics.md S-13)."""
    r = t.shape[2] // pipelines
    return t[:, :, replica * r:(replica + 1) * r].reshape(-1, *t.shape[4:])


def train(cfg, pipeline, world=1, rank=0):
    """Train ``CALLS`` calls; returns the outputs, the weights and the optimizer state.
    Process ``p`` initialises its model from seed ``100 + p``: only the broadcast from
    process 0 makes the processes agree."""
    pipelines = cfg.get("pipelines", 1)
    replica = rank // cfg["stages"] if pipeline else 0
    torch.manual_seed(100 + rank)
    model = Blocks(cfg["stages"], cfg.get("tied", False), cfg.get("bn", False))
    optimizer = _optimizer(cfg["opt"], model)
    training = poptorch.trainingModel(model, options(cfg, pipeline, world, rank), optimizer)
    outputs = []
    for call in range(CALLS):
        tokens, target = global_data(cfg, call)
        if pipeline:
            tokens, target = (replica_slice(t, replica, pipelines) for t in (tokens, target))
        else:
            tokens, target = (t.reshape(-1, *t.shape[4:]) for t in (tokens, target))
        outputs.append([t.clone() for t in training(tokens, target)])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ipu_state = {k: v.clone() for k, v in optimizer.state_dict().get("ipu_state", {}).items()}
    training.destroy()
    return outputs, state, ipu_state


def _scenario_configs(rank, world, configs):
    return {name: train(cfg, True, world, rank) for name, cfg in configs.items()}


def _scenario_host(rank, world, out_dir):
    """Host weight sync in one process only (a checkpoint saved by process 0 while
    process 1 goes on), a checkpoint reloaded into a new model in every process, and
    inference after training; every process writes its results."""
    cfg = CONFIGS["sgd_bn"]
    torch.manual_seed(100)
    model = Blocks(2, bn=True)
    optimizer = _optimizer("sgd", model)
    training = poptorch.trainingModel(model, options(cfg, True, world, rank), optimizer)
    calls = []
    for call in range(3):
        tokens, target = (t.reshape(-1, *t.shape[4:]) for t in global_data(cfg, call))
        calls.append((tokens, target))
    training(*calls[0])
    exported = os.path.join(out_dir, f"model{rank}.poptorch")
    training.save(exported)  # this process's executable, weights and optimizer state
    path = os.path.join(out_dir, "checkpoint.pt")
    if rank == 0:  # implicit reads of every stage's weights, in this process only
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   path)
    training(*calls[1])
    if rank == 1:  # an explicit copy, in this process only
        training.copyWeightsToHost()
    dist.barrier()  # the checkpoint is written
    training.destroy()
    after_two = {k: v.clone() for k, v in model.state_dict().items()}
    # a new model from the checkpoint (after 1 call), trained for the 2nd and 3rd call
    checkpoint = torch.load(path, weights_only=False)
    model2 = Blocks(2, bn=True)
    model2.load_state_dict(checkpoint["model"])
    optimizer2 = _optimizer("sgd", model2)
    optimizer2.load_state_dict(checkpoint["optimizer"])
    training2 = poptorch.trainingModel(model2, options(cfg, True, world, rank), optimizer2)
    training2(*calls[1])
    resumed_two = {k: v.clone() for k, v in model2.state_dict().items()}
    training2(*calls[2])
    resumed_three = {k: v.clone() for k, v in model2.state_dict().items()}
    model2.eval()
    inference = _inference(model2, *calls[0], True, world, rank)
    training2.destroy()
    # the executable saved after 1 call, loaded with poptorch.load, runs the 2nd call
    loaded = poptorch.load(exported)
    loaded(*calls[1])
    loaded_two = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    loaded.destroy()
    return {"after_two": after_two, "resumed_two": resumed_two,
            "resumed_three": resumed_three, "loaded_two": loaded_two,
            "inference": inference}


def host_reference():
    """:func:`_scenario_host` in one process."""
    cfg = CONFIGS["sgd_bn"]
    torch.manual_seed(100)
    model = Blocks(2, bn=True)
    training = poptorch.trainingModel(model, options(cfg, False),
                                      _optimizer("sgd", model))
    states = []
    for call in range(3):
        training(*(t.reshape(-1, *t.shape[4:]) for t in global_data(cfg, call)))
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    training.destroy()
    model.eval()
    tokens, target = (t.reshape(-1, *t.shape[4:]) for t in global_data(cfg, 0))
    return {"after_two": states[1], "resumed_two": states[1], "resumed_three": states[2],
            "loaded_two": states[1], "inference": _inference(model, tokens, target, False)}


def _inference(model, tokens, target, pipeline, world=1, rank=0):
    """Inference on 4 samples with 2 device iterations, output modes All and Sum:
    ``{mode: (logits, loss)}``."""
    results = {}
    for mode in ("All", "Sum"):
        opts = poptorch.Options().deviceIterations(2).outputMode(
            getattr(poptorch.OutputMode, mode))
        if pipeline:
            opts.Distributed.configureProcessId(rank, world)
            opts.Distributed.pipelineAcrossProcesses()
        else:
            opts.Distributed.disable()
        inference = poptorch.inferenceModel(model, opts)
        results[mode] = inference(tokens[:4], target[:4])
        inference.destroy()
    return results


def _timed_error(fn):
    """Run ``fn``: ``"<seconds>s Error: <message>"`` of the ``poptorch.Error`` it
    raises, else ``"no error"``."""
    start = time.monotonic()
    try:
        fn()
    except poptorch.Error as e:
        return f"{time.monotonic() - start:.1f}s {type(e).__name__}: {e}"
    return "no error"


def _scenario_fault(rank, world, fault, out_dir):
    """Stage 1 fails at its second call (raises, or dies), or ends its script
    normally after its first call ("mismatched_calls": each process saves its
    executable after the first call); stage 0 reports what it saw and how long it
    took."""
    cfg = dict(CONFIGS["sgd_bn"], bn=False)
    torch.manual_seed(1)
    model = Blocks(2)
    training = poptorch.trainingModel(model, options(cfg, True, world, rank),
                                      _optimizer("sgd", model))
    tokens, target = (t.reshape(-1, *t.shape[4:]) for t in global_data(cfg, 0))
    training(tokens, target)
    if fault == "mismatched_calls":
        training.save(os.path.join(out_dir, f"model{rank}.poptorch"))
    if rank == 1:
        if fault == "raise":
            raise RuntimeError("stage 1 failed on purpose")
        if fault == "die":
            os._exit(3)
        if fault == "exit":  # catches its error and exits with status 1
            try:
                raise RuntimeError("stage 1 failed on purpose")
            except RuntimeError:
                sys.exit(1)
        return None
    return _timed_error(lambda: [training(tokens, target) for _ in range(3)])


def _scenario_inference_in_process_0(rank, world):
    """Only process 0 builds and runs a pipelined inference model; process 1 ends its
    script at once (never joins the run)."""
    if rank != 0:
        return None
    torch.manual_seed(1)
    opts = poptorch.Options().deviceIterations(2)
    opts.Distributed.pipelineAcrossProcesses()
    tokens, target = (t.reshape(-1, *t.shape[4:])[:4]
                      for t in global_data(CONFIGS["sgd_bn"], 0))
    return _timed_error(lambda: poptorch.inferenceModel(Blocks(2), opts)(tokens, target))


def _scenario_never_join(rank, world, out_dir):
    """Process 1 stays alive without joining the run until process 0 wrote its result;
    process 0 reports how long it waited to join (from the start of the join)."""
    if rank != 0:
        deadline = time.monotonic() + 600
        while not os.path.exists(os.path.join(out_dir, "rank0.txt")) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        return None
    from popart_compiler.runtime import rendezvous
    started, join = [], rendezvous.join

    def timed_join(*args):
        started.append(time.monotonic())
        return join(*args)

    rendezvous.join = timed_join
    message = _scenario_inference_in_process_0(rank, world)
    return f"{time.monotonic() - started[0]:.1f}s joining; {message}"


def main(argv):
    scenario, out_dir = argv[1], argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if scenario == "train":
        result = _scenario_configs(rank, world, CONFIGS)
        result["host"] = _scenario_host(rank, world, out_dir)
    elif scenario == "pinned":  # POPTORCH_PIPELINE_PIN_CORES=1 in the environment
        result = _scenario_configs(rank, world, {"sgd_bn": CONFIGS["sgd_bn"]})
        result["affinity"] = sorted(os.sched_getaffinity(0))
        result["thread_affinities"] = sorted(
            {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})
    elif scenario == "train4":
        result = _scenario_configs(rank, world, CONFIGS_4)
    elif scenario == "inference_in_process_0":
        result = _scenario_inference_in_process_0(rank, world)
    elif scenario == "never_join":
        result = _scenario_never_join(rank, world, out_dir)
    else:
        result = _scenario_fault(rank, world, scenario, out_dir)
    processes.write_result(out_dir, rank, result)


if __name__ == "__main__":
    main(sys.argv)
