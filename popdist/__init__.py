"""PopDist on ``torch.distributed``: the parts of Graphcore's PopDist API that PopTorch
scripts use, for processes started by ``poprun`` (:mod:`popdist.poprun`) or
``torchrun`` (docs/semantics.md S-28).

Each process ("instance") drives ``getNumLocalReplicas()`` replicas; the global
replicas of instance ``i`` are ``[getReplicaIndexOffset(), getReplicaIndexOffset() +
getNumLocalReplicas())``. The values come from the launcher's environment:

* ``RANK`` / ``WORLD_SIZE`` (``torchrun``, ``poprun``) or ``OMPI_COMM_WORLD_RANK`` /
  ``OMPI_COMM_WORLD_SIZE`` (``mpirun``): instance index and count;
* ``POPDIST_NUM_TOTAL_REPLICAS``, ``POPDIST_NUM_IPUS_PER_REPLICA`` (set by
  ``poprun --num-replicas / --ipus-per-replica``): without them, one replica per
  instance and one IPU per replica.

Typical use, unchanged from PopDist::

    import popdist, popdist.poptorch
    if popdist.isPopdistEnvSet():
        popdist.init()
    opts = popdist.poptorch.Options()      # replicas and process id configured
    model = poptorch.trainingModel(model, opts, optimizer)
"""
from __future__ import annotations

import os

__all__ = ["init", "isPopdistEnvSet", "isUsingPopdist", "getInstanceIndex",
           "getNumInstances", "getNumLocalReplicas", "getNumTotalReplicas",
           "getReplicaIndexOffset", "getNumIpusPerReplica"]

#: Variables ``poprun`` sets for its instances.
TOTAL_REPLICAS_ENV = "POPDIST_NUM_TOTAL_REPLICAS"
IPUS_PER_REPLICA_ENV = "POPDIST_NUM_IPUS_PER_REPLICA"


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"Environment variable {name}={value!r} is not an "
                                 "integer") from None
    return default


def isPopdistEnvSet() -> bool:
    """Whether this process was started by a distributed launcher (``poprun``,
    ``torchrun`` or ``mpirun``)."""
    return any(os.environ.get(name, "").strip() for name in (
        "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", TOTAL_REPLICAS_ENV))


def isUsingPopdist() -> bool:
    """Alias of :func:`isPopdistEnvSet` (both exist in PopDist)."""
    return isPopdistEnvSet()


def getInstanceIndex() -> int:
    """Index of this process: ``RANK`` (or ``OMPI_COMM_WORLD_RANK``), default 0."""
    return _env_int("RANK", "OMPI_COMM_WORLD_RANK", default=0)


def getNumInstances() -> int:
    """Number of processes: ``WORLD_SIZE`` (or ``OMPI_COMM_WORLD_SIZE``), default 1."""
    return _env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", default=1)


def getNumTotalReplicas() -> int:
    """Replicas of all instances: ``POPDIST_NUM_TOTAL_REPLICAS``, default one per
    instance.

    Raises:
        ValueError: the count is not a positive multiple of the number of instances.
    """
    instances = getNumInstances()
    total = _env_int(TOTAL_REPLICAS_ENV, default=instances)
    if total < 1 or total % instances:
        raise ValueError(f"{TOTAL_REPLICAS_ENV}={total} must be a positive multiple of "
                         f"the number of instances ({instances}).")
    return total


def getNumLocalReplicas() -> int:
    """Replicas driven by this process: total replicas / instances."""
    return getNumTotalReplicas() // getNumInstances()


def getReplicaIndexOffset() -> int:
    """Global index of this process's first replica."""
    return getInstanceIndex() * getNumLocalReplicas()


def getNumIpusPerReplica() -> int:
    """IPUs per replica: ``POPDIST_NUM_IPUS_PER_REPLICA``, default 1."""
    return _env_int(IPUS_PER_REPLICA_ENV, default=1)


def init() -> None:
    """Join the other instances: initialise the ``torch.distributed`` process group
    (gloo) now, if there is more than one instance and no group yet, so that the
    script may use ``torch.distributed`` collectives of its own. PopTorch joins the
    same group on its own at the first training compile, so calling this is optional.

    Raises:
        poptorch.Error: the rendezvous failed or timed out (``POPTORCH_DISTRIBUTED_TIMEOUT``).
    """
    if getNumInstances() > 1:
        from popart_compiler.runtime import collectives
        collectives.process_group(getInstanceIndex(), getNumInstances(), "cpu")
