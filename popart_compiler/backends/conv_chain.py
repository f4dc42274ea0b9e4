"""Chains of convolutions, ReLUs and max-poolings run in oneDNN's blocked layout, for
inference on the CPU (issue 30; applied by
:func:`~popart_compiler.backends.prepack.prepack_inference`).

A CNN's feature extractor (``conv → relu → max_pool2d → conv → …``) is rewritten
into one external kernel, ``popart_compiler::onednn_conv_chain``, that keeps every
intermediate result in oneDNN's own blocked layout (``nChw16c``, as ONNX Runtime's
NCHWc kernels do) instead of channels-last tensors that Inductor reads and writes
between the convolutions: oneDNN then uses its direct convolution kernels, much faster
than its channels-last ones for few input channels (3 → 16 channels, 3×3, 32×32,
batch 128, one thread of an AMD EPYC: 0.94 ms against 2.0 ms), and a ReLU just before
a max-pooling runs after it, on the pooled tensor (the same values: ReLU is monotone,
so it commutes with a maximum), in place. Only the chain's result is converted back
into a plain contiguous ``(N, C, H, W)`` tensor.

A chain starts at a prepacked convolution (``popart_compiler::onednn_conv2d``) and
takes, as long as each result has no other user, the next ReLU, max-pooling (no
dilation, indices unused) or prepacked convolution reading it, where each convolution
has a small weight (at most 128 × 128 × 3 × 3 elements) and at least 1024 output
positions (N × H' × W'): oneDNN's blocked kernels reorder a packed weight again at
every call (except a first convolution's), which bigger weights over fewer positions
would feel. It is rewritten when it has two convolutions or more, or a convolution and
a pooling (a lone convolution keeps the channels-last kernel: converting its full-size
result back would cost more than it saves). The weights stay graph inputs, packed for
their input shape and packed again after an in-place write (the cache of
:mod:`~popart_compiler.backends.prepack`).

Results: the same as eager PyTorch to float rounding (oneDNN sums in another order);
NaNs propagate through oneDNN's pooling as its ``max`` instruction does, which can
differ from PyTorch's NaN-propagating max-pooling.
"""
from __future__ import annotations

import operator
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

from popart_compiler.backends import prepack

__all__ = ["fuse_conv_chains", "chain_count"]

_CONV, _RELU, _POOL = 0, 1, 2
_STEP_LEN = {_CONV: 8, _RELU: 1, _POOL: 8}


def chain_count(gm: fx.GraphModule) -> int:
    """Number of ``popart_compiler::onednn_conv_chain`` nodes in ``gm`` (tests)."""
    op = torch.ops.popart_compiler.onednn_conv_chain.default
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op)


def _steps(steps: List[int]):
    """``(kind, params)`` for each step of the flat encoding ``steps``."""
    i = 0
    while i < len(steps):
        kind = steps[i]
        yield kind, steps[i + 1:i + _STEP_LEN[kind]]
        i += _STEP_LEN[kind]


def _pooled(size: int, kernel: int, stride: int, padding: int, ceil: bool) -> int:
    span = size + 2 * padding - kernel
    out = (span + (stride - 1 if ceil else 0)) // stride + 1
    if ceil and (out - 1) * stride >= size + padding:
        out -= 1  # the last window must start inside the input or its left padding
    return out


