"""One process of the multi-process tests (docs/semantics.md S-28), also imported by them for the
single-process reference runs.

Usage: ``python distributed_worker.py <scenario> <out_dir>`` with ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` in the environment (set by the test
or by ``torch.distributed.run``). Each process writes ``<out_dir>/rank<i>.pt`` (tensors)
or ``<out_dir>/rank<i>.txt`` (an error message).
"""
import os
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
import processes

#: Training configurations compared against one process with all the replicas:
#: global replicas, device iterations, gradient accumulation, optimizer, reduction.
CONFIGS = {
    "sgd": dict(replicas=4, d=2, a=2, opt="sgd", mean=True),
    "adam_sum": dict(replicas=2, d=2, a=3, opt="adam", mean=False),
    "lamb_running": dict(replicas=4, d=1, a=2, opt="lamb", mean=True, running=True),
    "sgd_combined": dict(replicas=2, d=1, a=2, opt="sgd_combined", mean=True),
    "grouped": dict(replicas=4, d=1, a=2, opt="sgd", mean=True, grouped=True),
}
CALLS = 2
BATCH = 2


class Net(nn.Module):
    """Two linear layers and a cross-entropy loss; optionally a per-group bias ``W``
    (replica-grouped weight, docs/semantics.md S-27)."""

    def __init__(self, groups: int = 0):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        if groups:
            self.W = nn.Parameter(torch.randn(groups, 3))

    def forward(self, x, t):
        h = self.fc2(torch.relu(self.fc1(x)))
        if hasattr(self, "W"):
            h = h + self.W
        return h, F.cross_entropy(h, t)


def _optimizer(kind, model):
    if kind == "sgd":
        return poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "sgd_combined":
        return poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5,
                                  use_combined_accum=True)
    if kind == "adam":
        return poptorch.optim.Adam(model.parameters(), lr=0.01)
    return poptorch.optim.LAMB(model.parameters(), lr=0.01)


def global_data(cfg, call):
    """Inputs of one call for all replicas: ``[D, A, R_total, B, ...]``."""
    gen = torch.Generator().manual_seed(1000 + call)
    shape = (cfg["d"], cfg["a"], cfg["replicas"], BATCH)
    return torch.randn(*shape, 4, generator=gen), torch.randint(0, 3, shape, generator=gen)


def local_slice(t, process_id, num_processes):
    """This process's replicas of a ``[D, A, R_total, ...]`` tensor, flattened into the
    combined batch layout (docs/semantics.md S-13)."""
    r = t.shape[2] // num_processes
    part = t[:, :, process_id * r:(process_id + 1) * r]
    return part.reshape(-1, *t.shape[4:])


def train(cfg, process_id, num_processes):
    """Train ``CALLS`` calls; returns the outputs of every call and the final weights.
    Process ``p`` initialises its model from seed ``100 + p``: only the broadcast from
    process 0 makes the processes agree."""
    local = cfg["replicas"] // num_processes
    groups = cfg["replicas"] // 2 if cfg.get("grouped") else 0
    torch.manual_seed(100 + process_id)
    model = Net(groups)
    opts = poptorch.Options().replicationFactor(local).deviceIterations(cfg["d"])
    opts.Training.gradientAccumulation(cfg["a"])
    opts.Distributed.configureProcessId(process_id, num_processes)
    opts.outputMode(poptorch.OutputMode.All)
    if not cfg["mean"]:
        opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
    if cfg.get("running"):
        opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
            poptorch.MeanReductionStrategy.Running)
    training = poptorch.trainingModel(model, opts, _optimizer(cfg["opt"], model))
    if groups:
        training.W.replicaGrouping(poptorch.CommGroupType.Orthogonal, 2,
                                   poptorch.VariableRetrievalMode.OnePerGroup)
    outputs = []
    for call in range(CALLS):
        x, t = global_data(cfg, call)
        h, loss = training(local_slice(x, process_id, num_processes),
                           local_slice(t, process_id, num_processes))
        outputs.append((h.clone(), loss.clone()))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    stats = None
    session = training._state.session
    if session.process_group is not None:
        stats = dict(session.process_group.stats)
    training.destroy()
    return outputs, state, stats


