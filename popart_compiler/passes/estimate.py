"""The IPU Model's estimate of a compiled program: memory per IPU and cycles
(:mod:`popart_compiler.cost`). The pass only estimates: the runtime writes the profile
report and reports a program that does not fit
(:func:`popart_compiler.runtime.reports.report`)."""
from __future__ import annotations

import dataclasses

from popart_compiler.cost import cost_model
from popart_compiler.cost.ipu_model import target_for
from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation, PassResult, derived

__all__ = ["estimate"]


def estimate(graph: Graph, c: Compilation) -> PassResult:
    """``estimate`` (returned on the compilation): memory and cycles of the placed
    program on the IPU Model of the session options (``ipu_model_version``,
    ``small_ipu_model``), with PopTorch's implicit defaults (``c.defaults``) listed
    first. The graph is unchanged."""
    o = c.options
    target = target_for(o.ipu_model_version, o.small_ipu_model)
    result = cost_model.estimate(graph, o, c.training, target, c.optimizer)
    # the options carry PopTorch's implicit defaults already (``session_defaults``)
    return derived(graph, c, estimate=dataclasses.replace(
        result, defaults=tuple(c.defaults) + result.defaults))
