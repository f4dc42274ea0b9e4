"""Splitting a placed program by pipeline stage (docs/semantics.md S-60, S-63, S-65).

A program whose ops sit on several pipeline stages is cut into one fx submodule per
run of consecutive ops (in graph order) of the same stage, with
``torch.fx.passes.split_module``. Every segment computes exactly what the same ops
compute in the unsplit graph; the session's schedule
(:mod:`popart_compiler.runtime.schedule`) only changes the order in which
micro-batches visit them.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch.fx as fx
from torch.fx.passes.split_module import split_module

from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation, PassResult, derived, unchanged
from popart_compiler.passes.placement import placement_of
from popart_compiler.stages import StagedGraph

__all__ = ["split_by_stage", "split_stages"]


def split_by_stage(gm: fx.GraphModule) -> Tuple[fx.GraphModule, List[int]]:
    """Split ``gm`` into submodules ``submod_<k>``, one per run of consecutive ops
    (in graph order) that share a pipeline stage.

    Returns:
        ``(split, stage_of_segment)``: the split module (same signature and outputs
        as ``gm``) and the stage id of each segment ``k``.
    """
    segment_of: Dict[fx.Node, int] = {}
    stages: List[int] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        stage = placement_of(node).stage
        if not stages or stages[-1] != stage:
            stages.append(stage)
        segment_of[node] = len(stages) - 1
    split = split_module(gm, gm, lambda node: segment_of[node], keep_original_order=True)
    return split, stages


def split_stages(graph: Graph, c: Compilation) -> PassResult:
    """A program placed on several stages: ``stages`` (its :class:`StagedGraph`),
    returned on the compilation. The graph itself is unchanged."""
    plan = c.placement
    if plan is None or len(plan.stages) <= 1:
        return unchanged(graph)
    split, segment_stages = split_by_stage(graph.module)
    ipu_of: Dict[int, int] = {}
    for node in graph.module.graph.nodes:
        if node.op not in ("placeholder", "get_attr", "output"):
            where = placement_of(node)
            ipu_of.setdefault(where.stage, where.ipu)
    ipus = [ipu_of.get(stage, 0) for stage in segment_stages]
    return derived(graph, c, stages=StagedGraph(split, segment_stages, plan.pipelined, ipus))
