"""Inference on the CPU with oneDNN's prepacked weights (issue 30), for the ``inductor``
backend (and ``auto`` when it keeps Inductor).

oneDNN computes convolutions and linear layers in blocked weight layouts; given plain
weights, it reorders them into that layout at every call. Inference programs rewrite
their float32 2-D convolutions and oneDNN linears into the external kernels below,
which keep the reordered ("prepacked") copy of each weight between calls, and run
convolutions on channels-last activations (oneDNN's fast layout; the convolution's
output stays channels-last, so the next one needs no reorder either). One layer of
ResNet-50 (1024 → 256 channels, 1×1, 14×14, batch 2, one thread of an AMD EPYC):
2.53 ms with PyTorch's convolution, 1.01 ms prepacked on channels-last input.

Weights stay graph inputs, never constants folded into the compiled program (as
Inductor's ``freezing`` would): a packed copy is used only while its weight is the same
tensor, at the same address, with the same version counter (every in-place write bumps
it: ``copyWeightsToDevice``, ``writeWeights``, a mutated buffer), and it is packed again
at the next call otherwise, without recompiling. A packed copy lives as long as its
weight tensor (the cache holds weak references only). Weights created under
``torch.inference_mode`` have no version counter: they run unpacked.

Chains of these convolutions with ReLUs and max-poolings (a CNN's feature extractor)
then run as one kernel in oneDNN's blocked layout (:mod:`~popart_compiler.backends.
conv_chain`): the benchmark CNN (``bench/peers.py --models cnn``) went from 44.7 to
39.1 µs a sample, ONNX Runtime 34.1 / 33.7 µs in the same runs. The kernels are
registered with ``torch.library.Library`` (not ``torch.library.custom_op``, whose
Python dispatch costs ~26 µs a call against ~10 µs).

Linear layers: oneDNN's prepacked kernel for wide layers (:func:`uses_onednn`: at least
64 outputs and 128 inputs), MKL's ``addmm`` on the plain weight below (oneDNN's fixed
cost per call loses there), and a ReLU of a linear's result is fused into it as
oneDNN's post-op (:func:`fuse_linear_relu`). ``bench/linear_kernels.py`` compared the
candidates at 256 rows (one thread, µs, with ReLU): 784→512 ``addmm`` 1354, oneDNN
packed 1250, MKL packed (Inductor's ``freezing``) 1230, ONNX Runtime 1220 (a one-layer
session, its per-run cost included); 512→512: 894, 806, 815, 811; 512→10: 42, 51, 82,
34. MKL's packed GEMM ties oneDNN's on the wide
layers, needs a separate ReLU and loses on narrow ones: not used.

Results agree with the eager kernels to float rounding (oneDNN sums in another order:
about 1e-6 relative).
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

# defines ``popart_compiler::onednn_linear``, which prepack_inference rewrites
from popart_compiler.backends import inductor as _inductor  # noqa: F401

__all__ = ["prepack_inference", "packed_weights", "register_kernel", "KERNELS"]

_lock = threading.Lock()
# id(weight) -> (weakref to the weight, its data_ptr, its version, key, packed copy)
_cache: Dict[int, Tuple[weakref.ref, int, int, tuple, torch.Tensor]] = {}


def packed_weights() -> int:
    """How many weights have a packed copy now (tests)."""
    with _lock:
        return sum(1 for ref, *_ in _cache.values() if ref() is not None)


def _packed(weight: torch.Tensor, key: tuple, pack: Callable[[], torch.Tensor]):
    """The packed copy of ``weight`` for ``key`` (packed now if there is none, or if the
    weight changed since: another address or version); ``None`` for an inference
    tensor (``torch.inference_mode``), which has no version counter: the caller then
    runs on the plain weight."""
    if weight.is_inference():
        return None
    wid = id(weight)
    entry = _cache.get(wid)  # one dict read is atomic: the lock guards the writes
    if entry is not None:
        ref, ptr, version, old_key, packed = entry
        if ref() is weight and ptr == weight.data_ptr() and \
                version == weight._version and old_key == key:
            return packed
    packed = pack()

    def forget(_ref, wid=wid):
        with _lock:
            if _cache.get(wid, (None,))[0] is _ref:
                del _cache[wid]
    with _lock:
        _cache[wid] = (weakref.ref(weight, forget), weight.data_ptr(), weight._version,
                       key, packed)
    return packed


def _onednn_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   stride: List[int], padding: List[int], dilation: List[int],
                   groups: int) -> torch.Tensor:
    """``conv2d(x, weight, bias, stride, padding, dilation, groups)`` by oneDNN with the
    weight prepacked for ``x``'s shape: a channels-last ``(N, O, H', W')`` result for
    ``x`` of shape ``(N, C, H, W)`` (float32, CPU)."""
    x = x.contiguous(memory_format=torch.channels_last)
    shape = tuple(x.shape)

    def pack():
        return torch._C._nn.mkldnn_reorder_conv2d_weight(
            weight.detach().contiguous().to_mkldnn(), padding, stride, dilation, groups,
            list(shape))
    packed = _packed(weight, ("conv2d", tuple(stride), tuple(padding), tuple(dilation),
                              groups, shape), pack)
    bias = bias.contiguous() if bias is not None else None
    if packed is None:
        out = torch.nn.functional.conv2d(x, weight, bias, stride, padding, dilation, groups)
    else:
        out = torch.ops.mkldnn._convolution_pointwise(x, packed, bias, padding, stride,
                                                      dilation, groups, "none", [], "")
    return out.contiguous(memory_format=torch.channels_last)


# The kernels are registered with torch.library.Library rather than
# torch.library.custom_op, whose Python dispatch costs more per call (measured, one
# thread: ~26 µs against ~10 µs); inference only, so they need no autograd formula.
_LIB = torch.library.Library("popart_compiler", "FRAGMENT")  # pylint: disable=no-member
#: Each kernel's op → its Python implementation (the CPU kernel), for graphs that call
#: the implementations directly (:mod:`~popart_compiler.backends.direct`).
KERNELS: Dict[object, Callable] = {}


def register_kernel(name: str, fn: Callable, lib: torch.library.Library = _LIB) -> None:
    """Register ``fn`` as the CPU kernel of ``popart_compiler::name`` (already defined in
    ``lib``) and in :data:`KERNELS`."""
    lib.impl(name, fn, "CPU")
    KERNELS[getattr(torch.ops.popart_compiler, name).default] = fn


_LIB.define("onednn_conv2d(Tensor x, Tensor weight, Tensor? bias, int[] stride, "
            "int[] padding, int[] dilation, int groups) -> Tensor")
register_kernel("onednn_conv2d", _onednn_conv2d)


@torch.library.register_fake("popart_compiler::onednn_conv2d", lib=_LIB)
def _(x, weight, bias, stride, padding, dilation, groups):  # pylint: disable=unused-argument
    return conv2d_fake(x, weight, stride, padding, dilation)


def conv2d_fake(x: torch.Tensor, weight: torch.Tensor, stride: List[int],
                padding: List[int], dilation: List[int]) -> torch.Tensor:
    """The channels-last ``(N, O, H', W')`` result of a 2-D convolution of ``x``
    ``(N, C, H, W)`` with ``weight`` ``(O, C / groups, kH, kW)`` (fake kernels)."""
    n, _, h, w = x.shape
    o, _, kh, kw = weight.shape
    out_h = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    out_w = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return torch.empty((n, o, out_h, out_w), dtype=x.dtype, device=x.device,
                       memory_format=torch.channels_last)


# Defined on the dispatcher directly (a CPU kernel in Python), not with
# ``torch.library.custom_op``, whose Python wrapper cost 12 µs per call (measured on a
# 256×512 by 512×10 linear: 61 µs against 49 µs for the kernel alone; 2 µs this way).
# The contiguous-input tag: Inductor writes the producer (a pooling after channels-last
# convolutions) row-major at once, instead of the kernel's reshape copying it per call.
_LIB.define("onednn_linear_packed(Tensor x, Tensor weight, Tensor? bias, "
            "str post='none') -> Tensor", tags=(torch.Tag.needs_contiguous_strides,))

#: Post-ops the packed linear applies to its result (``post``): oneDNN's fused ones.
LINEAR_POST_OPS = ("none", "relu")


def uses_onednn(m: int, k: int, n: int) -> bool:
    """Whether the packed linear computes an ``(m, k)`` by ``(k, n)`` product with
    oneDNN's prepacked kernel (else MKL's ``addmm`` on the plain weight): for ``n`` ≥ 64
    output features and ``k`` ≥ 128 input features. Below, oneDNN's fixed cost per call
    (about 10 µs) loses (``bench/linear_kernels.py``, one thread of an AMD EPYC, µs:
    256×512→10 ``addmm`` 40.6, packed 46.8; 256×64→128: 33.0 against 43.3; 256×512→128:
    221 against 207). ``m`` is not read: the rule holds from 32 to 256 rows."""
    del m
    return n >= 64 and k >= 128


def _onednn_linear_packed(x: torch.Tensor, weight: torch.Tensor,
                          bias: Optional[torch.Tensor], post: str = "none") -> torch.Tensor:
    """``popart_compiler::onednn_linear`` (``x.reshape(-1, K) @ weight.T + bias``, then
    ``post``: ``"none"`` or ``"relu"``) for ``weight`` of shape ``(N, K)``: a 2-D
    ``(x.numel() // K, N)`` float32 result; by oneDNN with the weight prepacked for the
    number of rows and ``post`` fused, or by ``addmm`` for a small layer
    (:func:`uses_onednn`).

    Raises:
        RuntimeError: ``post`` is none of :data:`LINEAR_POST_OPS`.
    """
    if post not in LINEAR_POST_OPS:
        raise RuntimeError(f"onednn_linear_packed: unknown post-op {post!r}")
    k = weight.shape[1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if not uses_onednn(m, k, weight.shape[0]):
        out = torch.mm(rows, weight.t()) if bias is None else \
            torch.addmm(bias, rows, weight.t())
        return out.relu_() if post == "relu" else out
    packed = _packed(weight, ("linear", m),
                     lambda: torch.ops.mkldnn._reorder_linear_weight(
                         weight.detach().contiguous(), m))
    # oneDNN reads only a dense bias (see popart_compiler::onednn_linear)
    bias = bias.contiguous() if bias is not None else None
    return torch.ops.mkldnn._linear_pointwise(rows, weight if packed is None else packed,
                                              bias, post, [], "")


register_kernel("onednn_linear_packed", _onednn_linear_packed)


@torch.library.register_fake("popart_compiler::onednn_linear_packed", lib=_LIB)
def _(x, weight, bias, post="none"):  # pylint: disable=unused-argument
    return x.new_empty((x.numel() // weight.shape[1], weight.shape[0]))


def float32_cpu(*nodes) -> bool:
    """Whether every one of ``nodes`` is an ``fx.Node`` whose value is a float32 CPU
    tensor."""
    for n in nodes:
        v = n.meta.get("val") if isinstance(n, fx.Node) else None
        if not (isinstance(v, torch.Tensor) and v.dtype == torch.float32
                and v.device.type == "cpu"):
            return False
    return True


def _conv2d_args(node: fx.Node) -> Optional[tuple]:
    """``(x, w, bias, stride, padding, dilation, transposed, groups)`` of an
    ``aten.convolution`` or ``aten.conv2d`` node (defaults filled in), else ``None``."""
    aten = torch.ops.aten
    if node.target is aten.convolution.default:
        x, w, bias, stride, padding, dilation, transposed, _, groups = node.args
        return x, w, bias, stride, padding, dilation, transposed, groups
    if node.target is not aten.conv2d.default:
        return None
    defaults = (None, None, None, [1, 1], [0, 0], [1, 1], 1)
    x, w, bias, stride, padding, dilation, groups = \
        tuple(node.args) + defaults[len(node.args):]
    if isinstance(padding, str):  # "same" / "valid"
        return None

    def pair(v):
        return list(v) * 2 if len(v) == 1 else list(v)
    return x, w, bias, pair(stride), pair(padding), pair(dilation), False, groups


def prepack_inference(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite, for an inference graph on the CPU, float32 2-D convolutions
    (``aten.convolution``, not transposed, and ``aten.conv2d``) into
    ``popart_compiler::onednn_conv2d`` and
    oneDNN linears (``popart_compiler::onednn_linear``, from
    :func:`~popart_compiler.backends.inductor.onednn_linear`) into
    ``popart_compiler::onednn_linear_packed``, where the weight is a graph input
    (a parameter or buffer: computed weights change at every call). Returns ``gm``
    (rewritten in place); unchanged where oneDNN is unavailable. Training graphs must
    not be rewritten (the kernels have no gradients)."""
    if not torch.backends.mkldnn.is_available():
        return gm
    linear = torch.ops.popart_compiler.onednn_linear.default
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target is linear:
            x, w, bias = node.args
            if isinstance(w, fx.Node) and w.op == "placeholder":
                node.target = torch.ops.popart_compiler.onednn_linear_packed.default
                changed = True
            continue
        args = _conv2d_args(node)
        if args is None:
            continue
        x, w, bias, stride, padding, dilation, transposed, groups = args
        x_val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if transposed or not isinstance(w, fx.Node) or w.op != "placeholder" or \
                x_val is None or x_val.dim() != 4 or not float32_cpu(x, w, node) or \
                (bias is not None and not float32_cpu(bias)):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(
                torch.ops.popart_compiler.onednn_conv2d.default,
                (x, w, bias, list(stride), list(padding), list(dilation), int(groups)))
        new.meta.update(node.meta)
        new.meta["val"] = node.meta["val"].contiguous(memory_format=torch.channels_last)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed = True
    changed = fuse_linear_relu(gm.graph) or changed
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
        # chains of these convolutions in oneDNN's layout (the module imports this one)
        # pylint: disable=import-outside-toplevel
        from popart_compiler.backends.conv_chain import fuse_conv_chains
        fuse_conv_chains(gm)
    return gm


def fuse_linear_relu(graph: fx.Graph) -> bool:
    """Fold each ``aten.relu`` (or in-place ``relu_``) of a packed linear's result (its
    only use, possibly through one reshape) into the linear, as oneDNN's post-op
    (``post="relu"``: the result is written once, instead of an Inductor loop reading and
    writing it again). Returns whether ``graph`` changed (rewritten in place; the caller
    recompiles)."""
    packed = torch.ops.popart_compiler.onednn_linear_packed.default
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (torch.ops.aten.relu.default,
                                                             torch.ops.aten.relu_.default):
            continue
        lin = result = node.args[0]
        if isinstance(lin, fx.Node) and lin.target in _RESHAPES and len(lin.users) == 1:
            lin = lin.args[0]  # the linear's result reshaped, then the ReLU
        if not isinstance(lin, fx.Node) or lin.target is not packed or lin.kwargs or \
                len(lin.args) != 3 or len(lin.users) != 1:
            continue
        lin.args = tuple(lin.args) + ("relu",)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        changed = True
    return changed


_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
             torch.ops.aten.reshape.default)
