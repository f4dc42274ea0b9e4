"""The session options PopTorch's compiler derives by itself (its ``setOptionIfNotSet``
calls in ``initSession``), applied once the program is placed: see
:mod:`popart_compiler.implicit_defaults`."""
from __future__ import annotations

import math

from popart_compiler.implicit_defaults import (ProgramFacts, implicit_defaults, log_defaults,
                                               with_defaults)
from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation, PassResult, derived
from popart_compiler.passes.compiler_hints import OVERLAP_INPUT_OP, OVERLAP_OUTPUT_OP

__all__ = ["session_defaults", "program_facts"]


def program_facts(graph: Graph, c: Compilation) -> ProgramFacts:
    """The :class:`ProgramFacts` of a placed program: the IPUs and phases its ops use,
    overlapped IO markers, gradient clipping."""
    ipus, phases, overlapped = set(), {0}, False
    for node in graph.module.graph.nodes:
        if node.op != "call_function":
            continue
        placed = node.meta.get("placement")
        if placed is not None:
            ipus.add(int(placed.ipu))
            phases.add(int(placed.phase))
        schema = getattr(getattr(node.target, "_schema", None), "name", "")
        if schema in (OVERLAP_INPUT_OP, OVERLAP_OUTPUT_OP) and node.args[1] != "NoOverlap":
            overlapped = True
    norm = getattr(c.optimizer, "max_grad_norm", math.inf) if c.training else math.inf
    return ProgramFacts(training=c.training, used_ipus=max(1, len(ipus)),
                        max_phase=max(phases), overlapped_io=overlapped,
                        clipping=norm is not None and math.isfinite(norm))


def session_defaults(graph: Graph, c: Compilation) -> PassResult:
    """``defaults``: the options PopTorch's compiler would set for this program (each
    logged at DEBUG, "``<option> set to value <v>``"), and ``options``: the session
    options with them added (what the estimate, the runtime and the profile report
    read), both returned on the compilation."""
    defaults = implicit_defaults(c.options, program_facts(graph, c))
    log_defaults(defaults)
    return derived(graph, c, defaults=defaults, options=with_defaults(c.options, defaults))
