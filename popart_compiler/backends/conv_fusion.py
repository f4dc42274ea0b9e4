"""Batch normalizations folded into the convolutions before them, with their epilogue, for
inference on the CPU (issue 30; applied by the CPU lowering before
:func:`~popart_compiler.backends.prepack.prepack_inference`).

A ResNet's ``conv → batch_norm → [add(residual)] → [relu]`` becomes one oneDNN
convolution, ``popart_compiler::onednn_conv2d_bn``: the normalization (in inference: a
per-channel scale and shift) is folded into the convolution's weight and bias, and the
residual sum and ReLU run as oneDNN post-ops on the convolution's output while it is
in the cache, instead of Inductor kernels that read and write the activations again
(what ONNX Runtime does for the same graph). The folded weight is packed once into
oneDNN's layout for its input shape and kept (the cache of
:mod:`~popart_compiler.backends.prepack`), keyed by the versions and addresses of the
convolution's and normalization's tensors: an in-place write to any of them
(``copyWeightsToDevice``, ``writeWeights``, a mutated buffer) folds and packs again at
the next call, without recompiling. Weights and statistics stay graph inputs.

A pattern is rewritten where the convolution is a float32 2-D one (not transposed)
whose weight is a graph input and whose only user is an inference ``aten.batch_norm``
with weight, bias and statistics graph inputs; the sum and ReLU are taken when each is
the only user of what comes before it. Activations are channels-last.

A residual sum into another fused convolution's result that nothing reads afterwards
(a bottleneck's down-sampling, then each block's output) is accumulated into it in
place by oneDNN's sum post-op (``popart_compiler::onednn_conv2d_bn_sum_``,
:func:`sum_in_place`): ResNet-50, micro-batch 8, deviceIterations 2, one thread: the
16 summing convolutions took 300 ms of a 983 ms call out of place, 218 ms in place.

Results: those of eager PyTorch to float rounding (the folded weight is rounded once,
oneDNN sums in another order; about 1e-6 relative).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.fx as fx

from popart_compiler.backends import prepack

__all__ = ["fold_batch_norms", "folded_count", "sum_in_place"]

_LIB = torch.library.Library("popart_compiler", "FRAGMENT")  # pylint: disable=no-member
_LIB.define("onednn_conv2d_bn(Tensor x, Tensor weight, Tensor? bias, Tensor? bn_weight, "
            "Tensor? bn_bias, Tensor mean, Tensor var, float eps, Tensor? other, "
            "int[] stride, int[] padding, int[] dilation, int groups, bool relu) -> Tensor")


def _folded(weight, bias, bn_weight, bn_bias, mean, var, eps):
    """``(weight', bias')``: the convolution followed by the normalization as one
    convolution (float32)."""
    scale = torch.rsqrt(var + eps)
    if bn_weight is not None:
        scale = scale * bn_weight
    shift = -mean * scale if bias is None else (bias - mean) * scale
    if bn_bias is not None:
        shift = shift + bn_bias
    return weight * scale.reshape(-1, 1, 1, 1), shift


def _versions(*tensors) -> tuple:
    return tuple((t.data_ptr(), t._version) if t is not None else None for t in tensors)


def _packed_folded(x, weight, bias, bn_weight, bn_bias, mean, var, eps: float,
                   stride: List[int], padding: List[int], dilation: List[int], groups: int):
    """``(packed weight, bias)`` of the folded convolution for channels-last ``x``;
    ``None`` where a statistic is an inference tensor (the plain kernels then run)."""
    stats = (bias, bn_weight, bn_bias, mean, var)
    if any(t is not None and t.is_inference() for t in stats):
        return None
    shape = tuple(x.shape)
    key = ("conv2d_bn", tuple(stride), tuple(padding), tuple(dilation), groups, shape,
           eps, _versions(*stats))

    def pack():
        w, b = _folded(weight.detach(), *(t.detach() if t is not None else None
                                         for t in stats), eps)
        return torch._C._nn.mkldnn_reorder_conv2d_weight(
            w.contiguous().to_mkldnn(), padding, stride, dilation, groups,
            list(shape)), b.contiguous()
    return prepack._packed(weight, key, pack)  # pylint: disable=protected-access


def _conv2d_bn(x, weight, bias, bn_weight, bn_bias, mean, var, eps: float, other,
               stride: List[int], padding: List[int], dilation: List[int], groups: int,
               relu: bool) -> torch.Tensor:
    """``relu?(batch_norm(conv2d(x, weight, bias), ...) + other?)`` for ``x`` of shape
    ``(N, C, H, W)``: a channels-last ``(N, O, H', W')`` result (float32, CPU)."""
    x = x.contiguous(memory_format=torch.channels_last)
    packed = _packed_folded(x, weight, bias, bn_weight, bn_bias, mean, var, eps, stride,
                            padding, dilation, groups)
    if packed is None:  # an inference tensor: the plain kernels
        out = torch.nn.functional.conv2d(x, weight, bias, stride, padding, dilation, groups)
        out = torch.nn.functional.batch_norm(out, mean, var, bn_weight, bn_bias, False,
                                             0.0, eps)
        out = out + other if other is not None else out
        out = torch.relu(out) if relu else out
        return out.contiguous(memory_format=torch.channels_last)
    w, b = packed
    unary = "relu" if relu else "none"
    if other is None:
        return torch.ops.mkldnn._convolution_pointwise(x, w, b, padding, stride, dilation,
                                                      groups, unary, [], "")
    other = other.contiguous(memory_format=torch.channels_last)
    return torch.ops.mkldnn._convolution_pointwise.binary(
        x, other, w, b, padding, stride, dilation, groups, "add", 1.0,
        unary if relu else None, [], "")


def _conv2d_bn_sum_(x, weight, bias, bn_weight, bn_bias, mean, var, eps: float, other,
                    stride: List[int], padding: List[int], dilation: List[int],
                    groups: int, relu: bool) -> None:
    """``other = relu?(batch_norm(conv2d(x, weight, bias), ...) + other)``, in place
    (``other``: the residual, ``(N, O, H', W')``, float32, CPU): oneDNN's sum post-op
    accumulates the convolution into ``other``'s memory, so no output is allocated (a
    fresh tensor of tens of MB costs page faults at every call) and the sum reads
    ``other`` in the convolution's own loop (its binary post-op, used out of place, is
    slower: 128 → 512 channels, 1×1, 28×28, batch 16, one thread: 17.1 ms against
    14.1 ms)."""
    if not other.is_contiguous(memory_format=torch.channels_last):
        other.copy_(_conv2d_bn(x, weight, bias, bn_weight, bn_bias, mean, var, eps, other,
                               stride, padding, dilation, groups, relu))
        return
    x = x.contiguous(memory_format=torch.channels_last)
    packed = _packed_folded(x, weight, bias, bn_weight, bn_bias, mean, var, eps, stride,
                            padding, dilation, groups)
    if packed is None:
        other.copy_(_conv2d_bn(x, weight, bias, bn_weight, bn_bias, mean, var, eps, other,
                               stride, padding, dilation, groups, relu))
        return
    w, b = packed
    torch.ops.mkldnn._convolution_pointwise_.binary(
        other, x, w, b, padding, stride, dilation, groups, "add", 1.0,
        "relu" if relu else None, [], "")


prepack.register_kernel("onednn_conv2d_bn", _conv2d_bn, _LIB)
_LIB.define("onednn_conv2d_bn_sum_(Tensor x, Tensor weight, Tensor? bias, Tensor? bn_weight, "
            "Tensor? bn_bias, Tensor mean, Tensor var, float eps, Tensor(a!) other, "
            "int[] stride, int[] padding, int[] dilation, int groups, bool relu) -> ()")
prepack.register_kernel("onednn_conv2d_bn_sum_", _conv2d_bn_sum_, _LIB)


@torch.library.register_fake("popart_compiler::onednn_conv2d_bn", lib=_LIB)
def _(x, weight, bias, bn_weight, bn_bias, mean, var, eps, other, stride, padding,
      dilation, groups, relu):  # pylint: disable=unused-argument
    return prepack.conv2d_fake(x, weight, stride, padding, dilation)


@torch.library.register_fake("popart_compiler::onednn_conv2d_bn_sum_", lib=_LIB)
def _(x, weight, bias, bn_weight, bn_bias, mean, var, eps, other, stride, padding,
      dilation, groups, relu):  # pylint: disable=unused-argument
    return None


def folded_count(gm: fx.GraphModule) -> int:
    """Number of ``popart_compiler::onednn_conv2d_bn`` and ``onednn_conv2d_bn_sum_`` nodes
    in ``gm`` (tests)."""
    ops = (torch.ops.popart_compiler.onednn_conv2d_bn.default,
           torch.ops.popart_compiler.onednn_conv2d_bn_sum_.default)
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in ops)


def _only_user(node: fx.Node, target) -> Optional[fx.Node]:
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    return user if user.op == "call_function" and user.target is target else None


def _epilogue(bn: fx.Node):
    """``(last node, other, relu)`` of what follows ``bn``: a sum with another tensor of
    the same shape and dtype, then a ReLU, each optional."""
    aten = torch.ops.aten
    last, other = bn, None
    add = _only_user(bn, aten.add.Tensor)
    if add is not None and not add.kwargs and len(add.args) == 2:
        x = add.args[1] if add.args[0] is bn else add.args[0]
        x_val, bn_val = (x.meta.get("val") if isinstance(x, fx.Node) else None,
                         bn.meta.get("val"))
        if x is not bn and isinstance(x_val, torch.Tensor) and \
                isinstance(bn_val, torch.Tensor) and \
                x_val.shape == bn_val.shape and x_val.dtype == bn_val.dtype:
            last, other = add, x
    relu = _only_user(last, aten.relu.default)
    return (relu, other, True) if relu is not None else (last, other, False)


def fold_batch_norms(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite the patterns of the module docstring into
    ``popart_compiler::onednn_conv2d_bn`` (in place; returns ``gm``; unchanged where
    oneDNN is unavailable). Inference graphs only: the kernel has no gradient."""
    if not torch.backends.mkldnn.is_available():
        return gm
    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.kwargs:
            continue
        args = prepack._conv2d_args(node)  # pylint: disable=protected-access
        bn = _only_user(node, aten.batch_norm.default)
        if args is None or bn is None or bn.kwargs or bn.args[0] is not node:
            continue
        x, w, bias, stride, padding, dilation, transposed, groups = args
        _, bn_w, bn_b, mean, var, training, _, eps = bn.args[:8]
        tensors = [t for t in (w, bias, bn_w, bn_b, mean, var) if t is not None]
        x_val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if transposed or training or mean is None or var is None or x_val is None or \
                x_val.dim() != 4 or not prepack.float32_cpu(x, node, *tensors) or \
                any(not isinstance(t, fx.Node) or t.op != "placeholder" for t in tensors):
            continue
        last, other, relu = _epilogue(bn)
        with gm.graph.inserting_before(last):
            new = gm.graph.call_function(
                torch.ops.popart_compiler.onednn_conv2d_bn.default,
                (x, w, bias, bn_w, bn_b, mean, var, float(eps), other, list(stride),
                 list(padding), list(dilation), int(groups), relu))
        new.meta.update(last.meta)
        new.meta["val"] = last.meta["val"].contiguous(memory_format=torch.channels_last)
        last.replace_all_uses_with(new)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        sum_in_place(gm.graph)
        gm.recompile()
    return gm


