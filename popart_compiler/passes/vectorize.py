"""Vectorizing stateless inference over the micro-batches of a run.

For inference graphs without state, :func:`vectorize` turns the per-micro-batch graph
into one graph over several micro-batches of a run with ``torch.func.vmap`` traced by
``make_fx``: the same arithmetic per micro-batch, batched kernels instead of a Python
loop. Ops without a batching rule are decomposed into ops that have one; vmap's slow
per-slice fallback is never used. What the tracing leaves behind is simplified
(:mod:`popart_compiler.passes.simplify`).
"""
from __future__ import annotations

import contextlib
import io
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from popart_compiler.backends.tracing import TRACE_LOCK
from popart_compiler.ir import Graph
from popart_compiler.logging import logger
from popart_compiler.passes.batch_rules import (VectorizableGraph, needs_rules,
                                              restore_batch_norms)
from popart_compiler.passes.base import Compilation, PassResult, derived, unchanged
from popart_compiler.passes.simplify import simplify
from popart_compiler.session_options import SessionOptions

__all__ = ["vectorize", "vectorize_graph", "vectorize_program", "vectorizable_slots",
           "chunk_size", "VECTORIZE_BUDGET"]

#: Bytes the largest intermediate tensor of a vectorized inference call may take: about
#: a core's L2 cache. Batched kernels whose working set spills out of it get slower per
#: sample than a loop over micro-batches (measured on convolutions).
VECTORIZE_BUDGET = 2 * 1024 * 1024


def vectorize(graph: Graph, c: Compilation) -> PassResult:
    """Stateless inference running several micro-batches per call: ``vectorized``,
    the graph over ``vectorized_slots`` micro-batches, returned on the compilation
    (all of them on the inductor backend, whose fused kernels have no cache-size sweet
    spot; else :func:`chunk_size`). The per-micro-batch graph is unchanged; nothing is
    vectorized for training, several stages, state written in place, synthetic data,
    checked floating-point exceptions, replica-grouped weights, host side effects, or
    when tracing fails (the session then loops)."""
    o = c.options
    slots = vectorizable_slots(graph, o, c.training, c.stages is not None)
    if slots <= 1:
        return unchanged(graph)
    chunk = slots if o.backend == "inductor" else chunk_size(graph, slots)
    if chunk <= 1:
        return unchanged(graph)
    vectorized = vectorize_program(graph, o, chunk)
    if vectorized is None:
        return unchanged(graph)
    return derived(graph, c, vectorized=vectorized, vectorized_slots=chunk)


def vectorizable_slots(graph: Graph, o: SessionOptions, training: bool, staged: bool) -> int:
    """Micro-batches of a call that :func:`vectorize` may run as one program (replicas
    × device iterations of the session options ``o``); 1 when the program cannot be
    vectorized (see :func:`vectorize`): ``training`` or ``staged`` (several pipeline
    stages) among other reasons."""
    slots = o.device_iterations * o.replication_factor
    if (training or slots <= 1 or staged or graph.mutated_buffers
            or graph.mutated_inputs or graph.mutated_constants or o.synthetic_data
            or o.fp_exceptions or o.replica_groupings or not graph.has_device_work()
            or graph.runs_per_micro_batch()
            or any(info is None for info in graph.user_inputs)):
        return 1
    return slots


def vectorize_program(graph: Graph, o: SessionOptions, chunk: int) -> Optional[fx.GraphModule]:
    """:func:`vectorize_graph` of ``graph``'s module over ``chunk`` micro-batches, with
    its state and inputs on the execution device of the session options ``o``
    (float64 state as float32, as the device holds it); ``None`` if tracing fails."""
    values = graph.state_values()
    names = graph.parameters + graph.buffers + graph.constants
    state = [values[n].detach().to(o.device) for n in names]
    state = [s.float() if s.dtype == torch.float64 else s for s in state]
    examples = [torch.empty(info.shape, dtype=info.dtype, device=o.device)
                for info in graph.user_inputs]
    return vectorize_graph(graph.module, state, examples, chunk)


