"""``SessionOptions`` (popart_compiler/session_options.py): the backend's validation of
option dictionaries (docs/api-sections.md options §4.6) and replica groupings
(docs/semantics.md S-27)."""
import pytest
import torch

from popart_compiler.errors import Error
from popart_compiler.session_options import ReplicaGrouping, SessionOptions


def test_session_options_validation():
    opts = SessionOptions.from_dict({"device_iterations": 4, "output_mode": 2,
                                     "enableStochasticRounding": True,
                                     "engineOptions": {"a": "b"}})
    assert opts.device_iterations == 4 and opts.batch_factor == 4
    with pytest.raises(Error, match="Unknown bool option notAnOption"):
        SessionOptions.from_dict({"notAnOption": True})
    with pytest.raises(Error, match="Unknown uint64 option enableStableNorm"):
        SessionOptions.from_dict({"enableStableNorm": 3})
    with pytest.raises(Error, match="Unknown value type <class 'torch.Tensor'> for option x"):
        SessionOptions.from_dict({"x": torch.ones(1)})
    with pytest.raises(Error, match="Value for VirtualGraphMode out of range"):
        SessionOptions.from_dict({"virtualGraphMode": 9})


def test_replica_grouping_layouts():
    assert ReplicaGrouping(1, 2).groups(8) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert ReplicaGrouping(2, 2).groups(8) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert ReplicaGrouping(0, 8).groups(4) == [0, 0, 0, 0]
    assert ReplicaGrouping(3, 1).groups(3) == [0, 1, 2]
    assert ReplicaGrouping(2, 2).num_groups(8) == 4
    with pytest.raises(Error, match="multiple of the group size"):
        ReplicaGrouping(1, 3).validate("w", 8)
