"""Compiler passes over the ops that steer the IPU compiler (docs/api-sections.md api
§8.10, §8.11).

* :func:`check_overlapped_io` applies docs/semantics.md S-66's rules to ``set_overlap_for_input`` /
  ``set_overlap_for_output`` markers whose mode is not ``NoOverlap``.
* :func:`record_available_memory` copies each ``set_available_memory`` proportion onto
  the node that produced its input (``node.meta["available_memory_proportion"]``), the
  op whose temporary memory PopART would budget.
"""
from __future__ import annotations

from typing import List

import torch.fx as fx

from popart_compiler.enums import ExecutionMode, OutputMode
from popart_compiler.errors import backend_error
from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation, PassResult, unchanged

__all__ = ["check_overlapped_io", "record_available_memory", "OVERLAP_INPUT_OP",
           "OVERLAP_OUTPUT_OP", "AVAILABLE_MEMORY_OP"]

OVERLAP_INPUT_OP = "poptorch::set_overlap_for_input"
OVERLAP_OUTPUT_OP = "poptorch::set_overlap_for_output"
AVAILABLE_MEMORY_OP = "poptorch::set_available_memory"

#: Output modes that overlapped IO supports.
_OVERLAP_OUTPUT_MODES = (OutputMode.All, OutputMode.Sum)


def _nodes(graph: Graph, qualname: str) -> List[fx.Node]:
    return [n for n in graph.module.graph.nodes if n.op == "call_function"
            and getattr(getattr(n.target, "_schema", None), "name", "") == qualname]


def check_overlapped_io(graph: Graph, c: Compilation) -> PassResult:
    """Apply docs/semantics.md S-66 to the overlap markers of ``graph``.

    Raises:
        Error: a pipelined strategy, no IO tiles, output mode other than All / Sum, an
            input marker not applied directly to a model input or not its only
            consumer, an output marker on a tensor that is not returned or is returned
            twice.
    """
    inputs = [_nodes(graph, OVERLAP_INPUT_OP), _nodes(graph, OVERLAP_OUTPUT_OP)]
    markers = [n for group in inputs for n in group if n.args[1] != "NoOverlap"]
    if not markers:
        return unchanged(graph)
    _check_markers(graph, markers)
    # PopTorch's order and wording (its tests match them): markers, strategy, tiles
    options = c.options
    if options.strategy.mode is ExecutionMode.Pipelined:
        raise backend_error(
            "Overlapped IO is not supported with poptorch.PipelinedExecution. If you are "
            "using only one IPU, please switch to poptorch.ShardedExecution. "
            "(options.setExecutionStrategy(poptorch.ShardedExecution()))")
    if options.popart.io_tiles < 32:
        raise backend_error(
            "No IO tiles allocated. You must allocate at least 32 IO tiles using "
            "poptorch.Options().TensorLocations.numIOTiles. (e.g. "
            "options.TensorLocations.numIOTiles(32))")
    if options.output_mode not in _OVERLAP_OUTPUT_MODES:
        raise backend_error(
            "Unsupported output mode for overlapped IO: use poptorch.OutputMode.All or "
            "poptorch.OutputMode.Sum (options.outputMode(...)).")
    return unchanged(graph)


def _check_markers(graph: Graph, markers: List[fx.Node]) -> None:
    """Input markers directly on a model input and its only consumer; output markers
    on a tensor returned exactly once."""
    names = dict(zip(graph.user_input_nodes, graph.user_input_names))
    outputs = list(graph.output_nodes)
    for node in markers:
        source = node.args[0]
        if _is_input_marker(node):
            if source not in names:
                raise backend_error(
                    "poptorch.set_overlap_for_input applied on a node which is not a "
                    "tensor input to the model. (Apply it directly to the arguments of "
                    "forward.)")
            if len(source.users) != 1:
                raise backend_error(
                    "poptorch.set_overlap_for_input must be the only op applied to an "
                    f"input. This is not the case for input {names[source]} to the model.")
        else:
            count = outputs.count(node)
            if count == 0:
                raise backend_error(
                    "poptorch.set_overlap_for_output applied on a node which is not a "
                    "tensor output to the model. (Apply it to the tensors forward "
                    "returns, just before returning them.)")
            if count + outputs.count(source) > 1:  # the marked value and its source
                raise backend_error(
                    "poptorch.set_overlap_for_output cannot be used with a tensor that is "
                    "returned twice. Please check all returned tensors including those "
                    "nested in tuples/lists.")


def _is_input_marker(node: fx.Node) -> bool:
    return node.target._schema.name == OVERLAP_INPUT_OP


def record_available_memory(graph: Graph, c: Compilation) -> PassResult:
    """``node.meta["available_memory_proportion"]`` on every op whose output went
    through ``set_available_memory`` (the marker node keeps it too)."""
    for node in _nodes(graph, AVAILABLE_MEMORY_OP):
        proportion = float(node.args[1])
        node.meta["available_memory_proportion"] = proportion
        source = node.args[0]
        if isinstance(source, fx.Node) and source.op == "call_function":
            source.meta["available_memory_proportion"] = proportion
    return unchanged(graph)
