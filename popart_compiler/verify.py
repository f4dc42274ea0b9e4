"""A checker of the compiler's graphs, run after every pass in the tests and when
``POPTORCH_VERIFY=1`` (JAX's ``check_jaxpr``, torch.export's verifier, tinygrad's
``SPEC`` in spirit): a pass that leaves a malformed graph fails at once, naming itself,
instead of far away in a session."""
from __future__ import annotations

from typing import Callable, Optional

from popart_compiler.errors import backend_error
from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation

__all__ = ["verify"]


def verify(graph: Graph, c: Optional[Compilation] = None, after: str = "",
           ensures: Optional[Callable[[Graph, Compilation], Optional[str]]] = None
           ) -> None:
    """Check ``graph``:

    * torch.fx's own ``lint`` of the module's graph;
    * the placeholders are the graph's, in order: parameters, buffers, constants, user
      inputs;
    * the outputs are the user outputs followed by the activation anchors (``c``);
    * every placeholder and op has ``meta["val"]``;
    * once placed (``c.placement``), every op has ``meta["placement"]``;
    * what the pass that just ran ensures (``ensures``, :mod:`popart_compiler.ensures`:
      no float64 after ``demote_float64``, no dropout in inference after
      ``remove_inference_dropout``, placement complete after ``place``, well-formed
      stage submodules and vectorized graph, devices and types, supported ops).

    Args:
        graph: the graph.
        c: the compilation (anchors and placement), when checking a compiler pass.
        after: the name of the pass that just ran (for the message).
        ensures: that pass's postcondition (:attr:`Pass.ensures`); needs ``c``.

    Raises:
        poptorch.Error: ``type == "poptorch_verify_error"``, naming the check and pass.
    """
    def fail(what: str):
        where = f" after pass {after}" if after else ""
        raise backend_error(f"Graph verification failed{where}: {what}",
                            type="poptorch_verify_error")

    gm = graph.module
    try:
        gm.graph.lint()
    except Exception as exc:  # fx raises RuntimeError for a malformed graph
        fail(f"fx lint: {exc}")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if placeholders != list(graph.placeholders):
        fail("the placeholders differ from the graph's recorded order")
    expected = len(graph.parameters) + len(graph.buffers) + len(graph.constants) \
        + graph.num_user_inputs
    if len(placeholders) != expected:
        fail(f"{len(placeholders)} placeholders for {expected} parameters, buffers, "
             "constants and inputs")
    outputs = list(graph.output_node.args[0])
    anchors = len(c.activation_anchors) if c is not None else len(outputs) - \
        graph.num_user_outputs
    if len(outputs) != graph.num_user_outputs + anchors:
        fail(f"{len(outputs)} outputs for {graph.num_user_outputs} user outputs and "
             f"{anchors} anchors")
    if outputs[:graph.num_user_outputs] != list(graph.output_nodes):
        fail("the user outputs differ from the graph's recorded output nodes")
    placed = c is not None and c.placement is not None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "call_function") and "val" not in node.meta:
            fail(f"{node.op} {node.name} has no meta['val']")
        if placed and node.op == "call_function" and "placement" not in node.meta:
            fail(f"op {node.name} has no placement")
    if ensures is not None and c is not None:
        problem = ensures(graph, c)
        if problem is not None:
            fail(problem)