def sum_in_place(graph: fx.Graph) -> bool:
    """Rewrite each ``onednn_conv2d_bn`` with a residual ``other`` into
    ``onednn_conv2d_bn_sum_``, which accumulates into ``other`` in place, where that is
    invisible: ``other`` is the result of another ``onednn_conv2d_bn`` (a fresh
    channels-last tensor, no view of a graph input), not the convolution's input too,
    and nothing after the convolution reads it (its other readers, such as the block's
    first convolution, come before).
    The convolution's users then read ``other``. Returns whether ``graph`` changed
    (rewritten in place; the caller recompiles). Inductor's functionalization sees the
    mutation in the op's schema (``Tensor(a!) other``) and, as nothing reads ``other``
    later, keeps it in place (no copy)."""
    fused = torch.ops.popart_compiler.onednn_conv2d_bn.default
    changed = False
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not fused:
            continue
        other = node.args[8]
        if not isinstance(other, fx.Node) or other.target is not fused or \
                any(a is other for i, a in enumerate(node.args) if i != 8):
            continue  # (the convolution reading ``other`` would read what it writes)
        if any(order[u] > order[node] for u in other.users if u is not node):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.popart_compiler.onednn_conv2d_bn_sum_.default,
                                      node.args)
        new.meta["val"] = None
        order[new] = order[node]
        node.replace_all_uses_with(other)
        graph.erase_node(node)
        changed = True
    return changed
