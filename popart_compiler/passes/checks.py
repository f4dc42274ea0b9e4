"""The compiler's checks of a captured program: options, input and output types, the
training loss, buffers written in place by replicas and replica-grouped weights. Each
raises ``Error`` naming what to change, or leaves the graph as it is."""
from __future__ import annotations

import torch

from popart_compiler.enums import OutputMode
from popart_compiler.errors import backend_error
from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation, PassResult, derived, unchanged

__all__ = ["UNSUPPORTED_DTYPES", "check_options", "check_inputs", "check_loss",
           "check_buffers", "check_replica_groupings"]

#: dtypes the IPU cannot take as inputs (docs/semantics.md S-45), with the names PopTorch reports.
UNSUPPORTED_DTYPES = {
    torch.bfloat16: "BFloat16",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
    torch.complex32: "ComplexHalf",
}


def check_options(graph: Graph, c: Compilation) -> PassResult:
    """Output-mode periods against ``device_iterations`` (docs/semantics.md S-12), positive batching
    factors, no gradient accumulation in inference, a valid distributed process id."""
    options = c.options
    if options.output_mode is OutputMode.EveryN:
        period, steps = options.output_return_period, options.device_iterations
        if period > steps:
            raise backend_error("Return period must be <= to the number of batches "
                                f"per step ({period} > {steps}).")
        if steps % period:
            raise backend_error("Return period must be a factor of the number of "
                                f"batches per step ({steps} % {period} != 0).")
    for anchor in options.anchors:
        if anchor.output_mode is OutputMode.EveryN and (
                anchor.return_period > options.device_iterations
                or options.device_iterations % anchor.return_period):
            raise backend_error(
                f"Return period of anchor {anchor.name} must be <= to and a factor of "
                "the number of batches per step.")
    if not c.training and options.gradient_accumulation != 1:
        raise backend_error("Gradient accumulation must be 1 for an inference model.")
    if options.replication_factor < 1 or options.device_iterations < 1 \
            or options.gradient_accumulation < 1:
        raise backend_error("deviceIterations, replicationFactor and "
                            "gradientAccumulation must be positive integers.")
    if options.num_processes < 1 or not \
            0 <= options.process_id < options.num_processes:
        raise backend_error(
            f"Invalid distributed process {options.process_id} of "
            f"{options.num_processes}: Options.Distributed.configureProcessId(id, n) "
            "needs 0 <= id < n.")
    return unchanged(graph)


def check_inputs(graph: Graph, c: Compilation) -> PassResult:
    """Input and output dtypes the IPU takes (docs/semantics.md S-45; complex values only inside the
    graph); no zero-sized user input or output (docs/semantics.md S-3)."""
    for node in graph.placeholders:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype in UNSUPPORTED_DTYPES:
            raise backend_error("Unsupported tensor input type from pytorch: "
                                f"{UNSUPPORTED_DTYPES[val.dtype]}. Convert it with "
                                ".float() or .half() before calling the model.")
    for info in graph.user_outputs:
        if info is not None and info.dtype in UNSUPPORTED_DTYPES:
            raise backend_error(
                "Unsupported tensor output type: "
                f"{UNSUPPORTED_DTYPES[info.dtype]}. The IPU has no complex or bfloat16 "
                "types: complex values may only be intermediate results inside the "
                "model (e.g. of torch.fft); return torch.view_as_real(x), x.real, "
                "x.imag or x.abs() instead.")
    # Only the tensors the user passes or receives: intermediate values of a
    # decomposition (EmbeddingBag's offsets, an empty key/value cache that is
    # concatenated to) never reach the user and are computed as in PyTorch.
    for info in list(graph.user_inputs) + list(graph.user_outputs):
        if info is not None and 0 in info.shape:
            raise backend_error(f"Zero-sized tensors are unsupported (Got shape "
                                f"{list(info.shape)})")
    return unchanged(graph)


def check_loss(graph: Graph, c: Compilation) -> PassResult:
    """Training: exactly one final loss, returned once by ``forward`` (docs/semantics.md S-40);
    returns its output index as ``loss_index`` on the compilation."""
    if not c.training:
        return unchanged(graph)
    finals = graph.final_losses()
    if not finals:
        raise backend_error(
            "Couldn't find a loss in graph! A training model must compute its loss "
            "with a PyTorch loss (e.g. torch.nn.functional.cross_entropy) or "
            "poptorch.identity_loss and return it from forward.")
    if len(finals) > 1:
        raise backend_error(  # PopTorch's wording, then the losses found
            "Multiple independent losses found in graph. Graph must have one final "
            "loss. Wrap final graph loss in poptorch.identity_loss. (Losses: "
            f"{', '.join(n.name for n in finals)}; e.g. poptorch.identity_loss(loss_a + "
            "loss_b, reduction='none').)")
    outputs = graph.loss_outputs(finals[0])
    if len(outputs) > 1:
        raise backend_error(
            f"The model's forward returns {len(outputs)} different values computed "
            "from its final loss (outputs "
            f"{', '.join(str(i) for i in outputs)}): return the loss once, or wrap "
            "the value to back-propagate from in poptorch.identity_loss(loss, "
            "reduction=...).")
    if not outputs:
        raise backend_error(
            "The final loss must be returned by the model's forward (e.g. "
            "`return output, loss`).")
    return derived(graph, c, loss_index=outputs[0])


def check_buffers(graph: Graph, c: Compilation) -> PassResult:
    """Buffers written in place while replicas take different data need
    ``broadcastBuffers(False)`` (docs/semantics.md S-36)."""
    options = c.options
    # docs/semantics.md S-36 compares the local replica count R (replicationFactor,
    # docs/semantics.md S-28) with the input
    # groups, as PopTorch does under PopRun: each process keeps its own buffers, which
    # may drift apart between processes as they would in PopTorch.
    if (graph.mutated_buffers and options.broadcast_buffers
            and options.replication_factor > options.input_group_size):
        raise backend_error(
            "PopTorch does not support broadcasting buffers. If your model is able to "
            "tolerate buffers becoming out of sync between replicas, you can disable "
            "buffer broadcasting using poptorch.Options.broadcastBuffers(False). "
            f"Buffers modified in place: {sorted(graph.mutated_buffers)}.")
    return unchanged(graph)


def check_replica_groupings(graph: Graph, c: Compilation) -> PassResult:
    """Replica-grouped weights are parameters whose grouping fits the replicas
    (docs/semantics.md S-27)."""
    for name, grouping in c.options.replica_groupings.items():
        if name not in graph.parameters:
            raise backend_error(f"Per-replica weight {name} is not a parameter of the "
                                "graph")
        grouping.validate(name, c.options.global_replicas)
    return unchanged(graph)
