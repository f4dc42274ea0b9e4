"""What every compiler pass is: a named function from graph to graph.

A pass takes the :class:`~popart_compiler.ir.Graph` and the :class:`Compilation` (what
the compilation was asked for, and what earlier passes derived) and returns a
:class:`PassResult`: the graph and whether it changed. A pass that rewrites the graph
does so in place and says so; a check raises ``Error`` or returns the graph unchanged;
an analysis records its result on the :class:`Compilation` (anchors, placement, stages,
the vectorized graph, the runners, the estimate). The compiler
(:func:`popart_compiler.compiler.compile`) runs :data:`~popart_compiler.compiler.PASSES`
in order (torch.fx's ``PassBase`` / ``PassResult`` in spirit).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import torch.fx as fx

from popart_compiler.ir import Graph
from popart_compiler.session_options import Anchor, SessionOptions

__all__ = ["Pass", "PassResult", "Compilation", "unchanged"]


@dataclasses.dataclass
class PassResult:
    """The graph after a pass and whether the pass changed it."""
    graph: Graph
    changed: bool


def unchanged(graph: Graph) -> PassResult:
    """The result of a pass that only checked or analysed ``graph``."""
    return PassResult(graph, False)


@dataclasses.dataclass
class Compilation:
    """One compilation: its inputs and the facts its passes derive.

    Attributes:
        options: the session options.
        training: compile forward, backward and weight update.
        optimizer: the ``OptimizerDescription`` of a training program (its state counts
            in the memory estimate), else ``None``.
        loss_index: index of the final loss among the user outputs (``check_loss``).
        activation_anchors: anchors on activations, appended to the graph's outputs
            after the user outputs, in order (``resolve_anchors``).
        state_anchors: anchors on weights, gradients and optimizer state.
        tensor_names: every tensor name of the program (``name_tensors``, docs/semantics.md S-16).
        placement: the ``PlacementPlan`` (``place``).
        stages: the ``StagedGraph`` of a multi-stage program (``split_stages``).
        vectorized: stateless inference: the graph over ``vectorized_slots``
            micro-batches at once (``vectorize``).
        vectorized_slots: micro-batches per call of ``vectorized``.
        runner: what runs one micro-batch (``lower``).
        stage_runner: turns a stage's submodule into what runs it (``lower``).
        alternative: the ``auto`` backend: builds the Inductor lowering
            (``lower.inductor_lowering``), ``None`` where the program stays eager.
        estimate: the IPU Model's ``IpuEstimate`` (``estimate``).
        defaults: the options PopTorch's compiler set because the user did not
            (``session_defaults``; each an ``ImplicitDefault``, in PopTorch's order).
    """
    options: SessionOptions
    training: bool
    optimizer: Any = None
    loss_index: Optional[int] = None
    activation_anchors: List[Anchor] = dataclasses.field(default_factory=list)
    state_anchors: List[Anchor] = dataclasses.field(default_factory=list)
    tensor_names: List[str] = dataclasses.field(default_factory=list)
    placement: Any = None
    stages: Any = None
    vectorized: Optional[fx.GraphModule] = None
    vectorized_slots: int = 1
    runner: Optional[Callable] = None
    stage_runner: Optional[Callable[[fx.GraphModule], Callable]] = None
    alternative: Optional[Callable[[], Any]] = None
    estimate: Any = None
    defaults: Tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Pass:
    """A named pass (``run(graph, compilation) -> PassResult``)."""
    name: str
    run: Callable[[Graph, Compilation], PassResult]

    @classmethod
    def of(cls, run: Callable[[Graph, Compilation], PassResult]) -> "Pass":
        """The pass named after its function."""
        return cls(run.__name__, run)

    def __call__(self, graph: Graph, compilation: Compilation) -> PassResult:
        return self.run(graph, compilation)
