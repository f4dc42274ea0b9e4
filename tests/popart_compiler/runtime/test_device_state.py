"""popart_compiler/runtime/device_state.py: device dtypes, the device RNG and the
device copies of weights (replica-grouped ones with their group dimension)."""
import pytest
import torch
import torch.nn as nn

from popart_compiler import compiler
from popart_compiler.enums import CommGroupType, VariableRetrievalMode
from popart_compiler.errors import Error
from popart_compiler.ir import Graph
from popart_compiler.runtime.device_state import DeviceRng, DeviceWeights, device_dtype
from popart_compiler.session_options import ReplicaGrouping, SessionOptions


def test_64_bit_host_types_have_32_bit_device_types():
    assert device_dtype(torch.float64) is torch.float32
    assert device_dtype(torch.int64) is torch.int32
    assert device_dtype(torch.float16) is torch.float16


def test_the_device_rng_is_independent_of_the_hosts():
    rng = DeviceRng(seed=7, device="cpu")
    torch.manual_seed(123)
    with rng.active():
        first = torch.rand(3)
    host = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(host, torch.rand(3))  # the device run drew nothing from the host
    torch.manual_seed(7)
    assert torch.equal(first, torch.rand(3))  # seed 7's first draws
    with rng.active():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the device stream continues


def test_rng_state_round_trips_and_other_processes_draw_other_numbers():
    rng = DeviceRng(seed=5, device="cpu")
    with rng.active():
        torch.rand(2)
    saved = rng.to_list()
    assert saved[0] == 5
    with rng.active():
        expected = torch.rand(4)
    rng.from_list(saved)
    with rng.active():
        assert torch.equal(torch.rand(4), expected)
    other = DeviceRng(seed=5, device="cpu", stream=1)
    with other.active():
        assert not torch.equal(torch.rand(4), expected)
    with pytest.raises(Error, match="Invalid RNG state"):
        rng.check([])
    with pytest.raises(Error, match="Invalid RNG state"):
        rng.check([1, 2, 3])


def _exe(**options):
    torch.manual_seed(0)
    model = nn.Linear(2, 3).double()
    graph = Graph(torch.export.export(model, (torch.randn(1, 2, dtype=torch.float64),),
                                      strict=False))
    return model, compiler.compile(graph, SessionOptions(**options), False)


def test_device_copies_are_float32_copies_of_the_weights():
    model, exe = _exe()
    weights = DeviceWeights(exe, "cpu")
    assert weights.names == ["weight", "bias"]
    w = weights.read("weight")
    assert w.dtype is torch.float32
    torch.testing.assert_close(w, model.weight.float())
    weights.params[0].data.fill_(1.0)
    assert model.weight.dtype is torch.float64 and not torch.all(model.weight == 1.0)


def test_a_replica_grouped_weight_has_one_value_per_group():
    grouping = ReplicaGrouping(CommGroupType.Orthogonal, 2, VariableRetrievalMode.OnePerGroup)
    _, exe = _exe(replication_factor=4, replica_groupings={"weight": grouping})
    weights = DeviceWeights(exe, "cpu")
    assert weights.params[0].shape == (2, 3, 2)  # R / shards = 2 groups
    assert weights.replica_groups() == {"weight": [0, 1, 0, 1]}
    values = torch.stack([torch.full((3, 2), 1.0), torch.full((3, 2), 2.0)])
    weights.write({"weight": values})
    assert weights.state(2)[0].eq(1.0).all() and weights.state(3)[0].eq(2.0).all()
    with pytest.raises(Error, match="Cannot write per-replica weight weight: shape"):
        weights.write({"weight": torch.zeros(3, 3, 2)})
