"""popart_compiler/cost/matmul_shapes.py: the products of captured matmuls and
convolutions, and the products of their backward."""
import torch
import torch.nn as nn

from popart_compiler.cost.matmul_plan import MatmulProblem
from popart_compiler.cost.matmul_shapes import Product, backward_problems
from popart_compiler.cost.op_costs import collect
from popart_compiler.ir import Graph


def _products(module, *inputs):
    graph = Graph(torch.export.export(module, inputs, strict=False))
    return [p for op in collect(graph).ops for p in op.products]


def test_a_linear_is_one_rows_by_depth_by_cols_product():
    (p,) = _products(nn.Linear(8, 16), torch.randn(4, 8))
    assert (p.problem.groups, p.problem.rows, p.problem.depth, p.problem.cols) == \
        (1, 4, 8, 16)
    assert not p.problem.half and p.repeat == 1


def test_a_batched_matmul_has_one_group_per_batch():
    class Bmm(nn.Module):
        def forward(self, a, b):
            return a @ b
    (p,) = _products(Bmm(), torch.randn(3, 4, 5), torch.randn(3, 5, 6))
    assert (p.problem.groups, p.problem.rows, p.problem.depth, p.problem.cols) == \
        (3, 4, 5, 6)


def test_a_convolution_reduces_over_channels_times_kernel_positions():
    (p,) = _products(nn.Conv2d(3, 8, 3, bias=False), torch.randn(2, 3, 6, 6))
    # rows: batch × output positions (2 × 4 × 4); depth: 3 channels × 9 positions
    assert (p.problem.rows, p.problem.depth, p.problem.cols, p.problem.kernel) == \
        (32, 27, 8, 9)


def test_backward_problems_are_the_two_operand_gradients():
    forward = MatmulProblem(1, rows=4, depth=8, cols=16)
    left, right = backward_problems(Product(forward))
    assert (left.rows, left.depth, left.cols) == (4, 16, 8)  # dC @ Bᵀ
    assert (right.rows, right.depth, right.cols) == (8, 4, 16)  # Aᵀ @ dC
    assert left.macs == right.macs == forward.macs
    only = backward_problems(Product(forward, grad_rows=False))
    assert [(q.rows, q.depth) for q in only] == [(8, 4)]
