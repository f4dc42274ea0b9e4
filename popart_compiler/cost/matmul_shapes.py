"""The matrix products inside an fx node: the shapes :mod:`.matmul_plan` plans.

A linear layer, ``mm`` / ``addmm`` / ``matmul`` / ``bmm`` / ``baddbmm``, a
convolution (``convolution``, ``conv1d`` … ``conv3d``), attention
(``scaled_dot_product_attention``: two batched products) and the
``serialized_matmul`` steering op (docs/api-sections.md api §8: the product split into ``factor``
serial slices along the rows, the depth or the columns) become one or more :class:`Product`\\ s read
from the fake tensors of ``node.meta["val"]``. Backward products follow from the forward ones
(:func:`backward_problems`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Collection, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from popart_compiler.ir import _aliased_base, _op_name
from popart_compiler.cost.matmul_plan import MatmulProblem

__all__ = ["Product", "products", "backward_problems"]

#: ``serialized_matmul`` mode → the dimension its factor splits (docs/api-sections.md api §8).
_SERIAL_DIM = {"InputChannels": "rows", "ReducingDim": "depth", "OutputChannels": "cols"}


@dataclasses.dataclass(frozen=True)
class Product:
    """One product of a node, with what its backward needs.

    Attributes:
        problem: the forward product (one serial slice of a serialised matmul).
        repeat: serial slices (``serialized_matmul``'s factor; 1 otherwise).
        grad_rows: the left operand needs a gradient (it depends on a trainable weight).
        grad_cols: the right operand needs a gradient (a trainable weight, or an
            activation that depends on one).
    """
    problem: MatmulProblem
    repeat: int = 1
    grad_rows: bool = True
    grad_cols: bool = True


def _shape(node) -> Optional[torch.Size]:
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    return val.shape if isinstance(val, torch.Tensor) else None


def _prod(values: Sequence[int]) -> int:
    return int(math.prod(int(v) for v in values))


def _matmul(a: torch.Size, b: torch.Size) -> Optional[Tuple[int, int, int, int]]:
    """``(groups, rows, depth, cols)`` of ``torch.matmul(a, b)`` (broadcasting)."""
    if len(a) == 0 or len(b) == 0:
        return None
    if len(a) == 1:
        a = torch.Size([1, a[0]])
    if len(b) == 1:
        b = torch.Size([b[0], 1])
    if len(b) == 2:  # a batched left operand against a matrix folds into the rows
        return 1, _prod(a[:-1]), int(a[-1]), int(b[-1])
    batch = torch.broadcast_shapes(a[:-2], b[:-2])
    return _prod(batch), int(a[-2]), int(a[-1]), int(b[-1])


def _conv(node: fx.Node, x: torch.Size, w: torch.Size, out: torch.Size
          ) -> Optional[Tuple[int, int, int, int, int]]:
    args = list(node.args)
    groups = args[8] if len(args) > 8 and _op_name(node) == "convolution" else \
        (args[6] if len(args) > 6 and _op_name(node) != "convolution"
         else node.kwargs.get("groups", 1))
    groups = int(groups) if isinstance(groups, int) else 1
    if len(w) < 3 or len(out) < 3:
        return None
    kernel = _prod(w[2:])
    return (groups, int(out[0]) * _prod(out[2:]), int(w[1]) * kernel,
            int(w[0]) // max(1, groups), kernel)


def products(node: fx.Node, half: bool, state: Sequence[fx.Node],
             requires_grad: Collection[fx.Node]) -> List[Product]:
    """The products of ``node`` (empty for other ops).

    Args:
        node: a ``call_function`` node with fake-tensor metadata.
        half: the node computes in float16.
        state: placeholders of parameters and buffers (weights: not exchanged).
        requires_grad: nodes whose value depends on a trainable weight (their
            operands get a gradient).
    """
    name = _op_name(node)
    args = list(node.args)
    state = set(state)

    def make(dims, left, right, kernel=1, repeat=1, serial_dim=None):
        groups, rows, depth, cols = dims
        if serial_dim is not None and repeat > 1:
            size = {"rows": rows, "depth": depth, "cols": cols}[serial_dim]
            part = max(1, math.ceil(size / repeat))
            rows, depth, cols = (part if serial_dim == "rows" else rows,
                                 part if serial_dim == "depth" else depth,
                                 part if serial_dim == "cols" else cols)
        base = _aliased_base(right) if isinstance(right, fx.Node) else right
        resident = isinstance(base, fx.Node) and base in state  # a weight, or its view
        problem = MatmulProblem(int(groups), int(rows), int(depth), int(cols), int(kernel),
                                exchange_rows=True, exchange_cols=not resident, half=half)
        return Product(problem, repeat, grad_rows=left in requires_grad,
                       grad_cols=right in requires_grad)

    if name == "linear" and len(args) >= 2:
        x, w = _shape(args[0]), _shape(args[1])
        if x is None or w is None or len(x) == 0:
            return []
        return [make((1, _prod(x[:-1]), int(x[-1]), int(w[0])), args[0], args[1])]
    if name in ("mm", "matmul", "bmm", "addmm", "baddbmm", "serialized_matmul"):
        left, right = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0],
                                                                                args[1])
        a, b = _shape(left), _shape(right)
        dims = _matmul(a, b) if a is not None and b is not None else None
        if dims is None:
            return []
        if name == "serialized_matmul":
            mode = str(args[2]) if len(args) > 2 else "Disabled"
            factor = int(args[3]) if len(args) > 3 else 1
            if mode in _SERIAL_DIM and factor > 1:
                return [make(dims, left, right, repeat=factor, serial_dim=_SERIAL_DIM[mode])]
        return [make(dims, left, right)]
    if name in ("convolution", "conv1d", "conv2d", "conv3d") and len(args) >= 2:
        x, w, out = _shape(args[0]), _shape(args[1]), _shape(node)
        if x is None or w is None or out is None:
            return []
        dims = _conv(node, x, w, out)
        if dims is None:
            return []
        return [make(dims[:4], args[0], args[1], kernel=dims[4])]
    if name in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention") and len(args) >= 3:
        q, k, v = _shape(args[0]), _shape(args[1]), _shape(args[2])
        if q is None or k is None or v is None or len(q) < 2:
            return []
        groups = _prod(q[:-2])
        return [make((groups, int(q[-2]), int(q[-1]), int(k[-2])), args[0], args[1]),
                make((groups, int(q[-2]), int(k[-2]), int(v[-1])), args[0], args[2])]
    return []


def backward_problems(product: Product) -> List[MatmulProblem]:
    """The products of the backward pass of one forward slice: the left operand's
    gradient ``dC @ Bᵀ`` (a convolution's gradient is a convolution over the same
    kernel) and the right operand's ``Aᵀ @ dC`` (both operands are activations; a
    convolution's input crosses the exchange once for all its kernel positions)."""
    p = product.problem
    result = []
    if product.grad_rows:
        channels = p.depth // max(1, p.kernel)
        result.append(dataclasses.replace(
            p, depth=p.cols * p.kernel, cols=channels, exchange_rows=True))
    if product.grad_cols:
        # a convolution's weight gradient reads each input element once for all
        # kernel positions (its rows are channels × positions)
        result.append(dataclasses.replace(
            p, rows=p.depth, depth=p.rows, kernel=1, exchange_rows=True,
            exchange_cols=True, row_reuse=max(1, p.kernel)))
    return result
