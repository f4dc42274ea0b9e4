"""The processes of a pipeline run across processes, and the gradient sums between
them (:mod:`popart_compiler.runtime.pipeline`).

``W`` processes run ``W / P`` replicas of a pipeline of ``P`` stages: a 2-D
``DeviceMesh`` (``"dp"`` × ``"pp"``), process ``r`` running stage ``r mod P`` of
replica ``r div P`` (a pipeline's processes are consecutive, so ``torchrun
--nproc-per-node P`` puts a pipeline on one host). Each process updates the parameters
its stage reads (PopART runs a weight's update on the IPU of its consumer); a
parameter read by several stages (*tied*, e.g. BERT's word embedding and its masked-LM
decoder) is updated identically in each of them, from one gradient sum.

:class:`GradientSharing` makes those sums: the parameters read by the same set ``S``
of stages are summed over the processes ``{replica × P + s : s ∈ S}`` of all replicas,
one flat ``all_reduce`` per set (none for a set of one stage without data parallelism).
Everything goes through ``torch.distributed`` groups, guarded by
:meth:`~popart_compiler.runtime.collectives.ProcessGroup.guard` so that a failed peer
fails the others fast, naming it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from popart_compiler.errors import backend_error
from popart_compiler.runtime.collectives import ProcessGroup

__all__ = ["PipelineMesh", "GradientSharing"]

#: Groups already created, by their global ranks: every process creates the same
#: groups in the same order (``new_group`` is collective), once per run.
_GROUPS: Dict[Tuple[Tuple[int, ...], Optional[str]], Any] = {}
_MESHES: Dict[Tuple[int, int], Any] = {}


def _group(ranks: Sequence[int], backend: Optional[str] = None):
    """The ``torch.distributed`` group of ``ranks`` (created at first use; every
    process of the run must ask for the same groups in the same order); ``backend``:
    a group of its own on that backend (the run's by default)."""
    key = (tuple(sorted(ranks)), backend)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key[0]), backend=backend)
    return _GROUPS[key]


class PipelineMesh:
    """This process's place among ``replicas × stages`` processes.

    Args:
        group: the run's process group (its size ``W`` is all processes).
        stages: ``P``, processes per pipeline replica.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per process).

    Attributes:
        stage: this process's stage (``rank mod P``).
        replica: this process's pipeline replica (``rank div P``).
        replicas: ``W / P``.
        pp_group: the processes of this process's pipeline (the stages' P2P group).
        grad_group: the same processes as ``pp_group`` on connections of their own,
            for the gradients flowing back: on the CPU each direction of a boundary
            then has its own gloo connection, so that gloo's thread reading one
            direction finds its connection locked less often while this process
            writes the other (it polls its socket meanwhile; docs/multi-ipu.md).
        dp_group: the processes running this stage in every replica.
        state_group: a gloo group of this pipeline's processes of its own, on which
            host reads receive the other stages' state
            (:mod:`~popart_compiler.runtime.pipeline_service`; never mixed with the
            activations, and answered from another thread than the stage loop's).

    Raises:
        Error: ``W`` is not a multiple of ``P``.
    """

    def __init__(self, group: ProcessGroup, stages: int, device: str):
        self.group = group
        self.stages = stages
        if group.size % stages:
            raise backend_error(
                f"This pipeline has {stages} stages, so the number of processes must be "
                f"a multiple of {stages} (one process per stage, times the data-parallel "
                f"replicas), but {group.size} were started.")
        self.replicas = group.size // stages
        self.stage = group.rank % stages
        self.replica = group.rank // stages
        key = (group.size, stages)
        if key not in _MESHES:
            device_type = "cuda" if str(device).startswith("cuda") else "cpu"
            mesh = group.guard("creation of the pipeline's device mesh",
                               lambda: init_device_mesh(device_type, (self.replicas, stages),
                                                        mesh_dim_names=("dp", "pp")))
            # a state group per replica, created in the same order everywhere
            state = [group.guard("creation of the pipeline's groups",
                                 lambda d=d: _group(range(d * stages, (d + 1) * stages),
                                                    backend="gloo"))
                     for d in range(self.replicas)]
            # a gradient group per replica: the backward direction on connections of
            # its own (see the attribute)
            grads = [group.guard("creation of the pipeline's groups",
                                 lambda d=d: _group(range(d * stages, (d + 1) * stages)))
                     for d in range(self.replicas)]
            _MESHES[key] = (mesh, state, grads)
        self.mesh, state, grads = _MESHES[key]
        self.pp_group = self.mesh.get_group("pp")
        self.grad_group = grads[self.replica]
        self.dp_group = self.mesh.get_group("dp")
        self.state_group = state[self.replica]

    def rank_of(self, stage: int, replica: Optional[int] = None) -> int:
        """The global rank running ``stage`` of ``replica`` (default: this one)."""
        return (self.replica if replica is None else replica) * self.stages + stage