def chunk_size(graph: Graph, slots: int) -> int:
    """Micro-batches to run per vectorized call: the largest divisor of ``slots``
    keeping the largest intermediate tensor within :data:`VECTORIZE_BUDGET` bytes
    (batched kernels beyond the CPU caches get slower per sample than a loop)."""
    user_inputs = set(graph.user_input_nodes)
    largest = 1
    for node in graph.module.graph.nodes:
        if node.op not in ("call_function", "placeholder") or \
                (node.op == "placeholder" and node not in user_inputs):
            continue  # weights are shared by the micro-batches of a call
        val = node.meta.get("val")
        values = val if isinstance(val, (list, tuple)) else [val]
        for v in values:
            if isinstance(v, torch.Tensor):
                largest = max(largest, v.numel() * v.element_size())
    fit = max(1, VECTORIZE_BUDGET // largest)
    return max(k for k in range(1, slots + 1) if slots % k == 0 and k <= fit)


def vectorize_graph(fn: Callable, state: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
              slots: int) -> Optional[fx.GraphModule]:
    """Trace ``fn(*state, *inputs)`` vmapped over ``slots`` micro-batches.

    Args:
        fn: the per-micro-batch graph.
        state: parameters, buffers and constants (shared by every micro-batch).
        inputs: one micro-batch of each user input.
        slots: number of micro-batches run together.

    Returns:
        A graph module taking ``(*state, *batched_inputs)`` where every batched input has
        a leading dimension of ``slots``, returning outputs with that leading dimension;
        ``None`` if the graph cannot be vectorized (the caller then loops).
    """
    with TRACE_LOCK:  # make_fx patches process-wide state, as torch.export does
        return _vectorize(fn, state, inputs, slots)


def _vectorize(fn: Callable, state: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
               slots: int) -> Optional[fx.GraphModule]:
    if isinstance(fn, fx.GraphModule) and needs_rules(fn):
        fn = VectorizableGraph(fn).run
    examples = [torch.empty((slots, *x.shape), dtype=x.dtype, device=x.device)
                for x in inputs]
    try:
        return simplify(restore_batch_norms(_trace_vmapped(fn, state, examples)))
    except Exception as e:  # no batching rule, data-dependent op, ...
        logger.debug("Vectorizing with decomposed ops: %s", e)
    try:
        # Ops without a batching rule (e.g. CPU scaled-dot-product attention) are
        # decomposed into ops that have one; the graph stays one batched program.
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            decomposed = make_fx(fn, decomposition_table=core_aten_decompositions(),
                                 tracing_mode="fake")(*state, *inputs)
        return simplify(_trace_vmapped(decomposed, state, examples))
    except Exception as e:  # still no batching rule, data-dependent op, ...
        logger.debug("Running micro-batches one by one: vectorization failed (%s)", e)
        return None


def _trace_vmapped(fn: Callable, state: Sequence[torch.Tensor],
                   examples: Sequence[torch.Tensor]) -> fx.GraphModule:
    """``make_fx`` of ``fn`` vmapped over the leading dimension of ``examples``.
    vmap's per-slice fallback (and its "BatchedFallback" warning) is disabled: an op
    without a batching rule raises instead."""
    in_dims = tuple([None] * len(state) + [0] * len(examples))
    vmapped = torch.func.vmap(fn, in_dims=in_dims, randomness="different")
    functorch = torch._C._functorch  # pylint: disable=protected-access
    enabled = functorch._is_vmap_fallback_enabled()
    functorch._set_vmap_fallback_enabled(False)
    try:
        # a failed trace is expected (the caller retries or loops); fx prints its own
        # traceback
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            return make_fx(vmapped, tracing_mode="fake")(*state, *examples)
    finally:
        functorch._set_vmap_fallback_enabled(enabled)
