"""One of 4 processes (2 pipeline replicas × 2 stages, gloo) for the pipeline mesh and
state service tests: ``python pipeline_worker.py RANK PORT``. Prints one JSON line
with what this process saw."""
import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

from popart_compiler.runtime import pipeline_service
from popart_compiler.runtime.pipeline_mesh import GradientSharing, PipelineMesh
from popart_compiler.runtime.pipeline_state import StateProvider

WORLD, STAGES = 4, 2


class Group:
    """What these modules use of ``collectives.ProcessGroup``, on the default group."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.exit_hooks, self.owned = rank, size, [], True

    def guard(self, what, fn):
        return fn()

    def all_reduce_sum(self, tensors, group=None):
        out = [t.clone() for t in tensors]
        for t in out:
            dist.all_reduce(t, group=group)
        return out

    def name(self, rank=None):
        return f"process {self.rank if rank is None else rank}"


def main(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    group = Group(rank, WORLD)
    mesh = PipelineMesh(group, STAGES, "cpu")
    seen = {"stage": mesh.stage, "replica": mesh.replica, "replicas": mesh.replicas,
            "rank_of": [mesh.rank_of(s) for s in range(STAGES)],
            "grad_group": dist.get_process_group_ranks(mesh.grad_group),
            "grad_group_own": mesh.grad_group not in (mesh.pp_group, mesh.state_group)}
    # "tied" is read by both stages, "a" by stage 0, "b" by stage 1
    readers = {"tied": [0, 1], "a": [0], "b": [1]}
    sharing = GradientSharing(mesh, ["tied", "a", "b"], readers,
                              {n: torch.Size([2]) for n in readers})
    grads = {"tied": torch.full((2,), rank + 1.0),
             "a": None if rank == 0 else torch.full((2,), 10.0 * (rank + 1)),
             "b": torch.full((2,), 100.0 * (rank + 1))}
    mine = [n for n in readers if mesh.stage in readers[n]]
    summed = sharing.sum(mine, [grads[n] for n in mine])
    seen["sums"] = {n: None if t is None else t.tolist() for n, t in zip(mine, summed)}
    norms = sharing.norms([torch.tensor(rank + 0.5)] * 3)
    seen["norms"] = [None if t is None else float(t) for t in norms]
    # each stage owns one weight; the other stage's copy is fetched from its owner
    owned = [{"weights": [torch.zeros(3)], "buffers": [], "optimizer": []}
             for _ in range(STAGES)]
    owned[mesh.stage]["weights"][0].fill_(rank + 1.0)
    provider = StateProvider(0, owned, mesh.stage, lambda s: f"pipeline stage {s}")
    service = pipeline_service.service(group)
    service.register(provider, mesh.state_group)
    other = 1 - mesh.stage
    fetched = {}
    pipeline_service.fetch(provider, mesh, mesh.state_group, [(other, "weights")], fetched)
    seen["fetched"] = owned[other]["weights"][0].tolist()
    seen["fetched_versions"] = [[list(k), [v.runs, v.writes]] for k, v in fetched.items()]
    dist.barrier()
    # the answer thread counts a read once its sends returned: wait for it (a hang
    # guard only, never a speed assumption)
    deadline = time.monotonic() + 60
    while service.stats.served < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    seen["stats"] = [service.stats.reads, service.stats.served, service.stats.bytes_received]
    service._on_exit("leaving")
    dist.destroy_process_group()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
