"""The planner's one capture of a model, and the model changes a plan makes.

The model is captured as a training (or inference) executor captures it, with, for the
duration of the capture only:

* a block (``poptorch.BeginBlock``, ``AutoStage.AutoIncrement``, all on IPU 0) at the
  start of every unit's module, so that the placement pass records each op's unit
  (:mod:`popart_compiler.planner.units`); the model's own ``BeginBlock``\\ s are set
  aside;
* a ``poptorch.recomputationCheckpoint`` on every tensor output of every repeated
  layer (:func:`checkpoint_outputs`), each tagged as the planner's;
* every vocabulary projection computed by :class:`SerializedLinear` (factor 1).

The executor's compile entry then compiles it up to (not including) the estimate, and
the program is costed twice: with the checkpoints (*A*) and with them removed from the
graph (*B*) (:class:`popart_compiler.planner.variants.Variants`). A plan applied to the
model (:mod:`.apply`) makes the same changes with its own choices, so that compiling it
gives the plan's estimate.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
import torch.nn as nn

from popart_compiler.cost.cost_model import cycle_settings, memory_settings
from popart_compiler.cost.ipu_model import target_for
from popart_compiler.cost.op_costs import collect, steering_op, with_serialization
from popart_compiler.ir import Graph
from popart_compiler.planner.problem import DEFAULT_PROPORTIONS, Problem
from popart_compiler.planner.units import check_blocks, find_units
from popart_compiler.planner.variants import Variants
from poptorch import enums
from poptorch._executor import compile as compile_
from poptorch._executor import wrapping
from poptorch._executor.state import executor_options
from poptorch._ops.blocks import _BeginBlockHook
from poptorch._ops.compiler_hints import recomputationCheckpoint, serializedMatMul
from poptorch._options.execution_strategy import PipelinedExecution
from poptorch._plan.structure import repeated_layers, unit_modules, vocabulary_projections
from poptorch.options import Options

__all__ = ["Planning", "capture_for_planning", "checkpoint_outputs", "SerializedLinear",
           "PLAN_MARKER"]

#: ``node.meta["custom"]`` key on the planner's checkpoint markers.
PLAN_MARKER = "poptorch_plan_checkpoint"
#: The compiler pass the planner's compilation stops after: the one before the
#: estimate, which the planner makes itself for each candidate.
_LAST_PASS = "vectorize"


class SerializedLinear(nn.Module):
    """A vocabulary projection computed with ``poptorch.serializedMatMul`` over its
    output channels (Graphcore's serialised decoder / LM head). It holds the original
    ``nn.Linear``'s parameters (a tied weight stays tied).

    Args:
        linear: the ``nn.Linear`` (its ``weight`` ``[out, in]`` and ``bias``).
        factor: serial pieces; divides ``out_features``.
    """

    def __init__(self, linear: nn.Linear, factor: int):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.factor = factor
        self.original = [linear]  # a list: not a sub-module

    def forward(self, x):
        y = serializedMatMul(x, self.weight.t(), enums.MatMulSerializationMode.OutputChannels,
                             self.factor)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
            f"factor={self.factor}"


def checkpoint_outputs(tagged: bool = False):
    """A forward hook putting ``poptorch.recomputationCheckpoint`` on every tensor
    output of a module that is not one of its inputs (``tagged``: the markers carry
    :data:`PLAN_MARKER`)."""
    def hook(module, inputs, output):
        seen = {id(t) for t in inputs if isinstance(t, torch.Tensor)}

        def mark(t):
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                return t
            if not tagged:
                return recomputationCheckpoint(t)
            custom = torch.fx.traceback.current_meta.setdefault("custom", {})
            custom[PLAN_MARKER] = True
            try:
                return recomputationCheckpoint(t)
            finally:
                custom.pop(PLAN_MARKER, None)
        if isinstance(output, torch.Tensor):
            return mark(output)
        if isinstance(output, (tuple, list)) and not hasattr(output, "_fields"):
            return type(output)(mark(o) for o in output)
        return output
    return hook


def _swap(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, name)
    setattr(parent, name, module)
    return old


@contextlib.contextmanager
def planning_changes(model: nn.Module, units: Sequence[str], layers: Sequence[str],
                     heads: Sequence[str]) -> Iterator[None]:
    """The capture-only changes of the module docstring, undone on exit."""
    saved_pre = {m: dict(m._forward_pre_hooks) for m in model.modules()}
    handles = []
    swapped: List[Tuple[str, nn.Module]] = []
    try:
        for m in model.modules():
            for key in [k for k, h in m._forward_pre_hooks.items()
                        if isinstance(h, _BeginBlockHook)]:
                del m._forward_pre_hooks[key]
        for path in heads:
            swapped.append((path, _swap(model, path, SerializedLinear(
                model.get_submodule(path), 1))))
        for path in units:
            handles.append(model.get_submodule(path).register_forward_pre_hook(
                _BeginBlockHook(path, 0)))
        for path in layers:
            handles.append(model.get_submodule(path).register_forward_hook(
                checkpoint_outputs(tagged=True)))
        yield
    finally:
        for path, old in reversed(swapped):
            _swap(model, path, old)
        for h in handles:
            h.remove()
        for m, hooks in saved_pre.items():
            m._forward_pre_hooks.clear()
            m._forward_pre_hooks.update(hooks)


@dataclasses.dataclass
class Planning:
    """A model captured for planning.

    Attributes:
        problem: what the search places (:class:`~popart_compiler.planner.problem.Problem`).
        layers / heads: paths of the repeated layers and vocabulary projections.
        head_ops: vocabulary projection path → the name of its matmul op.
        options: the ``SessionOptions`` of the user's options.
        optimizer: the ``OptimizerDescription`` (training) or ``None``.
        micro_batch: samples per micro-batch.
    """
    problem: Problem
    layers: List[str]
    heads: Dict[str, Tuple[int, ...]]
    head_ops: Dict[str, str]
    options: object
    optimizer: object
    micro_batch: int


def _planning_options(options: Options, training: bool) -> Options:
    opts = options.clone()
    opts.replicationFactor(1).deviceIterations(1).showCompilationProgressBar(False)
    if training:
        opts.Training.gradientAccumulation(1)
    opts.setExecutionStrategy(PipelinedExecution(enums.AutoStage.AutoIncrement))
    return opts


def _capture(model, inputs, options, optimizer, training, units: Sequence[str]
             ) -> Tuple[Graph, object]:
    """Capture ``model`` with ``inputs`` and compile it up to the estimate through the
    executor's compile entry; returns ``(graph, optimizer description)``."""
    opts = _planning_options(options, training)
    with wrapping.transient(model, opts, training,
                            optimizer if training else None) as wrapper:
        exe = wrapper._compile_until(_LAST_PASS, *inputs, check_capture=lambda graph:
                                     check_blocks(graph, set(units)))
    return exe.graph, exe.optimizer


def _remove_markers(graph: Graph, markers: Sequence[str]) -> None:
    names = set(markers)
    for node in list(graph.module.graph.nodes):
        if node.name in names:
            node.replace_all_uses_with(node.args[0])
            graph.module.graph.erase_node(node)
    graph.module.recompile()


def capture_for_planning(model: nn.Module, inputs: Sequence, options: Options,
                         optimizer, training: bool, micro_batches: int,
                         proportions: Sequence[float] = DEFAULT_PROPORTIONS,
                         serialize: bool = True) -> Planning:
    """Capture ``model`` once for the planner (module docstring) and cost it.

    Args:
        model: the model.
        inputs: one micro-batch of its ``forward`` arguments.
        options: the user's options (replicas, precision, target, ...).
        optimizer: the training optimizer (``None``: PopTorch's default SGD).
        training: plan a training program.
        micro_batches: gradient accumulation (training) or device iterations.
        proportions: available memory proportions to try.
        serialize: let the planner serialise vocabulary projections.
    """
    layers = repeated_layers(model)
    units = unit_modules(model, layers)
    heads = vocabulary_projections(model) if serialize else {}
    with planning_changes(model, units, layers, list(heads)):
        graph, description = _capture(model, inputs, options, optimizer, training, units)
    costs_a = collect(graph)
    markers = [n.name for n in graph.module.graph.nodes
               if (n.meta.get("custom") or {}).get(PLAN_MARKER)
               and steering_op(n) == "recomputation_checkpoint"]
    op_names = [op.name for op in costs_a.ops]
    found = find_units(graph, op_names, set(units), set(layers), set(markers))
    head_ops = _head_ops(graph, heads)
    _remove_markers(graph, markers)
    costs_b = collect(graph)
    user_options = executor_options(options.clone(), training)
    sess, _ = compile_.options_to_session(user_options)
    sess.small_ipu_model = compile_.model_selection(user_options)[2]
    if training:
        sess = dataclasses.replace(sess, gradient_accumulation=micro_batches)
    else:
        sess = dataclasses.replace(sess, device_iterations=micro_batches)
    target = target_for(sess.ipu_model_version, sess.small_ipu_model)
    user = graph.user_inputs
    micro = int(user[0].shape[0]) if user and user[0] is not None and len(user[0].shape) \
        else 1
    # a plan over several IPUs is pipelined (Plan.apply sets PipelinedExecution)
    memory = dataclasses.replace(memory_settings(sess, training, description), pipelined=True)
    cycles = cycle_settings(memory, sess, training, description, micro)
    by_name = {op.name: op for op in costs_b.ops}
    head_variants = {name: {f: with_serialization(graph, costs_b, by_name[name], f)
                            for f in heads[path]}
                     for path, name in head_ops.items()}
    problem = Problem(Variants(costs_a, costs_b, markers), found, costs_b, target, memory,
                      cycles, head_variants, proportions)
    return Planning(problem, layers, heads, head_ops, sess, description, micro)


def _head_ops(graph: Graph, heads: Dict[str, Tuple[int, ...]]) -> Dict[str, str]:
    """Vocabulary projection path → its ``serialized_matmul`` op."""
    result = {}
    for node in graph.module.graph.nodes:
        if steering_op(node) != "serialized_matmul":
            continue
        stack = [str(p) for p, _ in (node.meta.get("nn_module_stack") or {}).values()]
        for path in heads:
            if path in stack and path not in result:
                result[path] = node.name
    return result
