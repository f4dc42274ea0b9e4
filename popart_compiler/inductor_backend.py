"""The ``inductor`` backend: captured graphs compiled by TorchInductor.

The same ATen graph the ``eager`` backend interprets is handed to ``torch.compile``
with a backend that calls Inductor's ``compile_fx``: forward graphs become fused
kernels and, for training, AOTAutograd compiles the backward graph too (gradients
still come from ``torch.autograd.grad`` on the compiled forward). Parameters, buffers
and constants stay graph *inputs* — never constants folded into the kernels — so the
device weights can be rewritten (``copyWeightsToDevice``, optimizer updates) without
recompiling. A program is compiled once per input signature: later runs with the same
shapes and dtypes reuse the kernels (:func:`compile_count` counts compilations).

Random ops keep the device RNG's semantics: Inductor is told to call PyTorch's random
kernels (``fallback_random``) so they draw from the generator the session swaps in
(S-95) and match the eager backend.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable, List

import torch
import torch.fx as fx

from .logging import logger

__all__ = ["compile_graph", "compile_count"]

_lock = threading.Lock()
_compiles = 0


def compile_count() -> int:
    """Number of graphs Inductor has compiled in this process (forward graphs; the
    backward graph of a training program is compiled with its forward)."""
    return _compiles


def _inductor(gm: fx.GraphModule, example_inputs: List[torch.Tensor], *,
              random: bool) -> Callable:
    """Dynamo backend: count, then compile with Inductor."""
    global _compiles  # pylint: disable=global-statement
    from torch._inductor.compile_fx import compile_fx  # pylint: disable=import-outside-toplevel
    with _lock:
        _compiles += 1
    logger.debug("Compiling a graph of %d nodes with TorchInductor",
                 len(gm.graph.nodes))
    patches = {"fallback_random": True} if random else {}
    return compile_fx(gm, example_inputs, config_patches=patches)


def compile_graph(gm: fx.GraphModule, *, random: bool = False) -> Callable:
    """Compile ``gm`` with TorchInductor (lazily: on its first call).

    Args:
        gm: a flat graph module (state and inputs as placeholders), as captured or
            vectorized by the compiler.
        random: the graph has random ops: draw from PyTorch's generator (see module
            docstring) instead of Inductor's own.

    Returns:
        A callable with ``gm``'s signature. It compiles at the first call, and again
        only for a new input signature (shape, dtype, device, ``requires_grad``).
    """
    return torch.compile(gm, backend=functools.partial(_inductor, random=random),
                         dynamic=False, fullgraph=True)
