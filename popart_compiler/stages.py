"""The compiler's products: an :class:`Executable` (a compiled program, ready for a
session) and the :class:`StagedGraph` of a program split into pipeline stages.

The stages of a compilation, as JAX names its own (``Traced → Lowered → Compiled``):
``poptorch`` captures a program (``Captured``), the compiler turns its
:class:`~popart_compiler.ir.Graph` into an :class:`Executable`, and a session
(:mod:`popart_compiler.runtime.session`) loads and runs it. Each prints itself with
``as_text()``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.fx as fx

from popart_compiler.cost.op_costs import merge_stages
from popart_compiler.ir import Graph
from popart_compiler.passes import placement
from popart_compiler.session_options import Anchor, SessionOptions, StrategySettings

__all__ = ["Executable", "StagedGraph"]


@dataclasses.dataclass
class StagedGraph:
    """A placed forward graph cut into one submodule per run of consecutive ops that
    share a pipeline stage (``torch.fx.passes.split_module``).

    Attributes:
        split: the split module (same signature and outputs as the graph); its
            submodules ``submod_<k>`` are the segments, in graph order.
        segment_stages: the pipeline stage id of each segment ``k``.
        pipelined: micro-batches flow through the stages as on a pipeline (else each
            micro-batch goes through every stage before the next starts).
        segment_ipus: the IPU of each segment (empty when unknown: every segment on
            its own IPU).
    """
    split: fx.GraphModule
    segment_stages: List[int]
    pipelined: bool
    segment_ipus: List[int] = dataclasses.field(default_factory=list)

    def units(self) -> List[int]:
        """The schedule unit of each segment: pipelined, one unit per stage (stages
        never decrease along the data flow, so a stage's segments only need earlier
        stages); otherwise one unit per segment."""
        if self.pipelined:
            ranks = {s: i for i, s in enumerate(sorted(set(self.segment_stages)))}
            return [ranks[s] for s in self.segment_stages]
        return list(range(len(self.segment_stages)))

    def merged_units(self) -> List[int]:
        """The merged pipeline stage of each segment, as PopART runs them
        (:func:`~popart_compiler.cost.op_costs.merge_stages`: consecutive stages on
        one IPU are one stage): the unit a process runs when the pipeline runs across
        processes (:mod:`popart_compiler.runtime.pipeline`). E.g. stages 0, 1, 2, 3 on
        IPUs 0, 0, 1, 0 → units 0, 0, 1, 2."""
        ipus = self.segment_ipus or list(range(len(self.segment_stages)))
        merged = merge_stages(list(zip(self.segment_stages, ipus)))
        return [merged[key] for key in zip(self.segment_stages, ipus)]

    def as_text(self) -> str:
        lines = [f"staged graph ({'pipelined' if self.pipelined else 'sequential'}, "
                 f"{len(self.segment_stages)} segments):"]
        for k, stage in enumerate(self.segment_stages):
            sub = getattr(self.split, f"submod_{k}")
            ops = sum(1 for n in sub.graph.nodes if n.op == "call_function")
            lines.append(f"  submod_{k}: stage {stage}, {ops} ops")
        return "\n".join(lines)


@dataclasses.dataclass
class Executable:
    """A compiled program, ready to be loaded by a session.

    Attributes:
        graph: the captured graph (its module is the per-micro-batch program; activation
            anchors follow the user outputs).
        options: the session options it was compiled with.
        training: whether it trains.
        loss_index: index of the final loss among the user outputs (training).
        num_ipus: IPUs the program occupies (per replica × replicas).
        activation_anchors: anchors read from graph outputs appended after the user
            outputs, in order.
        state_anchors: anchors on weights, gradients, updated weights or optimizer state.
        vectorized: for stateless inference, the graph over ``vectorized_slots``
            micro-batches at once (a run calls it for each chunk of that many).
        vectorized_slots: micro-batches per call of ``vectorized``.
        tensor_names: every tensor name of the program (docs/semantics.md S-16).
        compile_seconds: wall-clock time of the compilation.
        placement: where each op runs (IPU, pipeline stage, phase; docs/api-sections.md api §9);
            every node of ``module`` carries ``node.meta["placement"]``.
        stages: the program split by pipeline stage when it has several (run with
            the stage schedule, :mod:`popart_compiler.runtime.schedule`), else ``None``.
        runner: what runs one micro-batch: ``module`` itself on the eager backend, an
            op-by-op checking interpreter with floating-point exceptions, its Inductor
            compilation on the inductor backend.
        stage_runner: turns a stage's submodule into what runs it (``None``: call the
            submodule).
        alternative: the ``auto`` backend: builds the Inductor lowering
            (:class:`~popart_compiler.backends.auto.Lowering`, uncompiled) that a
            session compiles once the program is hot; ``None`` where it stays eager.
        estimate: the IPU Model's memory / cycle estimate
            (:mod:`popart_compiler.cost.cost_model`).
        passes: the compiler passes that ran, in order, and whether each changed the
            graph.
        defaults: the options PopTorch's compiler set because the user did not
            (:mod:`popart_compiler.implicit_defaults`); ``options`` includes them.
    """
    graph: Graph
    options: SessionOptions
    training: bool
    loss_index: Optional[int]
    num_ipus: int
    activation_anchors: List[Anchor]
    state_anchors: List[Anchor]
    vectorized: Optional[Callable]
    tensor_names: List[str]
    compile_seconds: float = 0.0
    vectorized_slots: int = 1
    placement: Optional[placement.PlacementPlan] = None
    stages: Optional[StagedGraph] = None
    runner: Optional[Callable] = None
    stage_runner: Optional[Callable[[fx.GraphModule], Callable]] = None
    alternative: Optional[Callable[[], Any]] = None
    estimate: Any = None
    passes: List[Tuple[str, bool]] = dataclasses.field(default_factory=list)
    defaults: Tuple[Any, ...] = ()

    @property
    def module(self) -> fx.GraphModule:
        return self.graph.module

    @property
    def staged(self) -> bool:
        """The program has several stages (run with the stage schedule)."""
        return self.stages is not None

    @property
    def num_user_outputs(self) -> int:
        return self.graph.num_user_outputs

    def placement_summary(self, backward: bool = True) -> str:
        """The placement as a readable table: one row per (IPU, stage, phase) with the
        forward op count, the backward op count (training), and the number and bytes
        of the parameters updated there (docs/api-sections.md api §9).

        Args:
            backward: training only: count the backward ops in the joint
                forward/backward graph (built with ``aot_export_joint_with_descriptors``
                for this report; about 0.1 s for a small model). ``False`` or a graph
                that cannot be differentiated ahead of time shows ``-``.
        """
        plan = self.placement or placement.plan_placement(
            self.module, self.graph.blocks, self.graph.parameters, StrategySettings(),
            self.training)
        joint = self.joint_graph() if self.training and backward else None
        return placement.placement_table(self.module, plan, self.graph.parameters, joint)

    def joint_graph(self) -> Optional[fx.GraphModule]:
        """The joint forward/backward graph of a training program with every node
        placed (:func:`placement.place_joint_graph`), or ``None`` when it cannot be
        built ahead of time. Only for reports: training runs autograd on ``module``."""
        if not self.training or self.placement is None:
            return None
        return placement.joint_graph(self.graph, self.placement)

    def as_text(self) -> str:
        """The compiled program as text: a summary (kind, backend, IPUs, stages,
        anchors, the passes that ran), then the graph (:meth:`Graph.as_text`)."""
        o = self.options
        kind = "training" if self.training else "inference"
        head: Dict[str, Any] = {
            "backend": o.backend_key, "ipus": self.num_ipus,
            "batching": f"D={o.device_iterations} A={o.gradient_accumulation} "
                        f"R={o.replication_factor}",
            "output mode": o.output_mode.name,
        }
        if self.training:
            head["loss output"] = self.loss_index
        if self.vectorized is not None:
            head["vectorized"] = f"{self.vectorized_slots} micro-batches per call"
        if self.activation_anchors or self.state_anchors:
            head["anchors"] = ", ".join(a.name for a in
                                        self.activation_anchors + self.state_anchors)
        if self.passes:
            head["passes"] = ", ".join(f"{n}{'*' if changed else ''}"
                                       for n, changed in self.passes)
        lines = [f"executable ({kind}):"] + [f"  {k}: {v}" for k, v in head.items()]
        if self.stages is not None:
            lines.append(self.stages.as_text())
        lines.append(self.graph.as_text())
        return "\n".join(lines)
