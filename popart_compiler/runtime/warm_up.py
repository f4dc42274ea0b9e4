"""Compiling the ``inductor`` backend's kernels ahead of the first run (issue 11).

The inductor backend compiles a graph at its first call with each input signature.
:func:`warm_up` makes that call while the executable is being compiled, so the
compilation progress bar (and ``compilationTime()``) covers TorchInductor's work and
the first run of the model does not pay it. The call uses what the session will pass -
the device weights of replica 0 (as :class:`~popart_compiler.runtime.device_state.DeviceWeights`
makes them) and zero-filled inputs of the per-call shapes - so the compiled code it
leaves behind is the code the session reuses. Nothing of the call is kept: the weights
are copies, the outputs are dropped and PyTorch's random number generators are
restored afterwards.
A training graph's backward is compiled in the same call
(``force_non_lazy_backward_lowering``), not at the first backward pass.

Pipelined (staged) programs compile stage by stage at their first run instead, and so
do programs with host ops (``ipu_print_tensor``, ``poptorch.CPU``, custom ops:
:func:`~popart_compiler.ir.register_per_micro_batch_op`): a trial run would print or
call the user's host code once more, with made-up values.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
from torch._functorch import config as functorch_config

from popart_compiler.backends import inductor
from popart_compiler.backends.auto import Lowering
from popart_compiler.errors import backend_error
from popart_compiler.logging import logger
from popart_compiler.runtime.device_state import DeviceWeights
from popart_compiler.runtime.lowering import Runners
from popart_compiler.stages import Executable

__all__ = ["warm_up", "precompile"]


def _example_inputs(exe: Executable, slots: int) -> Optional[List[torch.Tensor]]:
    """Zero user inputs for one call of the compiled graph: one micro-batch, or
    ``slots`` of them stacked for the vectorized graph (float64 runs as float32);
    ``None`` when an input's shape is unknown."""
    g = exe.graph
    out = []
    for node in g.placeholders[len(g.placeholders) - g.num_user_inputs:]:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        dtype = torch.float32 if val.dtype == torch.float64 else val.dtype
        shape = (slots, *val.shape) if slots else tuple(val.shape)
        out.append(torch.zeros(shape, dtype=dtype, device=exe.options.device))
    return out


def warm_up(exe: Executable, runners: Runners) -> None:
    """Compile the inductor kernels of ``exe`` now by calling its compiled graph once
    (``runners``: ``exe`` lowered by :func:`~popart_compiler.runtime.lowering.lower`,
    what the session will run) on copies of its weights and zero inputs; a no-op for
    the ``eager`` backend, with floating-point exception checks (op-by-op
    interpreter), for staged programs and for programs with host side effects
    (per-micro-batch ops).

    Raises:
        Exception: what TorchInductor raises when the graph cannot be compiled (the
            first run would raise the same). An error raised by the compiled kernels
            on the zero inputs is not raised: the user's inputs may well be valid.
    """
    if (exe.options.backend != "inductor" or exe.options.fp_exceptions or exe.staged
            or exe.graph.runs_per_micro_batch()):
        return
    lowered = runners.lowering
    if lowered.vectorized is not None:
        fn, inputs = lowered.vectorized, _example_inputs(exe, lowered.vectorized_slots)
    else:
        fn, inputs = lowered.runner, _example_inputs(exe, 0)
    if inputs is None:
        return  # compiled at the first run instead
    state = DeviceWeights(exe, exe.options.device).state(0)
    device = torch.device(exe.options.device)
    devices = [device.index or 0] if device.type == "cuda" else []
    grad = torch.enable_grad() if exe.training else torch.no_grad()
    lowering = functorch_config.patch(force_non_lazy_backward_lowering=True) \
        if exe.training else contextlib.nullcontext()
    logger.debug("Compiling the inductor kernels before the first run")
    compiled = inductor.thread_compile_count()
    with torch.random.fork_rng(devices=devices, device_type=device.type), grad, lowering:
        try:
            fn(*state, *inputs)
        except Exception as e:  # pylint: disable=broad-except
            if inductor.thread_compile_count() == compiled:
                raise  # the compilation failed: the first run would fail the same way
            # The kernels compiled; running them on the zero stand-ins failed (a
            # singular matrix, say), which says nothing about the user's inputs.
            logger.debug("The inductor kernels compiled; their trial run on zero "
                         "inputs raised %s: %s", type(e).__name__, e)


def precompile(exe: Executable, lowering: Lowering, state: List[torch.Tensor]) -> Lowering:
    """Compile the graph of ``lowering`` (the ``auto`` backend's inductor lowering)
    that a session of ``exe`` calls, for the signature of its calls: ``state`` (the
    session's device state of replica 0; only its shapes, strides, dtypes and
    ``requires_grad`` are read) and inputs of the per-call shapes. Nothing runs: safe
    in a background thread while the session runs. Returns ``lowering``.

    Raises:
        Error: an input's shape is unknown.
        Exception: what TorchInductor raises when the graph cannot be compiled.
    """
    if lowering.vectorized is not None:
        fn, inputs = lowering.vectorized, _example_inputs(exe, lowering.vectorized_slots)
    else:
        fn, inputs = lowering.runner, _example_inputs(exe, 0)
    if inputs is None:
        raise backend_error("an input's shape is unknown")
    like = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            .requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in state]
    fn.precompile([*like, *inputs], grad=exe.training)
    return lowering
