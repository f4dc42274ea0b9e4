"""How the gradients of one weight update are combined: the settings a
:class:`~popart_compiler.optim.device_optimizer.DeviceOptimizer` steps with, built by
the training session from the session options (accumulation, replicas, reduction, loss
scaling) and, in multi-process runs, the cross-process sums."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = ["StepSettings"]


@dataclasses.dataclass
class StepSettings:
    """How the gradients of one weight update are combined (docs/semantics.md S-41, S-27, S-57).

    Attributes:
        accumulation: ``A``, micro-batches per weight update.
        replicas: ``R``, local replicas.
        global_replicas: ``R_total`` (the ``Mean`` divisor is ``A × R_total``).
        mean: ``ReductionType.Mean`` (else ``Sum``).
        running: ``MeanReductionStrategy.Running`` (else ``Post``).
        replica_groups: parameter name → group index of each replica, for
            replica-grouped weights whose device tensor has a leading group dimension.
        auto_loss_scaling: automatic loss scaling (docs/semantics.md S-57).
        als_update_period: weight updates between two adjustments of the factor.
        als_threshold: proportion of float16 gradient elements in the top histogram
            bin above which the factor is halved.
        als_bin_edge: lower edge of the top bin as a fraction of the float16 maximum.
        foreach: update all the weights of a group with ``torch._foreach_*`` kernels
            (the inductor backend) instead of one weight at a time; same arithmetic.
        all_reduce: in a multi-process run (docs/semantics.md S-28), sums a list of tensors over the
            processes (``collectives.ProcessGroup.all_reduce_sum``); called once per
            weight update with the gradients summed over the local replicas (and the
            automatic loss scaling statistics). ``None``: a single process.
        sharing: a pipeline run across processes: each process holds the parameters
            of its stage, and ``sharing``
            (:class:`~popart_compiler.runtime.pipeline_mesh.GradientSharing`) sums each
            parameter's gradient over the processes that hold it (``sum(names,
            tensors)``), the automatic loss scaling statistics over all processes
            (``sum_statistics``) and gathers every parameter's gradient norm for
            clipping (``norms``). Replaces ``all_reduce``.
    """
    accumulation: int = 1
    replicas: int = 1
    global_replicas: int = 1
    mean: bool = True
    running: bool = False
    replica_groups: Dict[str, List[int]] = dataclasses.field(default_factory=dict)
    auto_loss_scaling: bool = False
    als_update_period: int = 1
    als_threshold: float = 1e-7
    als_bin_edge: float = 0.125
    foreach: bool = False
    all_reduce: Optional[Callable[[List[torch.Tensor]], List[torch.Tensor]]] = None
    sharing: Any = None
