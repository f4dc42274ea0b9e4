"""Inference graphs made of external kernels only, run as they are (issue 30).

After :func:`~popart_compiler.backends.prepack.prepack_inference`, a CPU inference graph
can be nothing but oneDNN kernels with prepacked weights (``popart_compiler::onednn_*``)
and views between them: an MLP's linear layers with their ReLUs as post-ops, a CNN's
convolution chain and classifier. TorchInductor would generate no code for such a
graph: its compiled module calls the same kernels, each through the dispatcher, behind
AOTAutograd's runtime wrappers and a check of every argument's size and stride. Those
cost more than the work between the kernels (MLP of ``bench/peers.py``, 256 rows, one
thread: 2.32 ms a call compiled against 2.21 ms for its three kernels alone).

:func:`runner` returns such a graph's own ``forward``, with each kernel node calling
the kernel's Python implementation directly (:data:`~popart_compiler.backends.prepack.
KERNELS`): the same kernels on the same prepacked weights, so the same results, without
a compilation. Graphs with anything else keep Inductor.
"""
from __future__ import annotations

import copy
import operator
from typing import Callable, Dict, Optional

import torch
import torch.fx as fx

from popart_compiler.backends import prepack

__all__ = ["runner", "runs_as_is"]

_aten = torch.ops.aten
_T = torch.Tensor


def _alias(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape)


#: Ops that only view their input (no computation for Inductor to fuse) → the
#: ``Tensor`` method that computes the same (a cheaper call than the op's overload).
VIEWS: Dict[object, Callable] = {
    _aten.view.default: _T.view, _aten.reshape.default: _T.reshape,
    _aten._unsafe_view.default: _T.reshape, _aten.t.default: _T.t,
    _aten.transpose.int: _T.transpose, _aten.permute.default: _T.permute,
    _aten.unsqueeze.default: _T.unsqueeze, _aten.squeeze.dim: _T.squeeze,
    _aten.squeeze.dims: _T.squeeze, _aten.squeeze.default: _T.squeeze,
    _aten.flatten.using_ints: _T.flatten,
    _aten.expand.default: _T.expand, _aten.alias.default: _alias,
    _aten.detach.default: _T.detach, operator.getitem: operator.getitem}


def runs_as_is(gm: fx.GraphModule) -> bool:
    """Whether every call in ``gm`` is a prepacked oneDNN kernel
    (:data:`~popart_compiler.backends.prepack.KERNELS`) or a view (:data:`VIEWS`, without
    keyword arguments), with at least one kernel: nothing a compiler would generate code
    for."""
    kernels = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function":
            return False
        if node.target in prepack.KERNELS:
            kernels += 1
        elif node.target not in VIEWS or node.kwargs:
            return False
    return kernels > 0


def runner(gm: fx.GraphModule) -> Optional[Callable]:
    """The ``forward`` of a copy of ``gm`` whose kernel nodes call the kernels' Python
    implementations (no dispatcher) and whose views call ``Tensor`` methods, if
    :func:`runs_as_is`; else ``None``. The caller runs it under ``torch.no_grad()`` (the
    kernels have no gradients). ``gm`` is unchanged."""
    if not runs_as_is(gm):
        return None
    direct = copy.deepcopy(gm)
    for node in direct.graph.nodes:
        if node.op != "call_function":
            continue
        node.target = prepack.KERNELS.get(node.target) or VIEWS[node.target]
    direct.recompile()
    return direct.forward