def _scenario_train(rank, world):
    results = {}
    for name, cfg in CONFIGS.items():
        outputs, state, stats = train(cfg, rank, world)
        results[name] = {"outputs": outputs, "state": state,
                         "calls": stats["all_reduce_calls"]}
    return results


def _scenario_inference(rank, world):
    """DataLoader partitioning (docs/api-sections.md api §7) and independent inference per
    process."""
    torch.manual_seed(5)
    model = nn.Linear(4, 2)
    opts = poptorch.Options().replicationFactor(2).deviceIterations(2)
    dataset = torch.utils.data.TensorDataset(torch.arange(64.).reshape(16, 4))
    loader = poptorch.DataLoader(opts, dataset, batch_size=1)
    inference = poptorch.inferenceModel(model, opts)
    outs, ins = [], []
    for (x,) in loader:
        ins.append(x)
        outs.append(inference(x).clone())
    return {"inputs": torch.cat(ins), "outputs": torch.cat(outs),
            "weight": model.weight.detach(), "bias": model.bias.detach()}


def _fault_model(world, rank, accumulation=1, batch=BATCH):
    torch.manual_seed(1)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(accumulation)
    model = Net()
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(
        model.parameters(), lr=0.1))
    x = torch.randn(batch * accumulation, 4)
    t = torch.zeros(batch * accumulation, dtype=torch.long)
    return training, x, t


def _scenario_fault(rank, world, fault):
    """One process fails at its second call (process 1; process 0 for ``raise0``,
    which hosts the rendezvous store); the other reports what it saw."""
    if fault == "exit_own_group":  # the script's own process group (PopTorch reuses it)
        torch.distributed.init_process_group("gloo")
    training, x, t = _fault_model(world, rank)
    try:
        training(x, t)
    except poptorch.Error as e:  # e.g. "hang" with a short timeout on a loaded machine
        return f"first call failed: {e}"
    if rank == (0 if fault == "raise0" else 1):
        if fault in ("raise", "raise0"):
            raise RuntimeError(f"process {rank} failed on purpose")
        if fault == "interrupt":
            raise KeyboardInterrupt
        if fault in ("exit", "exit_own_group"):  # catches its error, exits with status 1
            try:
                raise RuntimeError(f"process {rank} failed on purpose")
            except RuntimeError:
                sys.exit(1)
        if fault == "die":
            os._exit(3)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # "hang": never reaches the weight update (killed by the test)
    start = time.monotonic()
    try:
        training(x, t)
    except poptorch.Error as e:
        return f"{time.monotonic() - start:.1f}s {type(e).__name__}: {e}"
    return "no error"


class _BatchNormNet(Net):
    """:class:`Net` with a BatchNorm between its layers (buffers updated in place)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x, t):
        h = self.fc2(torch.relu(self.bn(self.fc1(x))))
        return h, F.cross_entropy(h, t)


def _scenario_buffers(rank, world):
    """One local replica per process, a model that updates buffers: trains."""
    torch.manual_seed(1)
    model = _BatchNormNet()
    training = poptorch.trainingModel(model, poptorch.Options(),
                                      poptorch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(10 + rank)
    training(torch.randn(4, 4), torch.zeros(4, dtype=torch.long))
    training.copyWeightsToHost()
    return f"trained: running_mean {model.bn.running_mean.tolist()}"


def _scenario_mismatch(rank, world):
    """Process 1 uses another gradient accumulation and micro-batch size. The script
    creates the process group itself: PopTorch reuses it."""
    torch.distributed.init_process_group("gloo")
    training, x, t = _fault_model(world, rank, accumulation=1 + rank, batch=2 + rank)
    try:
        training(x, t)
    except poptorch.Error as e:
        return f"{type(e).__name__}: {e}"
    finally:  # the script's own group: it leaves the run itself, as a script should
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return "no error"


def main(argv):
    scenario, out_dir = argv[1], argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if scenario == "train":
        result = _scenario_train(rank, world)
    elif scenario == "inference":
        result = _scenario_inference(rank, world)
    elif scenario == "mismatch":
        result = _scenario_mismatch(rank, world)
    elif scenario == "buffers":
        result = _scenario_buffers(rank, world)
    else:
        result = _scenario_fault(rank, world, scenario)
    processes.write_result(out_dir, rank, result)


if __name__ == "__main__":
    main(sys.argv)
