"""What every compiler pass is: a named function from graph to graph.

A pass takes the :class:`~popart_compiler.ir.Graph` and the :class:`Compilation` (what
the compilation was asked for, and what earlier passes derived) and returns a
:class:`PassResult`: the graph, whether it changed, and the compilation with what the
pass derived. The :class:`Compilation` is frozen: a pass never writes into it, it
returns a new one (:func:`derived`, ``dataclasses.replace``), and
:func:`popart_compiler.compiler.compile` hands that one to the next pass. A pass that
rewrites the graph does so in place and says so (``changed``; metadata such as
``node.meta["placement"]`` is no change); a check raises ``Error`` or returns the graph
unchanged (:func:`unchanged`); an analysis returns its facts (anchors, placement,
stages, the vectorized graph, the estimate) and reports no change. Passes write no
files and build nothing a backend runs: the compiler copies the last compilation into
the plain-data :class:`~popart_compiler.stages.Executable`, and the runtime lowers it
(:mod:`popart_compiler.runtime.lowering`) and writes the reports. Each pass may state
what it ensures (:attr:`Pass.ensures`), which :func:`popart_compiler.verify.verify`
checks after it, on the compilation it returned, when ``POPTORCH_VERIFY=1``. The
compiler runs :data:`~popart_compiler.compiler.PASSES` in order (torch.fx's
``PassBase`` / ``PassResult`` and ``requires`` / ``ensures`` in spirit).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch.fx as fx

from popart_compiler.implicit_defaults import ImplicitDefault
from popart_compiler.ir import Graph
from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.session_options import Anchor, SessionOptions

if TYPE_CHECKING:  # these modules import this one
    from popart_compiler.cost.cost_model import IpuEstimate
    from popart_compiler.passes.placement import PlacementPlan
    from popart_compiler.stages import StagedGraph

__all__ = ["Pass", "PassResult", "Compilation", "unchanged", "derived"]


@dataclasses.dataclass(frozen=True)
class Compilation:
    """One compilation: its inputs and the facts its passes derive. Frozen: a pass
    returns a new one with what it derived (:func:`derived`), never writes into it.

    Attributes:
        options: the session options.
        training: compile forward, backward and weight update.
        optimizer: the optimizer description of a training program (its state counts
            in the memory estimate), else ``None``.
        loss_index: index of the final loss among the user outputs (``check_loss``).
        activation_anchors: anchors on activations, appended to the graph's outputs
            after the user outputs, in order (``resolve_anchors``).
        state_anchors: anchors on weights, gradients and optimizer state.
        tensor_names: every tensor name of the program (``name_tensors``, docs/semantics.md S-16).
        placement: where each op runs (``place``).
        stages: the program split by pipeline stage, when it has several
            (``split_stages``).
        vectorized: stateless inference: the graph over ``vectorized_slots``
            micro-batches at once, uncompiled (``vectorize``).
        vectorized_slots: micro-batches per call of ``vectorized``.
        estimate: the IPU Model's memory and cycles (``estimate``).
        defaults: the options PopTorch's compiler set because the user did not
            (``session_defaults``, in PopTorch's order).
    """
    options: SessionOptions
    training: bool
    optimizer: Optional[OptimizerDescription] = None
    loss_index: Optional[int] = None
    activation_anchors: List[Anchor] = dataclasses.field(default_factory=list)
    state_anchors: List[Anchor] = dataclasses.field(default_factory=list)
    tensor_names: List[str] = dataclasses.field(default_factory=list)
    placement: Optional[PlacementPlan] = None
    stages: Optional[StagedGraph] = None
    vectorized: Optional[fx.GraphModule] = None
    vectorized_slots: int = 1
    estimate: Optional[IpuEstimate] = None
    defaults: Tuple[ImplicitDefault, ...] = ()


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What a pass returns.

    Attributes:
        graph: the graph after the pass.
        changed: whether the pass changed the graph (its nodes, their order or their
            arguments; metadata such as ``node.meta["placement"]`` is no change).
        compilation: the compilation with what the pass derived; ``None``: the pass
            derived nothing (the one it was given holds).
    """
    graph: Graph
    changed: bool
    compilation: Optional[Compilation] = None

    def after(self, given: Compilation) -> Compilation:
        """The compilation the next pass gets: :attr:`compilation`, else ``given``."""
        return given if self.compilation is None else self.compilation


def unchanged(graph: Graph) -> PassResult:
    """The result of a pass that only checked ``graph``: no change, nothing derived."""
    return PassResult(graph, False)


def derived(graph: Graph, c: Compilation, **facts) -> PassResult:
    """The result of an analysis: ``graph`` unchanged, ``c`` with ``facts`` (fields of
    :class:`Compilation`, e.g. ``placement=plan``) replaced.

    Raises:
        TypeError: a name in ``facts`` is no field of :class:`Compilation`.
    """
    return PassResult(graph, False, dataclasses.replace(c, **facts))


def _nothing(graph: Graph, compilation: Compilation) -> Optional[str]:
    """The postcondition of a pass that states none: always holds."""
    return None


@dataclasses.dataclass(frozen=True)
class Pass:
    """A named pass (``run(graph, compilation) -> PassResult``).

    Attributes:
        name: the pass's name (its function's).
        run: the pass.
        ensures: what holds after the pass (torch.fx's ``ensures``): returns ``None``
            when it holds, else what does not (:mod:`popart_compiler.ensures`);
            :func:`~popart_compiler.verify.verify` checks it after the pass.
    """
    name: str
    run: Callable[[Graph, Compilation], PassResult]
    ensures: Callable[[Graph, Compilation], Optional[str]] = _nothing

    @classmethod
    def of(cls, run: Callable[[Graph, Compilation], PassResult],
           ensures: Optional[Callable[[Graph, Compilation], Optional[str]]] = None
           ) -> "Pass":
        """The pass named after its function (``ensures``: its postcondition)."""
        return cls(run.__name__, run, ensures or _nothing)

    def __call__(self, graph: Graph, compilation: Compilation) -> PassResult:
        return self.run(graph, compilation)
