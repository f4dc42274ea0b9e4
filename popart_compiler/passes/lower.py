"""Lowering a compiled program to its backend: what runs a micro-batch, a pipeline stage
and a vectorized call.

* ``eager``: the captured ATen graph runs with PyTorch's eager kernels (the
  ``fx.GraphModule`` itself).
* checked floating-point exceptions (S-46): an op-by-op interpreter
  (:class:`~popart_compiler.backends.eager.FloatingPointChecker`), whatever the backend.
* ``inductor``: TorchInductor's compilation of the same graph
  (:mod:`popart_compiler.backends.inductor`), compiled at its first call; on the CPU the
  linear layers first become oneDNN linears.
"""
from __future__ import annotations

import copy
import functools

from popart_compiler.backends import inductor
from popart_compiler.backends.eager import FloatingPointChecker
from popart_compiler.ir import Graph
from popart_compiler.logging import logger
from popart_compiler.passes.base import Compilation, PassResult, unchanged

__all__ = ["lower"]


def _checked(module):
    return FloatingPointChecker(module).run


def lower(graph: Graph, c: Compilation) -> PassResult:
    """Set ``c.runner`` and ``c.stage_runner`` (and compile ``c.vectorized`` on the
    inductor backend). The graph is unchanged: Inductor compiles a copy."""
    o = c.options
    if o.fp_exceptions:
        if o.backend == "inductor":
            logger.warning("Floating point exceptions are checked op by op: the inductor "
                           "compiler is not used for this model.")
        c.runner, c.stage_runner = _checked(graph.module), _checked
        return unchanged(graph)
    if o.backend != "inductor":
        c.runner, c.stage_runner = graph.module, None
        return unchanged(graph)
    random = graph.random
    runner = graph.module
    if o.device == "cpu":
        runner = inductor.onednn_linear(copy.deepcopy(graph.module))
        if c.vectorized is not None:
            inductor.onednn_linear(c.vectorized)
    c.runner = inductor.compile_graph(runner, random=random)
    c.stage_runner = functools.partial(inductor.compile_graph, random=random)
    if c.vectorized is not None:
        c.vectorized = inductor.compile_graph(c.vectorized, random=random)
    return unchanged(graph)
