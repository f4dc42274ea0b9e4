"""Lowering an :class:`~popart_compiler.stages.Executable` to its backend: what runs a
micro-batch, a pipeline stage and a vectorized call (the session's :class:`Runners`).

The compiler hands the runtime plain data: the per-micro-batch graph, the vectorized
graph and the stage submodules, all uncompiled. A session lowers them when it is built
(:func:`lower`); the executable keeps its graphs as they are, so the same executable
can be lowered again (another session, another process).

* ``eager``: the captured ATen graph runs with PyTorch's eager kernels (the
  ``fx.GraphModule`` itself; the vectorized graph likewise).
* checked floating-point exceptions (docs/semantics.md S-46): an op-by-op interpreter
  (:class:`~popart_compiler.backends.eager.FloatingPointChecker`), whatever the backend.
* ``inductor``: TorchInductor's compilation of copies of the same graphs
  (:mod:`popart_compiler.backends.inductor`), compiled at their first call; on the CPU
  the linear layers first become oneDNN linears, and in inference their weights are
  prepacked (:mod:`popart_compiler.backends.prepack`).
* ``auto``: the eager lowering, plus :attr:`Runners.alternative`, which builds the
  inductor lowering (uncompiled) for :mod:`popart_compiler.backends.auto` to compile
  once the program is hot; none for programs that stay eager (checked floating-point
  exceptions, several stages, host side effects).

On the CPU, the first lowering also tells the allocator to keep freed host memory for
the next call (:mod:`popart_compiler.runtime.host_memory`).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Callable, Optional

import torch.fx as fx

from popart_compiler.backends import conv_fusion, inductor, prepack
from popart_compiler.backends.auto import Lowering
from popart_compiler.backends.eager import FloatingPointChecker
from popart_compiler.logging import logger
from popart_compiler.runtime import host_memory
from popart_compiler.passes.vectorize import vectorizable_slots, vectorize_program
from popart_compiler.stages import Executable

__all__ = ["Runners", "lower", "inductor_lowering"]


@dataclasses.dataclass
class Runners:
    """What a session runs for one executable.

    Attributes:
        lowering: the backend's runner of one micro-batch (``runner(*state, *inputs)``)
            and, for stateless inference, of ``vectorized_slots`` micro-batches at once.
        stage_runner: turns a stage's submodule into what runs it (``None``: call the
            submodule).
        alternative: the ``auto`` backend: builds the Inductor lowering (uncompiled)
            that a session compiles once the program is hot; ``None`` where the
            program stays eager.
    """
    lowering: Lowering
    stage_runner: Optional[Callable[[fx.GraphModule], Callable]] = None
    alternative: Optional[Callable[[], Lowering]] = None


def _checked(module):
    return FloatingPointChecker(module).run


def lower(exe: Executable) -> Runners:
    """The :class:`Runners` of ``exe`` on its backend (module docstring). Nothing of
    ``exe`` changes: Inductor compiles copies of its graphs, lazily (at their first
    call, or :func:`~popart_compiler.runtime.warm_up.warm_up`)."""
    o, graph = exe.options, exe.graph
    if o.device == "cpu":
        host_memory.retain_freed_memory()
    slots = exe.vectorized_slots if exe.vectorized is not None else 1
    if o.fp_exceptions:
        if o.backend == "inductor":
            logger.warning("Floating point exceptions are checked op by op: the inductor "
                           "compiler is not used for this model.")
        return Runners(Lowering("eager", _checked(graph.module), exe.vectorized, slots),
                       _checked)
    if o.backend != "inductor":
        alternative = None
        if o.backend == "auto" and exe.stages is None and not graph.runs_per_micro_batch():
            alternative = functools.partial(inductor_lowering, exe, vectorizable_slots(
                graph, o, exe.training, exe.staged))
        return Runners(Lowering("eager", graph.module, exe.vectorized, slots), None,
                       alternative)
    random = graph.random
    runner = graph.module
    vectorized = copy.deepcopy(exe.vectorized) if exe.vectorized is not None else None
    if o.device == "cpu":
        runner = _for_cpu(copy.deepcopy(graph.module), exe.training)
        if vectorized is not None:
            vectorized = _for_cpu(vectorized, exe.training)
    if vectorized is not None:
        vectorized = inductor.compile_graph(vectorized, random=random)
    return Runners(Lowering("inductor", inductor.compile_graph(runner, random=random),
                            vectorized, slots),
                   functools.partial(inductor.compile_graph, random=random))


def _for_cpu(gm: fx.GraphModule, training: bool) -> fx.GraphModule:
    """oneDNN linears; in inference, batch normalizations folded into the convolutions
    before them with their residual sum and ReLU
    (:mod:`popart_compiler.backends.conv_fusion`), then prepacked weights and
    channels-last convolutions (:mod:`popart_compiler.backends.prepack`; training:
    none, the weights change at every step)."""
    inductor.onednn_linear(gm)
    if training:
        return gm
    return prepack.prepack_inference(conv_fusion.fold_batch_norms(gm))


def inductor_lowering(exe: Executable, slots: int) -> Lowering:
    """The inductor backend's lowering of ``exe`` for the ``auto`` backend: the
    per-micro-batch graph and, for ``slots`` > 1, the graph vectorized over ``slots``
    micro-batches, each compiled at its first call (or by ``precompile``); on the CPU
    their linear layers run as oneDNN linears (prepacked in inference). A signature
    never compiled runs its graph module uncompiled (``compile_on_miss=False``): the
    ``auto`` backend compiles outside the session's calls only."""
    graph, o = exe.graph, exe.options
    runner = copy.deepcopy(graph.module)
    vectorized = vectorize_program(graph, o, slots) if slots > 1 else None
    if o.device == "cpu":
        runner = _for_cpu(runner, exe.training)
        if vectorized is not None:
            vectorized = _for_cpu(vectorized, exe.training)
    compiled = functools.partial(inductor.compile_graph, random=graph.random,
                                 compile_on_miss=False)
    return Lowering("inductor", compiled(runner),
                    compiled(vectorized) if vectorized is not None else None,
                    slots if vectorized is not None else 1)

