"""``poptorch.plan``: the pipeline planner (a callable module).

``poptorch.plan(model, *example_inputs, ipus=4, ...)`` returns a :class:`Plan`: the
IPU Model chooses the placement of the model's repeated layers over the IPUs, the
recomputation checkpoints, available memory proportions, serialisation of vocabulary
projections, optimizer-state location and micro-batch that fit and run fastest (see
:func:`plan`). ``python -m poptorch.plan MODULE:FACTORY --ipus 4`` does the same from
the command line (:mod:`poptorch._plan.cli`).

``poptorch.plan`` is this module, made callable: calling it calls :func:`plan`, so that
both the function and ``python -m poptorch.plan`` have the one name. The planner itself
lives in :mod:`popart_compiler.planner` (the search over the IPU Model) and
:mod:`poptorch._plan` (capture, plan, apply).
"""
import sys as _sys
import types as _types

from poptorch._plan.api import plan
from poptorch._plan.result import Plan

__all__ = ["plan", "Plan"]


class _CallableModule(_types.ModuleType):
    """``poptorch.plan(...)`` is ``poptorch.plan.plan(...)``."""

    def __call__(self, *args, **kwargs) -> Plan:
        return plan(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
