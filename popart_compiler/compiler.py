"""The compiler: a captured :class:`~popart_compiler.ir.Graph` plus
:class:`~popart_compiler.session_options.SessionOptions` → an
:class:`~popart_compiler.stages.Executable`.

Compilation is the list of named passes :data:`PASSES`, run in order by
:func:`compile` (each a function ``(graph, compilation) -> PassResult``, see
:mod:`popart_compiler.passes.base`): the IPU's rules (supported dtypes, 32-bit types,
static shapes), the execution strategy and the loss of training graphs are checked,
anchors resolved, the graph placed on IPUs, split into pipeline stages, vectorized over
micro-batches where it can be and estimated on the IPU Model. Passes return what they
derive on a new :class:`~popart_compiler.passes.base.Compilation`, which :func:`compile`
hands to the next pass and copies into the executable at the end. The result is plain data:
the runtime lowers it to its backend when a session is built
(:mod:`popart_compiler.runtime.lowering`).
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

from popart_compiler import config, ensures
from popart_compiler.backends import inductor
from popart_compiler.errors import backend_error
from popart_compiler.ir import Graph
from popart_compiler.logging import logger
from popart_compiler.passes.anchors import name_tensors, resolve_anchors
from popart_compiler.passes.base import Compilation, Pass
from popart_compiler.passes.checks import (check_buffers, check_inputs, check_loss,
                                           check_options, check_replica_groupings)
from popart_compiler.passes.compiler_hints import (check_overlapped_io,
                                                   record_available_memory)
from popart_compiler.passes.dropout import remove_inference_dropout
from popart_compiler.passes.dtypes import demote_float64, retarget_device
from popart_compiler.passes.estimate import estimate
from popart_compiler.passes.defaults import session_defaults
from popart_compiler.passes.placement import place
from popart_compiler.passes.split_stages import split_stages
from popart_compiler.passes.vectorize import vectorize
from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.session_options import SessionOptions
from popart_compiler.stages import Executable
from popart_compiler.verify import verify

__all__ = ["PASSES", "compile", "prepare"]

#: The compiler, in order, each pass with what it ensures (:mod:`popart_compiler.ensures`).
PASSES: Tuple[Pass, ...] = (
    Pass.of(check_options),
    Pass.of(check_inputs, ensures.ipu_types_and_ops),
    Pass.of(demote_float64, ensures.no_float64),
    Pass.of(retarget_device, ensures.on_session_device),
    Pass.of(remove_inference_dropout, ensures.no_inference_dropout),
    Pass.of(check_loss),
    Pass.of(check_buffers),
    Pass.of(check_replica_groupings),
    Pass.of(check_overlapped_io),
    Pass.of(record_available_memory),
    Pass.of(resolve_anchors),
    Pass.of(name_tensors),
    Pass.of(place, ensures.placement_complete),
    Pass.of(session_defaults),
    Pass.of(split_stages, ensures.stages_well_formed),
    Pass.of(vectorize, ensures.vectorized_well_formed),
    Pass.of(estimate, ensures.estimated),
)


def prepare(options: SessionOptions) -> None:
    """Start what a compilation with ``options`` can do before its graph is
    captured: on the CPU, the inductor backend's probe of the CPU
    (:func:`inductor.start_probing_cpu`, in a background thread)."""
    if options.backend == "inductor" and options.device == "cpu" \
            and not options.fp_exceptions:
        inductor.start_probing_cpu()


def compile(graph: Graph, options: SessionOptions, training: bool,  # noqa: A001
            progress: Optional[Callable[[int, int], None]] = None,
            optimizer: Optional[OptimizerDescription] = None,
            passes: Optional[List[Pass]] = None,
            stop_after: Optional[str] = None) -> Executable:
    """Compile ``graph`` by running :data:`PASSES` in order (up to ``stop_after``).

    Each pass gets the :class:`~popart_compiler.passes.base.Compilation` the previous
    one returned (:attr:`PassResult.compilation`: passes return what they derive, they
    never write into it), and the executable is built from the last one. A pass that
    changed the graph is followed by :meth:`Graph.refresh`; when
    ``POPTORCH_VERIFY=1`` every pass is followed by :func:`~popart_compiler.verify.verify`
    with what the pass ensures (:attr:`Pass.ensures`). An exception raised
    by a pass propagates unchanged, with a note naming the pass.

    Args:
        graph: the captured program (one micro-batch); rewritten in place.
        options: session options (batching, output mode, anchors, ...).
        training: compile forward, backward and weight update.
        progress: called as ``progress(passes done, len(PASSES))``.
        optimizer: the ``OptimizerDescription`` of a training program (its state
            counts in the memory estimate).
        passes: the passes to run instead of :data:`PASSES` (tests).
        stop_after: the name of the last pass to run (one of ``passes``); default:
            all. An executable compiled part of the way holds what its passes derived
            (e.g. ``stop_after="vectorize"``: everything but the estimate, which
            ``poptorch.plan`` computes itself).

    Raises:
        Error: ``stop_after`` names no pass of ``passes`` (the message lists them);
            unsupported input dtype or zero-sized tensor; output-mode period
            inconsistent with ``device_iterations``; gradient accumulation in
            inference; training graph without exactly one final, returned loss;
            the execution strategy's rules (docs/semantics.md S-60, S-63…S-65, see
            :func:`~popart_compiler.passes.placement.plan_placement`);
            in-place buffer updates with replicas fed different data while
            ``broadcast_buffers`` is on; unknown anchor; a process id outside
            ``[0, num_processes)``; overlapped IO against docs/semantics.md S-66's rules. A program
            that does not fit is estimated as such (``estimate.fits``); the runtime
            reports it (:func:`popart_compiler.runtime.reports.report`).
    """
    start = time.perf_counter()
    passes = _until(list(PASSES if passes is None else passes), stop_after)
    report = progress or (lambda done, total: None)
    check = config.verify_graphs()
    c = Compilation(options, training, optimizer)
    ran = []
    report(0, len(passes))
    for i, p in enumerate(passes):
        logger.debug("Compiler pass %d/%d: %s", i + 1, len(passes), p.name)
        try:
            result = p(graph, c)
            graph, c = result.graph, result.after(c)
            if result.changed:
                graph.refresh()
            if check:
                verify(graph, c, after=p.name, ensures=p.ensures)
        except BaseException as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"(in compiler pass {p.name})")
            logger.debug("Compiler pass %s raised %s", p.name, type(exc).__name__)
            raise
        ran.append((p.name, result.changed))
        report(i + 1, len(passes))
    if not graph.has_device_work():
        logger.info("No IPUs are used by this model. This may lead to unexpected "
                    "behaviour.")
    plan = c.placement
    return Executable(
        graph, c.options, training, c.loss_index,
        num_ipus=(plan.ipus_per_replica if plan else 1) * options.replication_factor,
        activation_anchors=c.activation_anchors, state_anchors=c.state_anchors,
        vectorized=c.vectorized, tensor_names=c.tensor_names,
        compile_seconds=time.perf_counter() - start,
        vectorized_slots=c.vectorized_slots, placement=plan, stages=c.stages,
        estimate=c.estimate, passes=ran, defaults=c.defaults, optimizer=c.optimizer)


def _until(passes: List[Pass], stop_after: Optional[str]) -> List[Pass]:
    """``passes`` up to and including the one named ``stop_after`` (all: ``None``)."""
    if stop_after is None:
        return passes
    names = [p.name for p in passes]
    if stop_after not in names:
        raise backend_error(f"compile(stop_after={stop_after!r}): no compiler pass has "
                            f"that name. Name one of: {', '.join(names)}.")
    return passes[:names.index(stop_after) + 1]
