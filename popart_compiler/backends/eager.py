"""Floating-point exceptions on the IPU Model (docs/semantics.md S-46): a graph interpreted op by op
that stops at the first op producing a NaN or an infinity it was not given."""
from __future__ import annotations

import math
from typing import List

import torch
import torch.fx as fx

from popart_compiler.errors import backend_error

__all__ = ["FloatingPointChecker"]


class FloatingPointChecker(fx.Interpreter):
    """Runs a graph op by op and raises ``Error`` on a floating-point exception
    (docs/semantics.md S-46): an op whose floating-point result holds a NaN although none of its
    inputs did (invalid operation: ``inf − inf``, ``0 × inf``, ``sqrt(-1)``, ``0/0``), or an
    infinity although all its inputs were finite (overflow, division by zero, ``log(0)``), or a
    comparison reading a NaN."""

    _COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "equal", "isclose"})

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        if n.op != "call_function":
            return result
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        inputs = _leaves((args, kwargs))
        floats = [a for a in inputs if isinstance(a, torch.Tensor) and a.is_floating_point()]
        scalars = [a for a in inputs if isinstance(a, float)]
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        if name in self._COMPARISONS and (any(bool(t.isnan().any()) for t in floats)
                                          or any(math.isnan(x) for x in scalars)):
            raise _fp_error(n, "a comparison read a NaN")
        outputs = [t for t in _leaves(result)
                   if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not outputs:
            return result
        in_nan = any(bool(t.isnan().any()) for t in floats) or \
            any(math.isnan(x) for x in scalars)
        in_finite = all(bool(torch.isfinite(t).all()) for t in floats) and \
            all(math.isfinite(x) for x in scalars)
        for t in outputs:
            if not in_nan and bool(t.isnan().any()):
                raise _fp_error(n, "invalid operation (NaN result)")
            if in_finite and bool(torch.isinf(t).any()):
                raise _fp_error(n, "overflow or division by zero (infinite result)")
        return result


def _leaves(value) -> List:
    out: List = []
    if isinstance(value, (list, tuple)):
        for v in value:
            out.extend(_leaves(v))
    elif isinstance(value, dict):
        for v in value.values():
            out.extend(_leaves(v))
    else:
        out.append(value)
    return out


def _fp_error(node: fx.Node, what: str):
    return backend_error(
        f"Floating point exception: {what} in {node.name} ({node.target}). Disable "
        "poptorch.Options().Precision.enableFloatingPointExceptions to let non-finite "
        "values through.", type="poplar_application_runtime_error")
