"""A pipelined program cut into the parts that processes run (pipeline across
processes, :mod:`popart_compiler.runtime.pipeline`).

A :class:`~popart_compiler.stages.StagedGraph` is split into segments by pipeline
stage; PopART runs consecutive stages on one IPU as one stage
(:meth:`~popart_compiler.stages.StagedGraph.merged_units`). Each merged stage, a
*unit*, runs in its own process. :class:`PipelineProgram` says, for every unit:

* which ops it runs (the steps of its segments, in graph order);
* what it receives from the unit before it and sends to the unit after it: every
  value computed by an earlier unit and used by a later one crosses each boundary in
  between (``torch.distributed.pipelining`` only connects neighbouring stages), so a
  value that skips a unit is passed through it;
* which parameters and buffers it reads (each process updates the parameters of its
  unit; a parameter read by several units is *tied*).

Graph inputs (the micro-batch's user inputs, parameters, buffers and constants) never
cross a boundary: every process has them.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from popart_compiler.errors import backend_error
from popart_compiler.stages import StagedGraph

__all__ = ["BoundaryValue", "PipelineProgram"]


@dataclasses.dataclass(frozen=True)
class BoundaryValue:
    """A value sent from one unit to the next (one micro-batch).

    Attributes:
        node: the value's node in the split graph.
        shape: its shape.
        dtype: its dtype.
        requires_grad: whether its gradient flows back (a floating-point value that
            depends on a trainable parameter, in training).
    """
    node: fx.Node
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool

    def example(self, device) -> torch.Tensor:
        """An uninitialised contiguous tensor with this value's metadata (what
        ``PipelineStage`` needs to allocate its receive buffers)."""
        return torch.empty(self.shape, dtype=self.dtype, device=device) \
            .requires_grad_(self.requires_grad)


def _segment_index(node: fx.Node) -> int:
    return int(str(node.target).rpartition("_")[2])


class PipelineProgram:
    """The units of a staged program and what crosses each boundary.

    Args:
        staged: the program split by stage (pipelined).
        trainable: for each placeholder of the split graph, whether it is a trainable
            parameter (only these start gradients; all ``False`` for inference).
        wrap: applied to each segment submodule to get the callable that runs it
            (``Runners.stage_runner``); the submodule's ``forward`` by default.

    Attributes:
        num_units: merged stages (= processes per pipeline replica).
        unit_ipus: the IPU of each unit.
        unit_stages: the pipeline stages each unit merges.
        receives: per unit, the values it receives (``[]`` for unit 0).
        sends: per unit, the values it sends; for the last unit, the graph's outputs
            (what it returns).
        reads: per unit, the placeholder indices it reads (state and user inputs).

    Raises:
        Error: a value that crosses a boundary is not a tensor.
    """

    def __init__(self, staged: StagedGraph, trainable: Sequence[bool],
                 wrap: Optional[Callable[[fx.GraphModule], Callable]] = None):
        split = staged.split
        units = staged.merged_units()
        self.num_units = max(units) + 1
        ipus = staged.segment_ipus or list(range(len(units)))
        self.unit_ipus = [0] * self.num_units
        self.unit_stages: List[List[int]] = [[] for _ in range(self.num_units)]
        for seg, (unit, stage) in enumerate(zip(units, staged.segment_stages)):
            self.unit_ipus[unit] = ipus[seg]
            if stage not in self.unit_stages[unit]:
                self.unit_stages[unit].append(stage)
        self.placeholders = [n for n in split.graph.nodes if n.op == "placeholder"]
        self._output = next(n for n in split.graph.nodes if n.op == "output")
        index = {n: i for i, n in enumerate(self.placeholders)}
        unit_of: Dict[fx.Node, int] = {}
        self._steps: List[List[Tuple[fx.Node, Callable, Tuple]]] = [
            [] for _ in range(self.num_units)]
        self._constants: Dict[fx.Node, object] = {}
        meta: Dict[fx.Node, object] = {}
        grad: Dict[fx.Node, bool] = {n: bool(t) for n, t in zip(self.placeholders, trainable)}
        self.reads: List[Set[int]] = [set() for _ in range(self.num_units)]
        for node in split.graph.nodes:
            if node.op == "call_module":
                unit = units[_segment_index(node)]
                sub = getattr(split, str(node.target))
                fn = wrap(sub) if wrap else sub.forward
                meta[node], grad[node] = _submodule_outputs(sub, [grad.get(a, False) for a in
                                                                  node.args])
            elif node.op == "call_function":  # getitem of a submodule's tuple output
                source = node.args[0]
                unit = unit_of[source]
                fn = node.target
                meta[node] = meta[source][node.args[1]]
                grad[node] = grad[source][node.args[1]]
            elif node.op == "get_attr":  # a constant: every unit has it
                self._constants[node] = getattr(split, str(node.target))
                continue
            else:
                continue
            unit_of[node] = unit
            for arg in node.args:
                if arg in index:
                    self.reads[unit].add(index[arg])
            self._steps[unit].append((node, fn, tuple(node.args)))
        last = self.num_units - 1
        # a value crosses every boundary between its unit and its last consumer
        crossing: List[List[fx.Node]] = [[] for _ in range(self.num_units)]
        for node, unit in unit_of.items():
            users = [last if u.op == "output" else unit_of.get(u, unit) for u in node.users]
            final = max(users, default=unit)
            for boundary in range(unit, final):
                crossing[boundary].append(node)
        self.sends: List[List[BoundaryValue]] = []
        for u in range(self.num_units):
            values = []
            for node in crossing[u]:
                val = meta[node]
                if not isinstance(val, torch.Tensor):
                    raise backend_error(
                        f"Pipeline stage {u} passes {node.name} ({type(val).__name__}) to "
                        f"stage {u + 1}: only tensors can cross between the processes of "
                        "a pipeline. Move the op that makes it into the stage that uses "
                        "it, or disable Options.Distributed.pipelineAcrossProcesses.")
                values.append(BoundaryValue(node, val.shape, val.dtype,
                                            bool(grad[node]) and val.is_floating_point()))
            self.sends.append(values)
        self.receives = [[]] + self.sends[:-1]
        # the last unit "sends" the graph's outputs (to the schedule's loss and to us)
        outputs = self._output.args[0]
        self.sends[last] = [
            BoundaryValue(n, meta[n].shape, meta[n].dtype, False) for n in
            (outputs if isinstance(outputs, (tuple, list)) else [outputs])
            if isinstance(n, fx.Node) and isinstance(meta.get(n), torch.Tensor)]

    def run(self, unit: int, received: Sequence[torch.Tensor],
            local: Sequence[object]) -> Tuple[torch.Tensor, ...]:
        """Run ``unit`` on one micro-batch.

        Args:
            unit: the unit (merged stage).
            received: the values of ``receives[unit]``, in order.
            local: the graph's placeholders (parameters, buffers, constants, then the
                micro-batch's user inputs).

        Returns:
            The values of ``sends[unit]`` (contiguous, as ``torch.distributed``
            sends them); for the last unit, the graph's outputs.
        """
        env: Dict[fx.Node, object] = dict(zip(self.placeholders, local))
        env.update(self._constants)
        env.update(zip((v.node for v in self.receives[unit]), received))
        for node, fn, args in self._steps[unit]:
            env[node] = fn(*[env[a] if isinstance(a, fx.Node) else a for a in args])
        if unit == self.num_units - 1:
            return tuple(fx.node.map_arg(self._output.args[0], env.__getitem__))
        return tuple(env[v.node].contiguous() for v in self.sends[unit])

    def units_reading(self, placeholder: int) -> List[int]:
        """The units that read placeholder ``placeholder``, ascending."""
        return [u for u in range(self.num_units) if placeholder in self.reads[u]]

    def describe(self, unit: int) -> str:
        """``"pipeline stage 1 of 3 (IPU 1)"``: the unit as the error messages name it
        (its first pipeline stage id when it merges several)."""
        stages = self.unit_stages[unit]
        merged = f", stages {', '.join(map(str, stages))}" if len(stages) > 1 else ""
        return (f"pipeline stage {unit} of {self.num_units} (IPU {self.unit_ipus[unit]}"
                f"{merged})")


def _submodule_outputs(sub: fx.GraphModule, arg_grads: Sequence[bool]):
    """The output metadata of a segment submodule (a value, or a tuple of them) and
    whether each output depends on a trainable input (an over-approximation: any
    floating-point op with such an input)."""
    grad: Dict[fx.Node, bool] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for node, g in zip(placeholders, arg_grads):
        grad[node] = g
    output = None
    for node in sub.graph.nodes:
        if node.op == "output":
            output = node
            continue
        if node.op == "placeholder":
            continue
        inputs = node.all_input_nodes
        grad[node] = any(grad.get(n, False) for n in inputs)
    value = output.args[0] if output is not None else None

    def describe(n):
        return n.meta.get("val") if isinstance(n, fx.Node) else n

    if isinstance(value, (tuple, list)):
        return ([describe(n) for n in value],
                [grad.get(n, False) if isinstance(n, fx.Node) else False for n in value])
    return describe(value), grad.get(value, False)
