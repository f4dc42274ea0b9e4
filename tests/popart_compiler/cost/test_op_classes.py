"""Op classes of the cycle estimate (popart_compiler/cost/op_classes.py): compute sets
per class, grouped / depthwise / 1-D convolutions from shapes, the replicas'
all-reduce."""
import pytest
import torch
import torch.nn as nn

from popart_compiler.cost import cycle_model, op_classes, op_costs
from popart_compiler.cost.ipu_model import TARGETS
from popart_compiler.cost.memory_model import MemorySettings
from popart_compiler.ir import Graph


def _op(name, **kw):
    return op_costs.OpCost(name=name, op=name, **kw)


@pytest.mark.parametrize("op,kind,sets", [
    ("relu", op_classes.POINTWISE, 1), ("sum", op_classes.REDUCTION, 2),
    ("nll_loss_nd", op_classes.REDUCTION, 2), ("layer_norm", op_classes.NORMALISATION, 4),
    ("group_norm", op_classes.NORMALISATION, 4), ("log_softmax", op_classes.SOFTMAX, 4),
    ("embedding", op_classes.GATHER, 2), ("index_select", op_classes.GATHER, 2)])
def test_each_class_runs_its_compute_sets(op, kind, sets):
    cost = _op(op)
    assert op_classes.op_class(cost) == kind
    assert op_classes.compute_sets(cost) == sets


def test_views_run_nothing_and_products_three_sets_each():
    assert op_classes.compute_sets(_op("view", view=True)) == 0
    target = TARGETS["ipu2"]
    memory = MemorySettings()
    view = _op("transpose", view=True)
    assert cycle_model.op_forward_cycles(view, target, memory) == 0


def _conv_costs(module, x):
    return op_costs.collect(Graph(torch.export.export(module, (x,))))


@pytest.mark.parametrize("groups", [1, 4, 64])
def test_grouped_and_depthwise_convolutions_are_planned_per_group(groups):
    conv = nn.Conv2d(64, 64, 3, padding=1, groups=groups)
    costs = _conv_costs(conv, torch.randn(2, 64, 16, 16))
    (op,) = [o for o in costs.ops if o.products]
    (product,) = op.products
    p = product.problem
    assert p.groups == groups
    assert p.depth == (64 // groups) * 9 and p.cols == 64 // groups
    assert p.rows == 2 * 16 * 16


def test_strided_1d_convolutions_have_their_output_positions():
    conv = nn.Conv1d(8, 16, 5, stride=2)
    costs = _conv_costs(conv, torch.randn(4, 8, 101))
    (op,) = [o for o in costs.ops if o.products]
    p = op.products[0].problem
    assert p.rows == 4 * 49 and p.depth == 8 * 5 and p.cols == 16 and p.kernel == 5


def test_the_all_reduce_runs_at_the_ring_s_link_bandwidth():
    target = TARGETS["ipu2"]
    per_cycle = cycle_model.allreduce_bytes_per_cycle(target, 4)
    assert per_cycle * target.clock_hz == pytest.approx(
        target.ipu_link_bytes_per_s / cycle_model.LINKS_PER_IPU * cycle_model.RING_LINKS)
