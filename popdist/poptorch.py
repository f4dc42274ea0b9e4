"""``popdist.poptorch.Options``: PopTorch options configured for this instance."""
from __future__ import annotations

import os
from typing import Optional

import poptorch as _poptorch

import popdist

__all__ = ["Options"]


class Options(_poptorch.Options):
    """``poptorch.Options`` with ``replicationFactor(popdist.getNumLocalReplicas())``
    and ``Distributed.configureProcessId(popdist.getInstanceIndex(),
    popdist.getNumInstances())`` already applied (PopDist behaviour).

    Args:
        ipus_per_replica: IPUs each replica uses (informational on the IPU Model);
            defaults to ``popdist.getNumIpusPerReplica()``.

    Raises:
        ValueError: ``ipus_per_replica`` differs from the launcher's
            ``--ipus-per-replica``, or the environment is inconsistent.
    """

    def __init__(self, ipus_per_replica: Optional[int] = None):
        super().__init__()
        launcher = popdist.getNumIpusPerReplica()
        if ipus_per_replica is not None and os.environ.get(popdist.IPUS_PER_REPLICA_ENV) \
                and int(ipus_per_replica) != launcher:
            raise ValueError(f"ipus_per_replica={ipus_per_replica} differs from the "
                             f"launcher's --ipus-per-replica {launcher}.")
        self._ipus_per_replica = int(ipus_per_replica or launcher)
        self.replicationFactor(popdist.getNumLocalReplicas())
        self.Distributed.configureProcessId(popdist.getInstanceIndex(),
                                            popdist.getNumInstances())

    @property
    def ipus_per_replica(self) -> int:
        """IPUs per replica."""
        return self._ipus_per_replica
