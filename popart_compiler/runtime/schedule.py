"""The stage schedule of a multi-stage program (docs/semantics.md S-60, S-63, S-65).

:class:`StagedProgram` runs micro-batches through the segments of a
:class:`~popart_compiler.stages.StagedGraph` (made by the compiler's ``split_stages``
pass) in the order of the execution strategy (:func:`stage_order`):

* pipelined: clock ``t`` runs stage ``s`` on micro-batch ``t − s`` (fill, steady
  state, drain), so micro-batches flow through the stages as on a pipeline;
* sharded and phased: each micro-batch goes through all the stages, one after
  another, before the next one starts.

Results are identical to the unpartitioned model; only the order in which
micro-batches visit the stages changes.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from popart_compiler.stages import StagedGraph

__all__ = ["stage_order", "StagedProgram"]

def stage_order(num_stages: int, num_micro_batches: int,
                pipelined: bool) -> List[Tuple[int, int]]:
    """``(stage rank, micro-batch)`` pairs in execution order.

    Pipelined: for each clock ``t``, the stages ``s`` (ascending) that hold
    micro-batch ``t − s``. Otherwise micro-batch-major.
    """
    if not pipelined:
        return [(s, m) for m in range(num_micro_batches) for s in range(num_stages)]
    order = []
    for t in range(num_micro_batches + num_stages - 1):
        for s in range(num_stages):
            if 0 <= t - s < num_micro_batches:
                order.append((s, t - s))
    return order


class StagedProgram:
    """A staged program, run micro-batch by micro-batch.

    Args:
        staged: the program split by stage.
        wrap: applied to each stage submodule to get the callable that runs it
            (e.g. a floating-point checking interpreter, an Inductor compilation);
            the submodule's ``forward`` by default.
    """

    def __init__(self, staged: StagedGraph,
                 wrap: Optional[Callable[[fx.GraphModule], Callable]] = None):
        self.split = staged.split
        self.pipelined = staged.pipelined
        unit_of = staged.units()
        self.num_stages = max(unit_of) + 1
        self._placeholders = [n for n in self.split.graph.nodes if n.op == "placeholder"]
        self._output = next(n for n in self.split.graph.nodes if n.op == "output")
        self._steps: List[List[Tuple[fx.Node, Callable, Tuple]]] = [
            [] for _ in range(self.num_stages)]
        rank = 0
        for node in self.split.graph.nodes:
            if node.op == "call_module":
                segment = int(str(node.target).rpartition("_")[2])
                rank = unit_of[segment]
                sub = getattr(self.split, str(node.target))
                fn = wrap(sub) if wrap else sub.forward  # skip nn.Module call overhead
            elif node.op == "call_function":  # getitem of a submodule's outputs
                fn = node.target
            elif node.op == "get_attr":
                value = getattr(self.split, str(node.target))
                self._steps[0].append((node, lambda value=value: value, ()))
                continue
            else:
                continue
            if node.kwargs:
                raise ValueError(f"unexpected keyword arguments in split graph: {node}")
            self._steps[rank].append((node, fn, tuple(node.args)))

    def _run_stage(self, env: Dict[fx.Node, object], rank: int) -> None:
        for node, fn, args in self._steps[rank]:
            env[node] = fn(*[env[a] if isinstance(a, fx.Node) else a for a in args])

    def run(self, micro_batches: Sequence[Sequence[Sequence[torch.Tensor]]],
            on_done: Callable[[int, int, Tuple], None]) -> None:
        """Run ``micro_batches[m][rep]`` (the flat graph arguments of micro-batch
        ``m`` on replica ``rep``) through the stages in schedule order, replicas in
        lock-step; ``on_done(m, rep, outputs)`` is called as soon as micro-batch
        ``m`` of replica ``rep`` leaves the last stage."""
        envs: Dict[Tuple[int, int], Dict[fx.Node, object]] = {}
        last = self.num_stages - 1
        for rank, m in stage_order(self.num_stages, len(micro_batches), self.pipelined):
            for rep, args in enumerate(micro_batches[m]):
                env = envs.get((m, rep))
                if env is None:
                    env = envs[(m, rep)] = dict(zip(self._placeholders, args))
                self._run_stage(env, rank)
                if rank == last:
                    outs = fx.node.map_arg(self._output.args[0], env.__getitem__)
                    del envs[(m, rep)]
                    on_done(m, rep, tuple(outs))

