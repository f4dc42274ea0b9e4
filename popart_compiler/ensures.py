"""What each compiler pass ensures (torch.fx's ``ensures``), checked after the pass by
:func:`popart_compiler.verify.verify` when ``POPTORCH_VERIFY=1`` (the tests set it).

Each check is a function ``(graph, compilation) -> problem``: ``None`` when what the
pass promises holds, else a sentence saying what does not (``verify`` raises it as
``poptorch_verify_error``, naming the pass). :data:`popart_compiler.compiler.PASSES`
gives each pass its check (:attr:`popart_compiler.passes.base.Pass.ensures`).
"""
from __future__ import annotations

import operator
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx

from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.checks import UNSUPPORTED_DTYPES
from popart_compiler.passes.placement import placement_of

__all__ = ["supported_op", "ipu_types_and_ops", "no_float64", "on_session_device",
           "no_inference_dropout", "placement_complete", "stages_well_formed",
           "vectorized_well_formed", "estimated"]


def _graphs(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """``gm`` and its sub-graphs (``torch.cond`` branches, stage submodules)."""
    return (m for m in gm.modules() if isinstance(m, fx.GraphModule))


def _ops(gm: fx.GraphModule) -> Iterator[fx.Node]:
    return (n for sub in _graphs(gm) for n in sub.graph.nodes if n.op == "call_function")


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value


def _arguments(node: fx.Node) -> Iterator[Any]:
    yield from _leaves(node.args)
    yield from _leaves(node.kwargs)


def supported_op(target: Any) -> bool:
    """Whether an op target is one the compiler takes: a PyTorch operator (ATen, prims
    and the ``torch.library`` ops of PopTorch and custom ops: ``OpOverload``,
    ``OpOverloadPacket``, higher-order operators such as ``torch.cond``), or a Python
    operator on sizes (``operator.getitem``, ``operator.mul``, ``math`` functions,
    ``torch.sym_*``). Any other Python callable in a graph is not an IPU op."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                           torch._ops.HigherOrderOperator)):
        return True
    module = getattr(target, "__module__", None)
    if module in ("_operator", "operator", "math") or target is operator.getitem:
        return True
    name = getattr(target, "__name__", "")
    return module in ("torch", "torch.fx.experimental.sym_node") and name.startswith("sym_")


def ipu_types_and_ops(graph: Graph, c: Compilation) -> Optional[str]:
    """``check_inputs``: the user inputs and outputs have types the IPU takes, and
    every op of the graph is a supported op (:func:`supported_op`)."""
    for node in graph.placeholders:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype in UNSUPPORTED_DTYPES:
            return f"placeholder {node.name} has the unsupported dtype {val.dtype}"
    for info in graph.user_outputs:
        if info is not None and info.dtype in UNSUPPORTED_DTYPES:
            return f"a user output has the unsupported dtype {info.dtype}"
    for node in _ops(graph.module):
        if not supported_op(node.target):
            return f"op {node.name} calls {node.target!r}, which is not a PyTorch operator"
    return None


def no_float64(graph: Graph, c: Compilation) -> Optional[str]:
    """``demote_float64``: no op argument is ``torch.float64`` and no op computes a
    float64 value (``meta["val"]``); only state placeholders may still hold float64
    (the device holds them as float32)."""
    for node in _ops(graph.module):
        if any(a is torch.float64 for a in _arguments(node)):
            return f"op {node.name} still has torch.float64 in its arguments"
        for val in _leaves(node.meta.get("val")):
            if isinstance(val, torch.Tensor) and val.dtype == torch.float64:
                return f"op {node.name} still computes a float64 value"
    return None


def on_session_device(graph: Graph, c: Compilation) -> Optional[str]:
    """``retarget_device``: a program for another device than the CPU has no CPU device
    left in its op arguments (they all became the session's device)."""
    target = torch.device(c.options.device)
    if target.type == "cpu":
        return None
    for node in _ops(graph.module):
        for a in _arguments(node):
            if isinstance(a, torch.device) and a.type == "cpu":
                return f"op {node.name} has the device {a} in its arguments, not {target}"
    return None


def _dropout_problem(node: fx.Node) -> Optional[str]:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    name = schema.name.split("::")[-1]
    if "dropout" in name and "backward" not in name and len(schema.returns) == 1:
        return f"op {node.name} is a dropout ({name})"
    for index, arg in enumerate(schema.arguments):
        value = node.args[index] if index < len(node.args) else node.kwargs.get(arg.name)
        if arg.name in ("dropout", "dropout_p") and value not in (None, 0, 0.0):
            return f"op {node.name} drops out with probability {value}"
        if "dropout" in name and arg.name == "train" and value is True:
            return f"op {node.name} drops out in training mode"
    return None


def no_inference_dropout(graph: Graph, c: Compilation) -> Optional[str]:
    """``remove_inference_dropout``: an inference graph drops nothing out (no dropout
    op, every dropout probability 0, ``train=False``)."""
    if c.training:
        return None
    for node in _ops(graph.module):
        problem = _dropout_problem(node)
        if problem is not None:
            return problem
    return None


def placement_complete(graph: Graph, c: Compilation) -> Optional[str]:
    """``place``: a placement plan exists and every op is placed on an IPU, pipeline
    stage and phase of that plan."""
    plan = c.placement
    if plan is None:
        return "no placement plan"
    for node in graph.module.graph.nodes:
        if node.op != "call_function":
            continue
        if "placement" not in node.meta:
            return f"op {node.name} has no placement"
        where = placement_of(node)
        if where.ipu >= plan.ipus_per_replica or where.stage not in plan.stages \
                or where.phase >= plan.num_phases:
            return f"op {node.name} is placed at {where}, outside the plan"
    return None


def _lint(gm: fx.GraphModule, what: str) -> Optional[str]:
    try:
        gm.graph.lint()
    except Exception as exc:  # fx raises RuntimeError for a malformed graph
        return f"{what}: fx lint: {exc}"
    return None


def stages_well_formed(graph: Graph, c: Compilation) -> Optional[str]:
    """``split_stages``: a program placed on several stages has its
    :class:`~popart_compiler.stages.StagedGraph`, with the placeholders of the graph
    and one well-formed submodule per segment, on known IPUs."""
    plan, staged = c.placement, c.stages
    if staged is None:
        if plan is not None and len(plan.stages) > 1:
            return f"{len(plan.stages)} stages but no staged graph"
        return None
    problem = _lint(staged.split, "the staged graph")
    if problem is not None:
        return problem
    inputs = sum(1 for n in staged.split.graph.nodes if n.op == "placeholder")
    if inputs != len(graph.placeholders):
        return f"the staged graph has {inputs} placeholders, the graph " \
            f"{len(graph.placeholders)}"
    if staged.segment_ipus and len(staged.segment_ipus) != len(staged.segment_stages):
        return "the staged graph has an IPU for some of its segments only"
    for k in range(len(staged.segment_stages)):
        sub = getattr(staged.split, f"submod_{k}", None)
        if not isinstance(sub, fx.GraphModule):
            return f"the staged graph has no submodule submod_{k}"
        problem = _lint(sub, f"stage submodule submod_{k}")
        if problem is not None:
            return problem
    return None


def vectorized_well_formed(graph: Graph, c: Compilation) -> Optional[str]:
    """``vectorize``: the vectorized graph (when there is one) is well formed, takes
    the graph's state and inputs, runs more than one micro-batch and only supported
    ops; without one, one micro-batch per call."""
    gm = c.vectorized
    if gm is None:
        return None if c.vectorized_slots == 1 else \
            f"{c.vectorized_slots} micro-batches per call but no vectorized graph"
    if c.vectorized_slots <= 1:
        return f"a vectorized graph over {c.vectorized_slots} micro-batches"
    problem = _lint(gm, "the vectorized graph")
    if problem is not None:
        return problem
    inputs = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    if inputs != len(graph.placeholders):
        return f"the vectorized graph has {inputs} placeholders, the graph " \
            f"{len(graph.placeholders)}"
    for node in _ops(gm):
        if not supported_op(node.target):
            return f"vectorized op {node.name} calls {node.target!r}, which is not a " \
                "PyTorch operator"
    return None


def estimated(graph: Graph, c: Compilation) -> Optional[str]:
    """``estimate``: the program has its IPU Model estimate."""
    return None if c.estimate is not None else "no estimate"
