"""Placement of a captured graph on IPUs, pipeline stages and phases (docs/api-sections.md api §9,
docs/semantics.md S-60, S-63, S-64, S-65).

The capture tags every forward op with the block that was active when the op was
created (``node.meta["custom"][BLOCK_KEY]``: the block id, or ``None`` before the
first block) or with ``node.meta["custom"][NO_ACTIVE_BLOCK_KEY] = True`` when it was
created after a ``with Block`` scope ended. The caller also gives the
:class:`Placement` of each block (derived from the execution strategy at capture
time, docs/api-sections.md api §9.7). :func:`place_nodes` is the graph → graph pass
that turns the
tags into ``node.meta["placement"]`` on every node; :func:`plan_placement` runs it and the
execution-strategy checks and returns a :class:`PlacementPlan`.

Contract with the cost model: every fx node of a compiled graph carries
``node.meta["placement"]`` (a :class:`Placement`); readers treat a missing entry as
``Placement(0, 0, 0)``.

Backward and optimizer ops: training runs PyTorch autograd on the forward graph, so
there is no backward graph to execute. Their placement is derived the way PopART
places them: the backward of an op runs on the op's IPU, in the mirrored pipeline
stage (``2(docs/semantics.md S-1) - s`` for ``S`` stages: the last forward stage also runs the first
backward stage, docs/semantics.md S-63) and in the mirrored phase (docs/semantics.md S-65); a
parameter's optimizer update runs where its gradient is complete (the backward placement of the
parameter). :func:`place_joint_graph` applies this to the joint forward/backward graph built for
reports.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

from popart_compiler.cost.ipu_model import MAX_IPUS
from popart_compiler.enums import ExecutionMode, Liveness
from popart_compiler.errors import backend_error
from popart_compiler.ir import Graph
from popart_compiler.logging import logger
from popart_compiler.passes.base import Compilation, PassResult, derived
from popart_compiler.session_options import StrategySettings

__all__ = ["Placement", "PlacementPlan", "BLOCK_KEY",
           "NO_ACTIVE_BLOCK_KEY", "place_nodes", "plan_placement", "place_joint_graph",
           "placement_of", "joint_graph", "placement_table", "log_placement", "place"]

#: ``node.meta["custom"]`` key holding the id of the block active when the op was
#: created (``None``: before the first block).
BLOCK_KEY = "ipu_block"
#: ``node.meta["custom"]`` key set to ``True`` on ops created while no block was
#: active (after a ``with Block`` scope ended, docs/semantics.md S-60).
NO_ACTIVE_BLOCK_KEY = "ipu_no_active_block"


@dataclasses.dataclass(frozen=True, order=True)
class Placement:
    """Where an op runs: IPU (per replica), pipeline stage and execution phase."""
    ipu: int = 0
    stage: int = 0
    phase: int = 0


_ORIGIN = Placement()


def placement_of(node: fx.Node) -> Placement:
    """``node.meta["placement"]``, or ``Placement(0, 0, 0)`` when absent."""
    return node.meta.get("placement", _ORIGIN)


#: ``Liveness`` modes only serial phased execution supports (docs/semantics.md S-65).
_SERIAL_ONLY_LIVENESS = (Liveness.OffChipAfterFwdNoOverlap, Liveness.OffChipAfterEachPhase)


# -- the pass ---------------------------------------------------------------------------

def _ops(graph: fx.Graph) -> Iterable[fx.Node]:
    return (n for n in graph.nodes if n.op in ("call_function", "call_module", "call_method"))


def _is_check(node: fx.Node) -> bool:
    """A check the tracer records (no output any op reads): ``_assert_*``."""
    name = getattr(node.target, "__name__", str(node.target))
    return name.startswith("_assert") and not node.users


def place_nodes(gm: fx.GraphModule, blocks: Dict[str, Placement]) -> fx.GraphModule:
    """Write ``node.meta["placement"]`` on every node of ``gm`` (forward graph).

    Ops take the placement of the block in force when they run, as PopTorch places
    them: their block's (ops before the first block: IPU 0, stage 0, phase 0,
        docs/semantics.md S-60).
    An op tagged "before the first block" that runs after a block started, and the
    tracer's checks (``_assert_tensor_metadata``, ``_assert_scalar``: the tracer may
    record them with the metadata of the tensor they check, created earlier), take the
    placement of the op before them: an op after the last ``BeginBlock`` that reads
    only the user's inputs stays in that block. Ops without a block tag (created by the tracer
    outside ``forward``, or checks such as ``_assert_tensor_metadata`` that the tracer records
    without the capture's metadata) take the latest placement of their inputs, or, reading only
    graph inputs, the placement of the op before them; placeholders and ``get_attr`` nodes take the
    placement of their first user; the output node the latest placement of its inputs.

    Args:
        gm: a captured graph module whose ops carry the capture's block tags.
        blocks: block id → placement.

    Returns:
        ``gm`` (modified in place).

    Raises:
        Error: "No active Block, all the ops must belong to a Block" (docs/semantics.md S-60).
    """
    graph = gm.graph
    previous = _ORIGIN
    started = False  # a block has started
    for node in _ops(graph):
        custom = node.meta.get("custom") or {}
        if custom.get(NO_ACTIVE_BLOCK_KEY):
            raise backend_error(
                "No active Block, all the ops must belong to a Block: the op "
                f"{node.name} is created after a `with poptorch.Block(...)` scope ended. "
                "Put it inside a block, or start one with poptorch.Block.start(...) or "
                "poptorch.BeginBlock.")
        if _is_check(node) or (started and custom.get(BLOCK_KEY, False) is None):
            node.meta["placement"] = previous  # the block in force where it runs
            continue
        if BLOCK_KEY in custom:
            block = custom[BLOCK_KEY]
            started = started or block is not None
            if block is not None and str(block) not in blocks:
                raise backend_error(
                    f"The op {node.name} belongs to block '{block}', which has no "
                    f"placement (known blocks: {list(blocks)}). Capture the model again "
                    "so that its blocks are recorded.")
            node.meta["placement"] = previous = (_ORIGIN if block is None
                                                 else blocks[str(block)])
            continue
        inputs = [placement_of(a) for a in node.all_input_nodes if a.op != "placeholder"
                  and "placement" in a.meta]
        node.meta["placement"] = previous = max(
            inputs, key=lambda p: (p.stage, p.phase, p.ipu), default=previous)
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            users = [u for u in node.users if "placement" in u.meta]
            node.meta["placement"] = placement_of(users[0]) if users else _ORIGIN
        elif node.op == "output":
            inputs = [placement_of(a) for a in node.all_input_nodes]
            node.meta["placement"] = max(inputs, key=lambda p: (p.stage, p.phase, p.ipu),
                                         default=_ORIGIN)
    return gm


# -- the plan and its checks ------------------------------------------------------------

@dataclasses.dataclass
class PlacementPlan:
    """The placement of a compiled program.

    Attributes:
        strategy: the execution strategy.
        training: forward, backward and weight update (else forward only).
        blocks: block id → placement, in order of first use.
        stages: distinct forward stage ids, ascending.
        forward_stages: ``F`` of docs/semantics.md S-63: 1 + the number of IPU changes between
            consecutive ops in capture order (1 without multi-IPU pipelining).
        ipus_per_replica: ``max(#distinct IPUs, highest IPU + 1)`` (docs/semantics.md S-64).
        num_phases: forward phases (phased execution; 1 otherwise).
        parameters: parameter name → placement of its forward consumer.
    """
    strategy: StrategySettings
    training: bool
    blocks: Dict[str, Placement]
    stages: Tuple[int, ...]
    forward_stages: int
    ipus_per_replica: int
    num_phases: int
    parameters: Dict[str, Placement]

    @property
    def pipelined(self) -> bool:
        """Several stages run as a pipeline (``PipelinedExecution`` over > 1 IPU)."""
        return self.strategy.mode is ExecutionMode.Pipelined and self.forward_stages > 1

    @property
    def pipeline_stages(self) -> int:
        """Pipeline stages of the program: ``2F − 1`` in training, ``F`` in inference."""
        return 2 * self.forward_stages - 1 if self.training else self.forward_stages

    def backward(self, placement: Placement) -> Placement:
        """Placement of the backward of an op placed at ``placement``: same IPU,
        mirrored pipeline stage (pipelined over several IPUs; otherwise the same
        stage) and mirrored phase (phased, docs/semantics.md S-65)."""
        stage, phase = placement.stage, placement.phase
        if self.pipelined:
            rank = self.stages.index(stage) if stage in self.stages else 0
            stage = self.stages[-1] + (len(self.stages) - 1 - rank)
        if self.strategy.mode is ExecutionMode.Phased:
            p = self.num_phases
            phase = 2 * p - phase if self.strategy.separate_backward_phase \
                else 2 * (p - 1) - phase
        return Placement(placement.ipu, stage, phase)

    def optimizer(self, parameter: str) -> Placement:
        """Placement of ``parameter``'s weight update: where its gradient is complete
        (the backward placement of its forward consumer)."""
        return self.backward(self.parameters.get(parameter, _ORIGIN))


def _forward_stage_count(gm: fx.GraphModule) -> int:
    """``F`` of docs/semantics.md S-63: 1 + IPU changes between consecutive ops in capture order."""
    changes, last = 0, None
    for node in _ops(gm.graph):
        ipu = placement_of(node).ipu
        if last is not None and ipu != last:
            changes += 1
        last = ipu
    return 1 + changes


def _check_stage_order(gm: fx.GraphModule, block_of: Dict[fx.Node, str]) -> None:
    """Pipelining: stage ids never decrease along the data flow (docs/semantics.md S-63)."""
    for node in _ops(gm.graph):
        stage = placement_of(node).stage
        for arg in node.all_input_nodes:
            if arg.op == "placeholder":
                continue
            if placement_of(arg).stage > stage:
                raise backend_error(
                    f"Pipeline stage ordering error: op {node.name} (block "
                    f"'{block_of.get(node, '?')}', stage {stage}) consumes {arg.name} "
                    f"(block '{block_of.get(arg, '?')}', stage "
                    f"{placement_of(arg).stage}), a later stage. With pipelining, stages "
                    "must run in increasing order along the data flow: with "
                    "AutoStage.SameAsIpu returning to an earlier IPU makes an earlier "
                    "stage, so use poptorch.PipelinedExecution(poptorch.AutoStage."
                    "AutoIncrement) or list the stages explicitly.")


def _check_pipeline_batches(plan: PlacementPlan, device_iterations: int,
                            gradient_accumulation: int) -> None:
    """Pipelined training needs ``A ≥ 2F − 1``, inference ``D ≥ F`` (docs/semantics.md
    S-63)."""
    f = plan.forward_stages
    if plan.training and gradient_accumulation < 2 * f - 1:
        # PopTorch's wording (its tests match it), then the value that was set
        raise backend_error(
            "poptorch.Options().Training.gradientAccumulation must be greater than or "
            f"equal to the number of pipeline stages ({2 * f - 1}) when using "
            "poptorch.PipelinedExecution. Please note that a model with "
            f"{f} pipeline stages in PopTorch will have an additional {f - 1} stages "
            f"when training. Currently it is set to {gradient_accumulation}.")
    if not plan.training and device_iterations < f:
        raise backend_error(
            "poptorch.Options().deviceIterations must be greater than or equal to the "
            f"number of pipeline stages ({f}) when using PopTorch.PipelinedExecution. "
            f"Currently it is set to {device_iterations}.")


def _check_phases(plan: PlacementPlan) -> None:
    """Phased execution: parity of phases and IPUs, liveness modes (docs/semantics.md S-65)."""
    s = plan.strategy
    if s.serial_phases:
        return
    if s.liveness in _SERIAL_ONLY_LIVENESS:
        raise backend_error(
            f"Liveness.{s.liveness.name}: This is only supported for serial "
            "phase execution. Use poptorch.SerialPhasedExecution for this liveness.")
    for block, p in plan.blocks.items():
        if p.phase % 2 != p.ipu % 2:
            raise backend_error(
                "When phases are executed in parallel: even phases must run on even IPUs "
                f"and odd phases on odd IPUs. Block '{block}' is in phase {p.phase} on "
                f"IPU {p.ipu}: change the IPUs with Phase.ipus(...) or Stage.ipu(...).")


def _check_ipus(plan: PlacementPlan, replicas: int) -> None:
    for block, p in plan.blocks.items():
        if p.ipu < 0:
            raise backend_error(f"Block '{block}' is placed on IPU {p.ipu}: IPU ids must "
                                "be non-negative. Change the block's ipu_id.")
    total = plan.ipus_per_replica * replicas
    if total > MAX_IPUS:
        highest = max(plan.blocks.items(), key=lambda kv: kv[1].ipu, default=None)
        where = (f" (block '{highest[0]}' is on IPU {highest[1].ipu}: "
                 f"{plan.ipus_per_replica} IPU(s) per replica × {replicas} replica(s))"
                 if highest else "")
        raise backend_error(
            f"Too many IPUs requested ({total}){where}. Experiments that need more than "
            f"{MAX_IPUS} IPUs require distributed execution (Options.Distributed); "
            "otherwise lower the blocks' ipu_id or the replication factor.")


def plan_placement(gm: fx.GraphModule, blocks: Dict[str, Placement],
                   parameters: Sequence[str], strategy: StrategySettings, training: bool,
                   device_iterations: int = 1, gradient_accumulation: int = 1,
                   replicas: int = 1) -> PlacementPlan:
    """Place ``gm`` (:func:`place_nodes`) and check the execution strategy's rules.

    Args:
        gm: the captured forward graph (placeholders: parameters first, in the order
            of ``parameters``).
        blocks: block id → placement, in order of first use.
        parameters: parameter names in placeholder order.
        strategy: the execution strategy.
        training: the program trains (pipelined training needs ``A ≥ 2F − 1``).
        device_iterations / gradient_accumulation / replicas: ``D``, ``A``, ``R``.

    Returns:
        The :class:`PlacementPlan`.

    Raises:
        Error: "No active Block ..." (docs/semantics.md S-60); pipeline stage ordering,
            ``gradientAccumulation`` / ``deviceIterations`` below the number of
            pipeline stages (docs/semantics.md S-63); "Too many IPUs requested (<n>)"
            (docs/semantics.md S-64); phase / IPU parity or a liveness mode of parallel phased
            execution (docs/semantics.md S-65).
    """
    place_nodes(gm, blocks)
    used = {placement_of(n) for n in _ops(gm.graph)} or {_ORIGIN}
    ipus = {p.ipu for p in used}
    stages = tuple(sorted({p.stage for p in used}))
    phases = {p.phase for p in used}
    multi_ipu = len(ipus) > 1
    forward_stages = _forward_stage_count(gm) if multi_ipu and \
        strategy.mode is ExecutionMode.Pipelined else 1
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = {name: placement_of(node) for name, node in zip(parameters, placeholders)}
    plan = PlacementPlan(strategy, training, dict(blocks), stages, forward_stages,
                         max(len(ipus), max(ipus) + 1), max(phases) + 1, params)
    _check_ipus(plan, replicas)
    if plan.pipelined:
        block_of = {n: str((n.meta.get("custom") or {}).get(BLOCK_KEY)) for n in _ops(gm.graph)}
        _check_stage_order(gm, block_of)
        _check_pipeline_batches(plan, device_iterations, gradient_accumulation)
    if strategy.mode is ExecutionMode.Phased:
        _check_phases(plan)
    return plan


def place_joint_graph(joint: fx.GraphModule, plan: PlacementPlan) -> fx.GraphModule:
    """Place the ops of a joint forward/backward graph (``aot_export_joint_with_
    descriptors`` output, whose backward ops carry their forward op's block tag):
    forward ops as :func:`place_nodes`, backward ops (``partitioner_tag ==
    "is_backward"``) at :meth:`PlacementPlan.backward` of their forward placement."""
    place_nodes(joint, plan.blocks)
    for node in _ops(joint.graph):
        if node.meta.get("partitioner_tag") == "is_backward" or \
                node.meta.get("autograd_backward"):
            node.meta["placement"] = plan.backward(placement_of(node))
            node.meta["ipu_backward"] = True
    return joint


class _Flat(torch.nn.Module):
    """``graph.module`` with its state as module attributes (for AOTAutograd)."""

    def __init__(self, graph, state: Sequence[torch.Tensor]):
        super().__init__()
        self.gm = graph.module
        n = len(graph.parameters)
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(t.detach().clone(), requires_grad=bool(trainable))
            for t, trainable in zip(state[:n], graph.trainable))
        self.rest = list(state[n:])

    def forward(self, *inputs):
        # The interpreter sets each node's metadata as the current one, so the traced
        # ops keep their block tags.
        return fx.Interpreter(self.gm).run(*self.params, *self.rest, *inputs)


def joint_graph(graph, plan: PlacementPlan) -> Optional[fx.GraphModule]:
    """The joint forward/backward graph of ``graph`` (an ``ir.Graph``) traced by
    ``aot_export_joint_with_descriptors`` and placed with :func:`place_joint_graph`;
    ``None`` when AOTAutograd cannot trace it (the report then shows no backward
    op counts)."""
    values = graph.state_values()
    names = graph.parameters + graph.buffers + graph.constants
    try:
        state = [values[n] for n in names]
        inputs = [torch.zeros(i.shape, dtype=i.dtype) for i in graph.user_inputs]
        with contextlib.ExitStack() as stack, torch.fx.traceback.preserve_node_meta():
            joint = aot_export_joint_with_descriptors(stack, _Flat(graph, state),
                                                      tuple(inputs))
            return place_joint_graph(joint.graph_module, plan)
    except Exception as exc:  # a report must not fail the program
        logger.debug("No joint forward/backward graph for the placement report: %s", exc)
        return None


# -- the readable table -----------------------------------------------------------------

def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def placement_table(gm: fx.GraphModule, plan: PlacementPlan, parameters: Sequence[str],
                    joint: Optional[fx.GraphModule] = None) -> str:
    """The placement as a text table: one row per (IPU, stage, phase) with the
    forward op count, the backward op count (training, from ``joint``; ``-`` when no
    joint graph is given), and the number and bytes of the parameters whose weight
    update runs there."""
    rows: Dict[Placement, List[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])
    for node in _ops(gm.graph):
        rows[placement_of(node)][0] += 1
    if joint is not None:
        for node in _ops(joint.graph):
            if node.meta.get("ipu_backward"):
                rows[placement_of(node)][1] += 1
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for name, node in zip(parameters, placeholders):
        where = plan.optimizer(name) if plan.training else placement_of(node)
        rows[where][2] += 1
        rows[where][3] += _bytes(node)
    header = ["IPU", "stage", "phase", "fwd ops", "bwd ops", "params", "param bytes"]
    lines = [header]
    for p in sorted(rows, key=lambda p: (p.ipu, p.stage, p.phase)):
        fwd, bwd, count, size = rows[p]
        bwd_text = str(bwd) if joint is not None else ("-" if plan.training else "0")
        lines.append([str(p.ipu), str(p.stage), str(p.phase), str(fwd), bwd_text,
                      str(count), str(size)])
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    text = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in lines]
    mode = plan.strategy.mode.name
    title = (f"Placement ({mode}, {plan.ipus_per_replica} IPU(s) per replica, "
             f"{plan.pipeline_stages if plan.pipelined else len(plan.stages)} stage(s)"
             + (f", {plan.num_phases} phase(s)" if plan.strategy.mode ==
                ExecutionMode.Phased else "") + ")")
    return "\n".join([title] + text)


def log_placement(text: str) -> None:
    """Log the placement table at DEBUG."""
    for line in text.splitlines():
        logger.debug("%s", line)


def place(graph: Graph, c: Compilation) -> PassResult:
    """Place every node (:func:`plan_placement`) and return the plan as ``placement``
    on the compilation; the placement table is logged at DEBUG. Only metadata is written
    (``node.meta["placement"]``): the graph is unchanged."""
    o = c.options
    plan = plan_placement(graph.module, graph.blocks, graph.parameters, o.strategy,
                          c.training, device_iterations=o.device_iterations,
                          gradient_accumulation=o.gradient_accumulation,
                          replicas=o.replication_factor)
    if logger.isEnabledFor(logging.DEBUG):
        log_placement(placement_table(graph.module, plan, graph.parameters, None))
    return derived(graph, c, placement=plan)
