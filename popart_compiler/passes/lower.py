"""Lowering a compiled program to its backend: what runs a micro-batch, a pipeline stage
and a vectorized call.

* ``eager``: the captured ATen graph runs with PyTorch's eager kernels (the
  ``fx.GraphModule`` itself).
* checked floating-point exceptions (docs/semantics.md S-46): an op-by-op interpreter
  (:class:`~popart_compiler.backends.eager.FloatingPointChecker`), whatever the backend.
* ``inductor``: TorchInductor's compilation of the same graph
  (:mod:`popart_compiler.backends.inductor`), compiled at its first call; on the CPU the
  linear layers first become oneDNN linears.
* ``auto``: the eager backend's lowering, plus ``c.alternative``, which builds the
  inductor lowering (uncompiled) for :mod:`popart_compiler.backends.auto` to compile
  once the program is hot; none for programs that stay eager (checked floating-point
  exceptions, several stages, host side effects).
"""
from __future__ import annotations

import copy
import functools

from popart_compiler.backends import inductor, prepack
from popart_compiler.backends.auto import Lowering
from popart_compiler.backends.eager import FloatingPointChecker
from popart_compiler.ir import Graph
from popart_compiler.logging import logger
from popart_compiler.passes.base import Compilation, PassResult, unchanged
from popart_compiler.passes.vectorize import vectorizable_slots, vectorize_program

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
        if o.backend == "auto" and c.stages is None and not graph.runs_per_micro_batch():
            c.alternative = functools.partial(inductor_lowering, graph, o,
                                              vectorizable_slots(graph, c), c.training)
        return unchanged(graph)
    random = graph.random
    runner = graph.module
    if o.device == "cpu":
        runner = _for_cpu(copy.deepcopy(graph.module), c.training)
        if c.vectorized is not None:
            _for_cpu(c.vectorized, c.training)
    c.runner = inductor.compile_graph(runner, random=random)
    c.stage_runner = functools.partial(inductor.compile_graph, random=random)
    if c.vectorized is not None:
        c.vectorized = inductor.compile_graph(c.vectorized, random=random)
    return unchanged(graph)


def _for_cpu(gm, training: bool):
    """oneDNN linears; in inference, prepacked weights and channels-last convolutions
    (:mod:`popart_compiler.backends.prepack`)."""
    inductor.onednn_linear(gm)
    return gm if training else prepack.prepack_inference(gm)


def inductor_lowering(graph: Graph, o, slots: int, training: bool = False) -> Lowering:
    """The inductor backend's lowering of ``graph`` (session options ``o``) for the
    ``auto`` backend: the per-micro-batch graph and, for ``slots`` > 1, the graph
    vectorized over ``slots`` micro-batches, each compiled at its first call (or by
    ``precompile``); on the CPU their linear layers run as oneDNN linears. A signature
    never compiled runs its graph module uncompiled (``compile_on_miss=False``): the
    ``auto`` backend compiles outside the session's calls only. ``training``: no
    prepacked weights (they change at every step)."""
    runner = copy.deepcopy(graph.module)
    vectorized = vectorize_program(graph, o, slots) if slots > 1 else None
    if o.device == "cpu":
        _for_cpu(runner, training)
        if vectorized is not None:
            _for_cpu(vectorized, training)
    compiled = functools.partial(inductor.compile_graph, random=graph.random,
                                 compile_on_miss=False)
    return Lowering("inductor", compiled(runner),
                    compiled(vectorized) if vectorized is not None else None,
                    slots if vectorized is not None else 1)
