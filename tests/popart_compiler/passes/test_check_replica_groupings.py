"""``check_replica_groupings`` (passes/checks.py): replica-grouped weights are
parameters whose grouping fits the replicas (docs/semantics.md S-27)."""
import pytest
import torch

from models import MLP, export
from popart_compiler.enums import CommGroupType
from popart_compiler.errors import Error
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.checks import check_replica_groupings
from popart_compiler.session_options import ReplicaGrouping, SessionOptions


def options(groupings, replicas=4, processes=1):
    return SessionOptions(replication_factor=replicas, num_processes=processes,
                          replica_groupings=groupings)


@pytest.mark.parametrize("grouping,replicas,processes", [
    (ReplicaGrouping(CommGroupType.Consecutive, 2), 4, 1),
    (ReplicaGrouping(CommGroupType.Orthogonal, 2), 2, 2),  # 4 global replicas
    (ReplicaGrouping(CommGroupType.All, 3), 4, 1),  # shards ignored
    (ReplicaGrouping(CommGroupType.NoGrouping, 0), 4, 1),
])
def test_groupings_that_fit(run_pass, grouping, replicas, processes):
    g = export(MLP(), torch.randn(2, 4))
    before = g.module.code
    result = run_pass(check_replica_groupings, g,
                      Compilation(options({"fc1.weight": grouping}, replicas, processes),
                                  True))
    assert result.graph is g and result.changed is False and g.module.code == before


@pytest.mark.parametrize("name,grouping,message", [
    ("fc3.weight", ReplicaGrouping(CommGroupType.Consecutive, 2),
     "Per-replica weight fc3.weight is not a parameter of the graph"),
    ("fc1.bias", ReplicaGrouping(CommGroupType.Consecutive, 3),
     r"Per-replica weight fc1\.bias: the replication factor \(4\) must be a multiple of "
     r"the group size \(shards=3\)"),
    ("fc1.bias", ReplicaGrouping(CommGroupType.Orthogonal, 0),
     r"the replication factor \(4\) must be a multiple of the group size \(shards=0\)"),
    ("fc1.bias", ReplicaGrouping(7, 2), "Invalid CommGroupType 7 for per-replica weight "
     "fc1.bias"),
    ("fc1.bias", ReplicaGrouping(CommGroupType.All, 1, 5),
     "Invalid VariableRetrievalMode 5 for per-replica weight fc1.bias"),
])
def test_groupings_that_do_not_fit(name, grouping, message):
    g = export(MLP(), torch.randn(2, 4))
    with pytest.raises(Error, match=message):
        check_replica_groupings(g, Compilation(options({name: grouping}), True))
