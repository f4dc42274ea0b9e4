"""popart_compiler/cost/op_costs.py: per-op bytes and FLOPs of a captured program,
weights, stage merging and layer placement."""
import pytest
import torch
import torch.nn as nn

from popart_compiler.cost.op_costs import collect, merge_stages
from popart_compiler.errors import Error
from popart_compiler.ir import Graph


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 4)])

    def forward(self, x):
        return self.layers[1](torch.relu(self.layers[0](x)))


def _costs(**kwargs):
    torch.manual_seed(0)
    graph = Graph(torch.export.export(Two(), (torch.randn(2, 8),), strict=False))
    return collect(graph, **kwargs)


def test_linear_costs_have_their_bytes_and_flops():
    costs = _costs()
    linears = [op for op in costs.ops if op.flops]
    assert [op.flops for op in linears] == [2 * 2 * 8 * 16, 2 * 2 * 16 * 4]
    assert [op.out_bytes for op in linears] == [2 * 16 * 4, 2 * 4 * 4]
    assert all(len(op.products) == 1 for op in linears)
    relu = next(op for op in costs.ops if op.op.startswith("relu"))
    assert relu.out_bytes == 2 * 16 * 4 and relu.flops == 0 and relu.vector_ops == 32
    assert (costs.input_bytes, costs.output_bytes) == (2 * 8 * 4, 2 * 4 * 4)


def test_weights_are_costed_once_each():
    costs = _costs()
    assert sorted((w.name, w.elements, w.bytes) for w in costs.weights) == [
        ("layers.0.bias", 16, 64), ("layers.0.weight", 128, 512),
        ("layers.1.bias", 4, 16), ("layers.1.weight", 64, 256)]
    assert all(w.trainable and w.itemsize == 4 and w.ipus == (0,) for w in costs.weights)
    assert costs.num_ipus == 1 and costs.stages == [(0, 0)]


def test_layers_per_ipu_places_the_layers():
    costs = _costs(layers_per_ipu=[1, 1])
    assert costs.num_ipus == 2
    assert {op.ipu for op in costs.ops if op.flops} == {0, 1}
    with pytest.raises(Error):
        _costs(layers_per_ipu=[1, 1, 1])


def test_consecutive_stages_on_one_ipu_merge():
    assert merge_stages([(0, 0), (1, 0), (2, 1), (3, 0)]) == {
        (0, 0): 0, (1, 0): 0, (2, 1): 1, (3, 0): 2}
    assert merge_stages([(1, 1), (0, 0), (1, 1)]) == {(0, 0): 0, (1, 1): 1}
