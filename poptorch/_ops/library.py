"""``torch.library`` definitions of the PopTorch ops (namespace ``poptorch``,
docs/api-sections.md api §8).

Every op defined here is a real PyTorch operator: ``torch.export`` captures it as one
``call_function`` node whose target prints as ``poptorch.<name>.default``, its fake
kernel gives the output shapes at capture, its autograd formula makes the eager
training path differentiate it, and its vmap rule lets inference graphs be vectorised
over micro-batches. The IPU Model reads the steering ops' arguments from the nodes
(CONTRACTS B): ``recomputation_checkpoint``, ``set_available_memory`` and
``serialized_matmul`` keep the schemas listed there.

Ops that must run once per micro-batch on the host (printing, host callbacks, user
custom ops) are registered with
:func:`popart_compiler.ir.register_per_micro_batch_op`; the compiler then never
vectorises a graph that holds one of them.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from popart_compiler.ir import register_per_micro_batch_op

__all__ = ["define", "define_identity", "op", "MATMUL_MODES"]

_LIB = torch.library.Library("poptorch", "FRAGMENT")

#: The ``MatMulSerializationMode`` names the ``serialized_matmul`` op accepts.
MATMUL_MODES = ("InputChannels", "ReducingDim", "OutputChannels", "Disabled")


def op(name: str) -> torch._ops.OpOverload:
    """The default overload of ``poptorch::<name>``."""
    return getattr(torch.ops.poptorch, name).default


def define(schema: str, kernel: Callable, fake: Callable, *,
           backward: Optional[Callable] = None, setup_context: Optional[Callable] = None,
           vmap: Optional[Callable] = None, tags: Sequence[torch.Tag] = (),
           per_micro_batch: bool = False) -> torch._ops.OpOverload:
    """Define ``poptorch::<schema>`` with its kernel, fake kernel and optional rules.

    Args:
        schema: the operator schema without namespace, e.g. ``"nop(Tensor x) -> Tensor"``.
        kernel: the implementation on real tensors (any device).
        fake: the shape function run at capture on fake tensors.
        backward / setup_context: autograd formula (``torch.library.register_autograd``).
        vmap: batching rule (``torch.library.register_vmap``).
        tags: ``torch.Tag`` values (e.g. ``nondeterministic_seeded`` for random ops).
        per_micro_batch: the op has a host side effect and must run once per
            micro-batch and replica (never vectorised).

    Returns:
        The op's default overload.
    """
    name = schema.split("(", 1)[0]
    qualname = f"poptorch::{name}"
    _LIB.define(schema, tags=tuple(tags))
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=_LIB)
    if backward is not None:
        torch.library.register_autograd(qualname, backward, setup_context=setup_context,
                                        lib=_LIB)
    if vmap is not None:
        torch.library.register_vmap(qualname, vmap, lib=_LIB)
    if per_micro_batch:
        register_per_micro_batch_op(qualname)
    return op(name)


def _identity_backward(ctx, grad):
    return (grad,) + (None,) * ctx.extra


def _identity_setup(ctx, inputs, output):
    ctx.extra = len(inputs) - 1


def define_identity(schema: str, side_effect: Optional[Callable] = None,
                    backward: Optional[Callable] = None,
                    per_micro_batch: bool = False) -> torch._ops.OpOverload:
    """Define an op that returns a copy of its first (tensor) argument.

    Args:
        schema: ``"<name>(Tensor x, <attributes>) -> Tensor"``.
        side_effect: called as ``side_effect(x, *attributes)`` when the kernel runs.
        backward: autograd formula ``backward(ctx, grad)`` (default: the gradient
            passes through unchanged); ``ctx.attributes`` holds the attributes.
        per_micro_batch: see :func:`define`.
    """
    name = schema.split("(", 1)[0]

    def kernel(x, *attributes):
        if side_effect is not None:
            side_effect(x, *attributes)
        return x.clone()

    def fake(x, *attributes):
        return torch.empty_like(x)

    def batched(info, in_dims, x, *attributes):
        return op(name)(x, *attributes), in_dims[0]

    def setup(ctx, inputs, output):
        _identity_setup(ctx, inputs, output)
        ctx.attributes = inputs[1:]

    return define(schema, kernel, fake, backward=backward or _identity_backward,
                  setup_context=setup, vmap=None if per_micro_batch else batched,
                  per_micro_batch=per_micro_batch)


# -- steering ops read by the IPU Model (CONTRACTS B) ---------------------------------

RECOMPUTATION_CHECKPOINT = define_identity("recomputation_checkpoint(Tensor x) -> Tensor")
SET_AVAILABLE_MEMORY = define_identity(
    "set_available_memory(Tensor x, float proportion) -> Tensor")
NOP = define_identity("nop(Tensor x) -> Tensor")
OVERLAP_INPUT = define_identity("set_overlap_for_input(Tensor x, str mode) -> Tensor")
OVERLAP_OUTPUT = define_identity("set_overlap_for_output(Tensor x, str mode) -> Tensor")


def _serialized_matmul(a: torch.Tensor, b: torch.Tensor, mode: str, factor: int
                       ) -> torch.Tensor:
    """``a @ b`` computed in ``factor`` sequential pieces along the ``mode`` dimension."""
    if mode == "Disabled" or factor <= 1:
        return torch.matmul(a, b)
    if mode == "InputChannels":
        return torch.cat([torch.matmul(part, b) for part in a.chunk(factor, dim=-2)],
                         dim=-2)
    if mode == "OutputChannels":
        return torch.cat([torch.matmul(a, part) for part in b.chunk(factor, dim=-1)],
                         dim=-1)
    size = a.shape[-1] // factor
    out = None
    for k in range(factor):
        piece = torch.matmul(a[..., k * size:(k + 1) * size], b[..., k * size:(k + 1) * size, :])
        out = piece if out is None else out + piece
    return out


def _serialized_matmul_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.mode, ctx.factor = inputs[2], inputs[3]


def _serialized_matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.matmul(grad, b.mT).sum_to_size(a.shape)
    if ctx.needs_input_grad[1]:
        grad_b = torch.matmul(a.mT, grad).sum_to_size(b.shape)
    return grad_a, grad_b, None, None


def _serialized_matmul_vmap(info, in_dims, a, b, mode, factor):
    rank = max(a.dim() - (in_dims[0] is not None), b.dim() - (in_dims[1] is not None))

    def lift(t, dim):
        if dim is None:
            return t
        t = t.movedim(dim, 0)
        while t.dim() < rank + 1:
            t = t.unsqueeze(1)
        return t

    return op("serialized_matmul")(lift(a, in_dims[0]), lift(b, in_dims[1]), mode,
                                   factor), 0


SERIALIZED_MATMUL = define(
    "serialized_matmul(Tensor a, Tensor b, str mode, int factor) -> Tensor",
    _serialized_matmul, lambda a, b, mode, factor: torch.matmul(a, b),
    backward=_serialized_matmul_backward, setup_context=_serialized_matmul_setup,
    vmap=_serialized_matmul_vmap)