class GradientSharing:
    """Sums of gradients over the processes that hold each parameter, and what a
    weight update needs from every stage (installed as
    ``StepSettings.sharing`` of the :class:`~popart_compiler.optim.device_optimizer.
    DeviceOptimizer`).

    Args:
        mesh: this process's place in the run.
        names: the optimizer's parameter names (all the model's parameters).
        readers: for each name, the stages that read it (empty: none).
        shapes: for each name, the shape of its gradient.
    """

    def __init__(self, mesh: PipelineMesh, names: Sequence[str],
                 readers: Dict[str, List[int]], shapes: Dict[str, torch.Size]):
        self.mesh = mesh
        self.names = list(names)
        self.readers = readers
        self.shapes = shapes
        sets: Dict[Tuple[int, ...], List[str]] = {}
        for name in self.names:
            stages = tuple(readers.get(name, ()))
            if stages:
                sets.setdefault(stages, []).append(name)
        #: (group or None, names) of each set this stage belongs to; the groups of
        #: every set are created by every process (collective), in sorted order
        self.plan: List[Tuple[Any, List[str]]] = []
        for stages in sorted(sets):
            ranks = [mesh.rank_of(s, d) for d in range(mesh.replicas) for s in stages]
            group = None
            if len(ranks) > 1:
                group = mesh.group.guard("creation of the gradient groups",
                                         lambda ranks=ranks: _group(ranks))
            if mesh.stage in stages:
                self.plan.append((group, sets[stages]))
        #: canonical owner of each parameter: the first stage that reads it
        self.owner = {n: r[0] for n, r in readers.items() if r}

    def sum(self, names: Sequence[str], tensors: Sequence[Optional[torch.Tensor]]
            ) -> List[Optional[torch.Tensor]]:
        """Sum each parameter's gradient over the processes that hold it.

        Args:
            names: the parameters of ``tensors``.
            tensors: this process's (float32) gradient of each, ``None`` where it has
                none.

        Returns:
            The sums, ``None`` where no process had a gradient.

        Raises:
            Error: a peer failed or timed out.
        """
        given = dict(zip(names, tensors))
        out = dict(given)
        for group, members in self.plan:
            if group is None:
                continue
            parts, present = [], []
            for name in members:
                t = given.get(name)
                present.append(0.0 if t is None else 1.0)
                parts.append(torch.zeros(self.shapes[name], dtype=torch.float32)
                             if t is None else t.detach().float())
            device = parts[0].device if parts else "cpu"
            summed = self.mesh.group.all_reduce_sum(
                [p.to(device) for p in parts] + [torch.tensor(present, device=device)],
                group=group)
            flags = summed.pop()
            for name, t, flag in zip(members, summed, flags.tolist()):
                if name in out:
                    out[name] = t if flag > 0 else None
        return [out[n] for n in names]

    def sum_statistics(self, counts: torch.Tensor) -> torch.Tensor:
        """Sum automatic-loss-scaling statistics over every process of the run (all
        of them take the same scaling decision)."""
        return self.mesh.group.all_reduce_sum([counts])[0]

    def norms(self, norms: Sequence[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """Every parameter's gradient norm, from the stage that owns it.

        Args:
            norms: for each of :attr:`names`, this process's norm (a 0-d tensor) or
                ``None``; only the owner's counts.

        Returns:
            For each of :attr:`names`, its norm (``None``: no gradient), identical in
            every stage: the global clipping norm is computed from them in order.
        """
        values, present = [], []
        for name, norm in zip(self.names, norms):
            mine = self.owner.get(name) == self.mesh.stage and norm is not None
            values.append(float(norm) if mine else 0.0)
            present.append(1.0 if mine else 0.0)
        t = torch.tensor(values + present, dtype=torch.float32)
        if self.mesh.stages > 1:
            t = self.mesh.group.all_reduce_sum([t], group=self.mesh.pp_group)[0]
        n = len(self.names)
        return [t[i] if t[n + i] > 0 else None for i in range(n)]

