"""Replica-grouped weights (docs/semantics.md S-27, docs/api-sections.md api §5.22): the proxy
returned for a direct parameter of the wrapped model, the compile-time check of the grouped weights'
shapes and the capture-time slicing of grouped weights."""
from __future__ import annotations

import contextlib
from typing import Any, Dict

import torch

from popart_compiler.errors import backend_error, py_error
from poptorch import enums
from poptorch._executor import instrument

__all__ = ["ReplicaGroupingProxy", "one_replica_slices", "check_per_replica_params"]


class ReplicaGroupingProxy:
    """What ``executor.<name>`` returns for a parameter that is a direct attribute of
    the model (docs/api-sections.md api §5.22): attribute reads go to the parameter;
        ``replicaGrouping``
    declares a replica-grouped weight (docs/semantics.md S-27). Not itself a tensor."""

    def __init__(self, executor: Any, name: str, param: torch.nn.Parameter):
        object.__setattr__(self, "_executor", executor)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_param", param)

    def __getattr__(self, attr: str):
        return getattr(self._param, attr)

    def __repr__(self) -> str:
        return repr(self._param)

    def replicaGrouping(self, comm_group_type: enums.CommGroupType, shards: int,
                        variable_retrieval_mode: enums.VariableRetrievalMode) -> None:
        """Give this weight one value per replica group (docs/semantics.md S-27). Call before
        compiling.

        Args:
            comm_group_type: ``Consecutive`` / ``Orthogonal`` (groups of ``shards``
                replicas), ``All`` (one group) or ``NoGrouping`` (one per replica).
            shards: replicas per group.
            variable_retrieval_mode: ``OnePerGroup`` (the host tensor holds one value
                per group, stacked on dimension 0) or ``AllReplicas`` (reading back
                gives one value per replica).

        Raises:
            AssertionError: arguments of the wrong type.
            poptorch.Error: the model is already compiled.
        """
        if not isinstance(comm_group_type, enums.CommGroupType):
            raise AssertionError("comm_group_type must be a poptorch.CommGroupType")
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise AssertionError("shards must be a positive integer")
        if not isinstance(variable_retrieval_mode, enums.VariableRetrievalMode):
            raise AssertionError("variable_retrieval_mode must be a "
                                 "poptorch.VariableRetrievalMode")
        if self._executor.isCompiled():
            raise py_error(f"replicaGrouping of {self._name} must be called before the model "
                           "is compiled.")
        self._executor.per_replica_params[self._name] = (
            comm_group_type, shards, variable_retrieval_mode)


@contextlib.contextmanager
def one_replica_slices(model: torch.nn.Module, groupings: Dict[str, Any]):
    """Capture replica-grouped weights with the shape of one group's slice
    (docs/semantics.md S-27)."""
    swapped = []
    with instrument.syncing():
        for name in groupings:
            param = model._parameters[name]
            swapped.append((param, param.data))
            param.data = param.data[0]
    try:
        yield
    finally:
        with instrument.syncing():
            for param, data in swapped:
                param.data = data


def check_per_replica_params(model: torch.nn.Module, sess_opts: Any) -> None:
    """docs/semantics.md S-27: replica-grouped weights hold one value per group on dimension 0.

    Raises:
        poptorch.Error: a scalar weight, a grouping that does not fit the
            replication factor, or a leading dimension that is not the number of
            groups (or of replicas, for ``AllReplicas``).
    """
    replicas = sess_opts.global_replicas  # groups span all processes (docs/semantics.md S-28)
    with instrument.syncing():
        params = dict(model._parameters)
    for name, grouping in sess_opts.replica_groupings.items():
        param = params.get(name)
        if param is None:
            raise py_error(f"{name} is not a parameter of the model: replicaGrouping "
                           "only applies to direct parameters of the wrapped module.")
        if param.dim() == 0:
            raise backend_error("Scalars cannot be passed as per-replica weight tensor "
                                "values")
        grouping.validate(name, replicas)
        groups = grouping.num_groups(replicas)
        allowed = {groups} | ({replicas} if grouping.retrieval_mode == 2 else set())
        if param.shape[0] not in allowed:
            processes = (f" × {sess_opts.num_processes} processes"
                         if sess_opts.num_processes > 1 else "")
            raise backend_error(
                f"Per-replica weight {name} has shape {list(param.shape)}: with "
                f"replicationFactor {sess_opts.replication_factor}{processes} and this "
                "grouping its dimension 0 must be the number of replica groups "
                f"({groups}), one value per group.")