def _convolved(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _weight_for(weight: torch.Tensor, params: List[int], shape: Tuple[int, ...]):
    stride, padding, dilation, groups = params[0:2], params[2:4], params[4:6], params[6]

    def pack():
        return torch._C._nn.mkldnn_reorder_conv2d_weight(
            weight.detach().contiguous().to_mkldnn(), padding, stride, dilation, groups,
            list(shape))
    packed = prepack._packed(weight, ("chain", tuple(params), shape), pack)
    return weight.detach().contiguous().to_mkldnn() if packed is None else packed


def _onednn_conv_chain(x: torch.Tensor, weights: List[torch.Tensor],
                       biases: List[Optional[torch.Tensor]],
                       steps: List[int]) -> torch.Tensor:
    """The chain ``steps`` applied to ``x`` (float32, ``(N, C, H, W)``, CPU) in oneDNN's
    layout; a contiguous ``(N, C', H', W')`` result. ``steps`` is flat: per
    convolution ``0, stride (2), padding (2), dilation (2), groups`` (its weight and
    bias next in ``weights`` and ``biases``), per ReLU ``1``, per max-pooling
    ``2, kernel (2), stride (2), padding (2), ceil_mode``."""
    y = x.contiguous().to_mkldnn()
    relu = False  # a ReLU not applied yet: it is applied after the next pooling
    k = 0
    for kind, p in _steps(steps):
        if kind == _RELU:
            relu = True
            continue
        if kind == _POOL:
            y = torch.mkldnn_max_pool2d(y, p[0:2], p[2:4], p[4:6], [1, 1], bool(p[6]))
            continue
        if relu:
            y = torch.relu_(y)
            relu = False
        bias = biases[k].contiguous() if biases[k] is not None else None
        w = _weight_for(weights[k], p, tuple(y.shape))
        y = torch.mkldnn_convolution(y, w, bias, p[2:4], p[0:2], p[4:6], p[6])
        k += 1
    if relu:
        y = torch.relu_(y)
    return y.to_dense()


# registered as prepack's kernels are (torch.library.Library: cheaper calls)
_LIB = prepack._LIB
_LIB.define("onednn_conv_chain(Tensor x, Tensor[] weights, Tensor?[] biases, "
            "int[] steps) -> Tensor")
prepack.register_kernel("onednn_conv_chain", _onednn_conv_chain)


@torch.library.register_fake("popart_compiler::onednn_conv_chain", lib=_LIB)
def _(x, weights, biases, steps):  # pylint: disable=unused-argument
    n, c, h, w = x.shape
    k = 0
    for kind, p in _steps(steps):
        if kind == _POOL:
            h = _pooled(h, p[0], p[2], p[4], bool(p[6]))
            w = _pooled(w, p[1], p[3], p[5], bool(p[6]))
        elif kind == _CONV:
            c, _, kh, kw = weights[k].shape
            h = _convolved(h, kh, p[0], p[2], p[4])
            w = _convolved(w, kw, p[1], p[3], p[5])
            k += 1
    return x.new_empty((n, c, h, w))


def _pool_step(node: fx.Node) -> Optional[Tuple[List[int], fx.Node]]:
    """The pooling step of a ``max_pool2d`` (or ``max_pool2d_with_indices`` whose
    only user takes its values) at ``node``, and the node giving its values."""
    aten = torch.ops.aten
    if node.target not in (aten.max_pool2d.default,
                           aten.max_pool2d_with_indices.default) or node.kwargs:
        return None
    args = list(node.args[1:]) + [None] * (6 - len(node.args))
    kernel, stride, padding, dilation, ceil = args[:5]

    def pair(v, default):
        v = default if v is None or (isinstance(v, (list, tuple)) and not v) else v
        v = [v] if isinstance(v, int) else list(v)
        return v * 2 if len(v) == 1 else v
    kernel = pair(kernel, None)
    stride, padding = pair(stride, kernel), pair(padding, 0)
    if pair(dilation, 1) != [1, 1]:
        return None
    out = node
    if node.target is aten.max_pool2d_with_indices.default:
        users = list(node.users)
        if len(users) != 1 or users[0].target is not operator.getitem or \
                users[0].args[1] != 0:
            return None
        out = users[0]
    return [_POOL] + kernel + stride + padding + [int(bool(ceil))], out


# oneDNN's blocked-layout kernels reorder a weight packed by
# ``mkldnn_reorder_conv2d_weight`` (for channels-last input) again at every call, except
# a first convolution's: a convolution joins a chain only while that costs little
# beside its work, with a small weight and many output positions (measured, one thread,
# 3×3: 128 → 128 channels at 8×8, batch 32, 1.01× the channels-last kernel; 256 → 256
# at 14×14, batch 8, 1.09×; 3 → 64 at 56×56, batch 8, 0.67×)
_MAX_WEIGHT = 128 * 128 * 3 * 3
_MIN_POSITIONS = 1024


def _chainable(conv: fx.Node) -> bool:
    w, out = conv.args[1].meta.get("val"), conv.meta.get("val")
    if not isinstance(w, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    n, _, h, wd = out.shape
    return w.numel() <= _MAX_WEIGHT and n * h * wd >= _MIN_POSITIONS


def _next_step(cur: fx.Node):
    """``(kind, step, node ending the step)`` for the only user of ``cur`` if it can
    extend a chain ending at ``cur``, else ``None``."""
    users = list(cur.users)
    if len(users) != 1:
        return None
    node = users[0]
    if node.op != "call_function" or not node.args or node.args[0] is not cur:
        return None
    if node.target is torch.ops.aten.relu.default and len(node.args) == 1:
        return _RELU, [_RELU], node
    if node.target is torch.ops.popart_compiler.onednn_conv2d.default:
        if not _chainable(node):
            return None
        _, _, _, stride, padding, dilation, groups = node.args
        return _CONV, [_CONV] + list(stride) + list(padding) + list(dilation) + \
            [int(groups)], node
    pool = _pool_step(node)
    return None if pool is None else (_POOL, pool[0], pool[1])


def _rewrite(gm: fx.GraphModule, first: fx.Node, chain: list) -> None:
    steps, weights, biases = [], [], []
    for kind, step, node in chain:
        steps += step
        if kind == _CONV:
            weights.append(node.args[1])
            biases.append(node.args[2])
    last = chain[-1][2]
    with gm.graph.inserting_after(last):
        new = gm.graph.call_function(torch.ops.popart_compiler.onednn_conv_chain.default,
                                     (first.args[0], weights, biases, steps))
    new.meta.update(last.meta)
    new.meta["val"] = last.meta["val"].contiguous()
    last.replace_all_uses_with(new)
    for _, _, node in reversed(chain):
        pool = node.args[0] if node.target is operator.getitem else None
        gm.graph.erase_node(node)
        if pool is not None:  # the max_pool2d_with_indices whose values it took
            gm.graph.erase_node(pool)


def fuse_conv_chains(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite the chains of prepacked convolutions, ReLUs and max-poolings of ``gm``
    (see the module docstring) into ``popart_compiler::onednn_conv_chain``. Returns
    ``gm`` (rewritten in place). Inference graphs only (no gradients)."""
    conv = torch.ops.popart_compiler.onednn_conv2d.default
    changed = False
    taken = set()  # nodes of the chains rewritten (erased)
    for node in list(gm.graph.nodes):
        if node in taken or node.op != "call_function" or node.target is not conv or \
                not isinstance(node.args[0], fx.Node) or not _chainable(node):
            continue
        first = node
        _, _, _, stride, padding, dilation, groups = node.args
        chain = [(_CONV, [_CONV] + list(stride) + list(padding) + list(dilation) +
                  [int(groups)], node)]
        while True:
            step = _next_step(chain[-1][2])
            if step is None:
                break
            chain.append(step)
        kinds = [kind for kind, _, _ in chain]
        if kinds.count(_CONV) < 2 and _POOL not in kinds:
            continue
        taken.update(n for _, _, n in chain)
        _rewrite(gm, first, chain)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
