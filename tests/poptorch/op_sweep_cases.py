"""The cases of the ATen op sweep, by family (see ``op_sweep.py``).

Every case runs on tiny float32 / int64 / bool inputs. Domains are chosen so that
results are finite (``P``: positive, ``U``: inside (-1, 1)). Random ops are not here:
their values cannot equal plain PyTorch's (see ``test_rng.py`` for the device RNG).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F_

from op_sweep import B, C, Case, F, I, P, U

CASES = []


def _add(family, name, fn, *inputs, module=None, grad=True, tol=1e-5):
    CASES.append(Case(name, family, fn, inputs, module, grad, tol))


ew = functools.partial(_add, "elementwise")
act = functools.partial(_add, "activations")
red = functools.partial(_add, "reductions")
idx = functools.partial(_add, "indexing, scatter/gather, shapes")
conv = functools.partial(_add, "convolution")
pool = functools.partial(_add, "pooling, resampling")
norm = functools.partial(_add, "normalisation")
rnn = functools.partial(_add, "recurrent layers")
attn = functools.partial(_add, "attention")
loss = functools.partial(_add, "losses")
la = functools.partial(_add, "linear algebra")
fft = functools.partial(_add, "FFT (real in, real out)")
fac = functools.partial(_add, "factories")
X, Y = F(3, 4), F(3, 4)


def _eye(n, like):
    return torch.eye(n, device=like.device, dtype=like.dtype)


def _spd(a):
    return a @ a.mT + 3 * _eye(a.shape[-1], a)


# -- elementwise ---------------------------------------------------------------------------
for _name in ["abs", "neg", "sin", "cos", "atan", "sinh", "cosh", "tanh", "asinh", "exp",
              "exp2", "expm1", "sigmoid", "erf", "erfc", "sign", "sgn", "ceil", "floor",
              "round", "trunc", "frac", "square", "i0", "sinc", "deg2rad", "rad2deg",
              "nan_to_num", "fix", "positive", "conj_physical"]:
    ew(_name, getattr(torch, _name), X)
for _name in ["log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "lgamma",
              "digamma"]:
    ew(_name, getattr(torch, _name), P(3, 4))
for _name in ["tan", "asin", "acos", "atanh", "erfinv"]:
    ew(_name, getattr(torch, _name), U(3, 4))
for _name in ["i0e", "i1", "i1e", "ndtr", "log_ndtr", "erfcx", "bessel_j0", "bessel_j1",
              "spherical_bessel_j0", "expit"]:
    ew(f"special.{_name}", getattr(torch.special, _name), X,
       grad=_name not in ("bessel_j0", "bessel_j1", "spherical_bessel_j0"))
ew("special.ndtri", lambda u: torch.special.ndtri((u + 1) / 2), U(3, 4))
ew("special.entr", torch.special.entr, P(3, 4))
ew("special.xlog1py", torch.special.xlog1py, P(3, 4), P(3, 4))
ew("special.zeta", lambda p: torch.special.zeta(p + 1.5, 1.0), P(3, 4), grad=False)
ew("acosh", lambda x: torch.acosh(x + 1.5), P(3, 4))
ew("logit", lambda u: torch.logit((u + 1) / 2), U(3, 4))
ew("polygamma", lambda x: torch.polygamma(1, x), P(3, 4))
ew("mvlgamma", lambda x: torch.mvlgamma(x + 2, p=2), P(3, 4))
ew("round.decimals", lambda x: torch.round(x, decimals=1), X)
ew("angle", torch.angle, X)
for _name in ["add", "sub", "mul", "div", "atan2", "hypot", "maximum", "minimum", "fmax",
              "fmin", "logaddexp", "logaddexp2", "copysign", "true_divide", "rsub"]:
    ew(_name, getattr(torch, _name), X, Y)
for _name in ["fmod", "remainder", "xlogy", "pow"]:
    ew(_name, getattr(torch, _name), P(3, 4), P(3, 4))
ew("add.alpha", lambda a, b: torch.add(a, b, alpha=0.5), X, Y)
ew("pow.scalar", lambda x: x ** 3, X)
ew("pow.scalar_base", lambda x: 2.0 ** x, X)
ew("float_power", torch.float_power, P(3, 4), P(3, 4))
ew("div.floor", lambda a, b: torch.div(a, b, rounding_mode="floor"), X, P(3, 4))
ew("div.trunc", lambda a, b: torch.div(a, b, rounding_mode="trunc"), X, P(3, 4))
ew("floor_divide", torch.floor_divide, X, P(3, 4), grad=False)
ew("nextafter", torch.nextafter, X, Y, grad=False)
ew("heaviside", torch.heaviside, X, Y, grad=False)
ew("ldexp", lambda x, e: torch.ldexp(x, e), X, I(4, 3, 4))
ew("lerp", torch.lerp, X, Y, U(3, 4))
ew("lerp.scalar", lambda a, b: torch.lerp(a, b, 0.3), X, Y)
ew("addcmul", lambda a, b, c: torch.addcmul(a, b, c, value=0.5), X, Y, F(3, 4))
ew("addcdiv", lambda a, b, c: torch.addcdiv(a, b, c, value=0.5), X, Y, P(3, 4))
ew("where", torch.where, B(3, 4), X, Y)
ew("clamp", lambda x: torch.clamp(x, -0.5, 0.5), X)
ew("clamp.tensor", torch.clamp, X, F(3, 4), P(3, 4))
ew("clamp_min", lambda x: torch.clamp_min(x, 0.1), X)
ew("clamp_max", lambda x: torch.clamp_max(x, 0.1), X)
ew("masked_fill", lambda x, m: x.masked_fill(m, -2.0), X, B(3, 4))
ew("frexp", torch.frexp, P(3, 4), grad=False)
for _name in ["signbit", "isnan", "isinf", "isfinite", "isposinf", "isneginf",
              "logical_not"]:
    ew(_name, getattr(torch, _name), X, grad=False)
for _name in ["eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
              "logical_xor", "isclose"]:
    ew(_name, getattr(torch, _name), X, Y, grad=False)
for _name in ["bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift",
              "bitwise_right_shift", "gcd", "lcm"]:
    ew(_name, getattr(torch, _name), I(8, 3, 4), I(4, 3, 4), grad=False)
ew("bitwise_not", torch.bitwise_not, I(8, 3, 4), grad=False)
ew("to.dtype", lambda x: (x * 4).to(torch.int32), X, grad=False)
ew("type_as", lambda x, i: x * i.type_as(x), X, I(3, 3, 4))

# -- activations ---------------------------------------------------------------------------
for _name in ["relu", "relu6", "elu", "selu", "celu", "gelu", "silu", "mish", "softplus",
              "softsign", "softshrink", "hardshrink", "tanhshrink", "hardtanh",
              "hardsigmoid", "hardswish", "logsigmoid", "leaky_relu"]:
    act(_name, getattr(F_, _name), X)
act("gelu.tanh", lambda x: F_.gelu(x, approximate="tanh"), X)
act("threshold", lambda x: F_.threshold(x, 0.2, -1.0), X)
act("rrelu.eval", lambda x: F_.rrelu(x, training=False), X)
act("prelu", F_.prelu, F(2, 3, 4), P(3))
act("glu", F_.glu, F(3, 4))
act("softmax", lambda x: F_.softmax(x, -1), X)
act("log_softmax", lambda x: F_.log_softmax(x, -1), X)
act("softmin", lambda x: F_.softmin(x, 0), X)
act("normalize", F_.normalize, X)
act("dropout.eval", lambda x: F_.dropout(x, 0.5, training=False) * 2, X)

# -- reductions ----------------------------------------------------------------------------
for _name in ["sum", "mean", "amax", "amin", "std", "var", "nansum", "nanmean",
              "logsumexp", "norm"]:
    red(f"{_name}.dim", functools.partial(getattr(torch, _name), dim=1), X)
for _name in ["sum", "mean", "prod", "max", "min", "median", "nanmedian", "std", "var"]:
    red(_name, getattr(torch, _name), X)
for _name in ["max", "min", "median", "nanmedian", "mode", "cummax", "cummin"]:
    red(f"{_name}.dim", functools.partial(getattr(torch, _name), dim=1), X)
for _name in ["cumsum", "cumprod", "logcumsumexp", "argmax", "argmin", "argsort",
              "count_nonzero", "all", "any"]:
    red(_name, functools.partial(getattr(torch, _name), dim=1), X,
        grad=_name not in ("argmax", "argmin", "argsort", "count_nonzero", "all", "any"))
red("prod.dim", lambda x: torch.prod(x, 1), X)
red("std_mean", lambda x: torch.std_mean(x, dim=1), X)
red("var_mean", lambda x: torch.var_mean(x, dim=0, correction=0), X)
red("aminmax", lambda x: torch.aminmax(x, dim=1), X, grad=False)
red("vector_norm", lambda x: torch.linalg.vector_norm(x, 3, dim=1), X)
red("norm.p1", lambda x: torch.norm(x, p=1), X)
red("kthvalue", lambda x: torch.kthvalue(x, 2, dim=1), X)
red("topk", lambda x: torch.topk(x, 2, dim=1), X)
red("sort", lambda x: torch.sort(x, dim=1, descending=True), X)
red("msort", torch.msort, X)
red("quantile", lambda x: torch.quantile(x, 0.3, dim=1), X)
red("nanquantile", lambda x: torch.nanquantile(x, 0.7), X)
red("diff", lambda x: torch.diff(x, dim=1), X)
red("trace", torch.trace, F(4, 4))
red("dist", torch.dist, X, Y)
red("renorm", lambda x: torch.renorm(x, 2, 0, 1.0), X)
red("cdist", torch.cdist, F(3, 4), F(5, 4))
red("pdist", F_.pdist, F(4, 3))
red("cosine_similarity", F_.cosine_similarity, X, Y)
red("pairwise_distance", F_.pairwise_distance, X, Y)
red("histc", lambda x: torch.histc(x, bins=5, min=-2, max=2), X, grad=False)
red("bucketize", lambda x, b: torch.bucketize(x, b.sort().values), X, F(5), grad=False)
red("searchsorted", lambda s, v: torch.searchsorted(s.sort(dim=1).values, v), X, Y,
    grad=False)
red("all.bool", lambda m: torch.all(m), B(3, 4), grad=False)

# -- indexing, scatter/gather, shapes ------------------------------------------------------
J = I(3, 2, 4)  # indices into dim 0 of X
idx("index_select", lambda x, i: torch.index_select(x, 1, i), X, I(4, 5))
idx("gather", lambda x, i: torch.gather(x, 0, i), X, J)
idx("take_along_dim", lambda x, i: torch.take_along_dim(x, i, 0), X, J)
idx("take", torch.take, X, I(12, 5))
idx("scatter", lambda x, i, s: x.scatter(0, i, s), X, J, F(2, 4))
idx("scatter.value", lambda x, i: x.scatter(0, i, 1.5), X, J)
idx("scatter_add", lambda x, i, s: x.scatter_add(0, i, s), X, J, F(2, 4))
for _reduce in ["sum", "prod", "mean", "amax", "amin"]:
    idx(f"scatter_reduce.{_reduce}", lambda x, i, s, r=_reduce: x.scatter_reduce(
        0, i, s, r, include_self=True), X, J, F(2, 4))
idx("index_add", lambda x, i, s: x.index_add(0, i, s, alpha=2), X, I(3, 2), F(2, 4))
idx("index_copy", lambda x, s: x.index_copy(0, torch.tensor([2, 0]), s), X, F(2, 4))
idx("index_fill", lambda x: x.index_fill(1, torch.tensor([0, 3]), -1.0), X)
idx("index_reduce", lambda x, s: x.index_reduce(0, torch.tensor([2, 0]), s, "prod"),
    X, F(2, 4))
idx("index_put", lambda x, v: x.index_put((torch.tensor([0, 2]),), v), X, F(2, 4))
idx("index_put.accumulate", lambda x, v: x.index_put(
    (torch.tensor([0, 0]),), v, accumulate=True), X, F(2, 4))
idx("setitem", lambda x, v: x.clone().__setitem__((slice(None), 1), v) or x, X, F(3))
idx("getitem.int_tensor", lambda x, i: x[i], X, I(3, 5))
idx("getitem.advanced", lambda x, i, j: x[i, j], X, I(3, 5), I(4, 5))
idx("getitem.slices", lambda x: x[1:, ::2], X)
idx("masked_scatter", lambda x, m, s: x.masked_scatter(m, s), X, B(3, 4), F(3, 4))
idx("put", lambda x, s: x.put(torch.tensor([0, 5]), s), X, F(2))
idx("nonzero_static", lambda m: torch.nonzero_static(m, size=4), B(3, 4), grad=False)
idx("narrow", lambda x: torch.narrow(x, 1, 1, 2), X)
idx("select", lambda x: torch.select(x, 0, 1), X)
idx("cat", lambda a, b: torch.cat([a, b], 1), X, Y)
idx("stack", lambda a, b: torch.stack([a, b], 0), X, Y)
idx("hstack", lambda a, b: torch.hstack([a, b]), X, Y)
idx("split", lambda x: torch.split(x, [1, 3], 1), X)
idx("chunk", lambda x: torch.chunk(x, 2, 1), X)
idx("unbind", lambda x: torch.unbind(x, 0), X)
idx("tensor_split", lambda x: torch.tensor_split(x, 3, 1), X)
idx("flip", lambda x: torch.flip(x, [0, 1]), X)
idx("roll", lambda x: torch.roll(x, (1, -1), (0, 1)), X)
idx("rot90", torch.rot90, X)
idx("transpose", lambda x: x.transpose(0, 1) * 1, X)
idx("permute", lambda x: x.permute(2, 0, 1) * 1, F(2, 3, 4))
idx("reshape", lambda x: x.reshape(4, 3) * 1, X)
idx("expand", lambda x: x.expand(2, 3, 4) * 1, X)
idx("repeat", lambda x: x.repeat(2, 1), X)
idx("tile", lambda x: torch.tile(x, (2,)), X)
idx("squeeze", lambda x: x.squeeze(1) * 1, F(3, 1, 4))
idx("unsqueeze", lambda x: x.unsqueeze(1) * 1, X)
idx("flatten", lambda x: x.flatten() * 1, F(2, 3, 4))
idx("unflatten", lambda x: x.unflatten(1, (2, 2)) * 1, X)
idx("movedim", lambda x: torch.movedim(x, 0, 2) * 1, F(2, 3, 4))
idx("diagonal", lambda x: torch.diagonal(x, 1) * 1, F(4, 4))
idx("diag", torch.diag, F(4))
idx("diag_embed", torch.diag_embed, X)
idx("tril", torch.tril, F(4, 4))
idx("triu", lambda x: torch.triu(x, 1), F(4, 4))
idx("meshgrid", lambda a, b: torch.meshgrid(a, b, indexing="ij"), F(3), F(4))
idx("cartesian_prod", torch.cartesian_prod, F(3), F(2))
idx("combinations", torch.combinations, F(4))
idx("repeat_interleave", lambda x: torch.repeat_interleave(x, 2, dim=0), X)
idx("repeat_interleave.output_size", lambda x, r: torch.repeat_interleave(
    x, r + 2, dim=0, output_size=6), X, I(1, 3))
idx("kron", torch.kron, F(2, 2), F(2, 3))
idx("block_diag", torch.block_diag, F(2, 2), F(1, 3))
for _mode in ["constant", "reflect", "replicate", "circular"]:
    idx(f"pad.{_mode}", lambda x, m=_mode: F_.pad(x, (1, 2), mode=m), F(2, 3, 4))
idx("embedding", F_.embedding, I(5, 2, 3), F(5, 4))
idx("embedding_bag", lambda i, w: F_.embedding_bag(i, w, torch.tensor([0, 2]),
                                                   mode="mean"), I(5, 5), F(5, 4))
idx("one_hot", lambda i: F_.one_hot(i, 5), I(5, 3, 2), grad=False)
idx("clone", lambda x: x.clone(), X)
idx("as_strided", lambda x: torch.as_strided(x, (2, 2), (1, 2)) * 1, X)
idx("unfold", lambda x: x.unfold(1, 2, 1) * 1, X)
idx("im2col", lambda x: F_.unfold(x, 2), F(1, 2, 3, 4))
idx("col2im", lambda x: F_.fold(x, (3, 3), 2), F(1, 8, 4))
idx("pixel_shuffle", lambda x: F_.pixel_shuffle(x, 2), F(1, 8, 2, 3))
idx("pixel_unshuffle", lambda x: F_.pixel_unshuffle(x, 2), F(1, 2, 4, 2))
idx("channel_shuffle", lambda x: F_.channel_shuffle(x, 2), F(1, 4, 2, 2))
idx("diagonal_scatter", lambda x, d: torch.diagonal_scatter(x, d), F(4, 4), F(4))
idx("select_scatter", lambda x, s: torch.select_scatter(x, s, 0, 1), X, F(4))
idx("slice_scatter", lambda x, s: torch.slice_scatter(x, s, 1, 0, 2), X, F(3, 2))
idx("atleast_3d", lambda x: torch.atleast_3d(x) * 1, X)
idx("swapaxes", lambda x: torch.swapaxes(x, 0, 1) * 1, X)
idx("view_as", lambda x, y: x.view_as(y) * 1, X, F(4, 3))
idx("copy_", lambda x, y: x.clone().copy_(y), X, Y)
idx("fill_", lambda x: x.clone().fill_(2.0), X)
idx("zero_", lambda x: x.clone().zero_(), X)

# -- factories -----------------------------------------------------------------------------
fac("arange", lambda x: x + torch.arange(4, device=x.device), X)
fac("linspace", lambda x: x + torch.linspace(0, 1, 4, device=x.device), X)
fac("logspace", lambda x: x + torch.logspace(0, 1, 4, device=x.device), X)
fac("full", lambda x: x * torch.full((3, 4), 2.0, device=x.device), X)
fac("zeros_ones", lambda x: x + torch.zeros(3, 4, device=x.device)
    + torch.ones(4, device=x.device), X)
fac("like", lambda x: torch.full_like(x, 3.0) * x + torch.ones_like(x)
    + torch.zeros_like(x), X)
fac("eye", lambda x: x + torch.eye(3, 4, device=x.device), X)
fac("tril_indices", lambda x: x[tuple(torch.tril_indices(3, 3, device=x.device))], X)
fac("scalar_tensor", lambda x: x * torch.scalar_tensor(3.0, device=x.device), X)
fac("new_zeros", lambda x: x.new_zeros(2) + x.new_full((2,), 1.0) + x[0, :2], X)

# -- convolution ---------------------------------------------------------------------------
conv("conv1d", lambda m, x: m(x), F(2, 3, 7), module=lambda: nn.Conv1d(3, 4, 3))
conv("conv2d", lambda m, x: m(x), F(2, 3, 6, 5), module=lambda: nn.Conv2d(3, 4, 3))
conv("conv3d", lambda m, x: m(x), F(1, 2, 4, 4, 4), module=lambda: nn.Conv3d(2, 3, 2))
conv("conv2d.groups_dilation_stride", lambda m, x: m(x), F(1, 4, 7, 7),
     module=lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2))
conv("conv2d.same", lambda m, x: m(x), F(1, 2, 5, 5),
     module=lambda: nn.Conv2d(2, 2, 3, padding="same", padding_mode="reflect"))
conv("conv_transpose1d", lambda m, x: m(x), F(2, 3, 5),
     module=lambda: nn.ConvTranspose1d(3, 2, 3, stride=2))
conv("conv_transpose2d", lambda m, x: m(x), F(1, 3, 4, 4),
     module=lambda: nn.ConvTranspose2d(3, 2, 3, stride=2, output_padding=1))
conv("conv_transpose3d", lambda m, x: m(x), F(1, 2, 3, 3, 3),
     module=lambda: nn.ConvTranspose3d(2, 2, 2))
conv("conv2d.functional", lambda x, w, b: F_.conv2d(x, w, b, padding=1),
     F(1, 2, 4, 4), F(3, 2, 3, 3), F(3))

# -- pooling, resampling -------------------------------------------------------------------
IMG = F(1, 2, 6, 6)
pool("max_pool1d", lambda x: F_.max_pool1d(x, 2), F(2, 3, 6))
pool("max_pool2d", lambda x: F_.max_pool2d(x, 3, stride=2, padding=1), IMG)
pool("max_pool2d.indices", lambda x: F_.max_pool2d(x, 2, return_indices=True), IMG)
pool("max_pool3d", lambda x: F_.max_pool3d(x, 2), F(1, 2, 4, 4, 4))
pool("avg_pool1d", lambda x: F_.avg_pool1d(x, 3, stride=1), F(2, 3, 6))
pool("avg_pool2d", lambda x: F_.avg_pool2d(x, 2, ceil_mode=True), F(1, 2, 5, 5))
pool("avg_pool3d", lambda x: F_.avg_pool3d(x, 2), F(1, 2, 4, 4, 4))
pool("adaptive_avg_pool1d", lambda x: F_.adaptive_avg_pool1d(x, 4), F(2, 3, 7))
pool("adaptive_avg_pool2d", lambda x: F_.adaptive_avg_pool2d(x, (3, 2)), F(1, 2, 7, 5))
pool("adaptive_avg_pool3d", lambda x: F_.adaptive_avg_pool3d(x, 2), F(1, 2, 5, 4, 3))
pool("adaptive_max_pool1d", lambda x: F_.adaptive_max_pool1d(x, 3), F(2, 3, 7))
pool("adaptive_max_pool2d", lambda x: F_.adaptive_max_pool2d(x, 3), F(1, 2, 7, 5))
pool("adaptive_max_pool3d", lambda x: F_.adaptive_max_pool3d(x, 2), F(1, 2, 5, 4, 3))
pool("lp_pool1d", lambda x: F_.lp_pool1d(x, 2, 2), P(2, 3, 6))
pool("lp_pool2d", lambda x: F_.lp_pool2d(x, 3, 2), P(1, 2, 6, 6))
pool("max_unpool2d", lambda x: F_.max_unpool2d(*F_.max_pool2d(x, 2, return_indices=True),
                                                2), IMG)
pool("max_unpool1d", lambda x: F_.max_unpool1d(*F_.max_pool1d(x, 2, return_indices=True),
                                                2), F(2, 3, 6))
for _mode in ["nearest", "nearest-exact", "bilinear", "bicubic", "area"]:
    pool(f"interpolate.{_mode}", lambda x, m=_mode: F_.interpolate(
        x, size=(5, 7), mode=m), F(1, 2, 3, 4))
pool("interpolate.bilinear_align", lambda x: F_.interpolate(
    x, scale_factor=2, mode="bilinear", align_corners=True), F(1, 2, 3, 4))
pool("interpolate.linear", lambda x: F_.interpolate(x, size=7, mode="linear"), F(1, 2, 4))
pool("interpolate.trilinear", lambda x: F_.interpolate(x, size=(3, 4, 5),
                                                       mode="trilinear"), F(1, 2, 2, 3, 3))
pool("interpolate.nearest1d", lambda x: F_.interpolate(x, scale_factor=2), F(1, 2, 4))
pool("grid_sample", lambda x, g: F_.grid_sample(x, g, align_corners=False), IMG,
     U(1, 3, 4, 2))
pool("grid_sample.nearest", lambda x, g: F_.grid_sample(x, g, mode="nearest",
                                                        align_corners=True),
     IMG, U(1, 3, 4, 2), grad=False)
pool("affine_grid", lambda t: F_.affine_grid(t, (1, 2, 3, 4), align_corners=False),
     F(1, 2, 3))

# -- normalisation -------------------------------------------------------------------------
norm("batch_norm.train", lambda m, x: m(x), F(4, 3, 2), module=lambda: nn.BatchNorm1d(3))
norm("batch_norm2d.train", lambda m, x: m(x), F(2, 3, 2, 2),
     module=lambda: nn.BatchNorm2d(3))
norm("batch_norm3d.eval", lambda m, x: m(x), F(2, 3, 2, 2, 2),
     module=lambda: nn.BatchNorm3d(3).eval())
norm("batch_norm.functional_eval", lambda x, w, b: F_.batch_norm(
    x, torch.zeros(3, device=x.device), torch.ones(3, device=x.device), w, b), F(4, 3),
    F(3), F(3))
norm("layer_norm", lambda m, x: m(x), F(2, 3, 4), module=lambda: nn.LayerNorm(4))
norm("layer_norm.2d", lambda x, w: F_.layer_norm(x, (3, 4), w), F(2, 3, 4), F(3, 4))
norm("group_norm", lambda m, x: m(x), F(2, 4, 3), module=lambda: nn.GroupNorm(2, 4))
norm("instance_norm", lambda m, x: m(x), F(2, 3, 5),
     module=lambda: nn.InstanceNorm1d(3, affine=True))
norm("instance_norm2d.stats", lambda m, x: m(x), F(2, 3, 3, 3),
     module=lambda: nn.InstanceNorm2d(3, track_running_stats=True))
norm("local_response_norm", lambda x: F_.local_response_norm(x, 2), F(1, 4, 3, 3))
norm("rms_norm", lambda m, x: m(x), F(2, 3, 4), module=lambda: nn.RMSNorm(4))
norm("weight_norm", lambda m, x: m(x), F(2, 3),
     module=lambda: nn.utils.parametrizations.weight_norm(nn.Linear(3, 2)))

# -- recurrent layers ----------------------------------------------------------------------
SEQ = F(2, 5, 3)  # batch_first
for _cls in ["RNN", "LSTM", "GRU"]:
    rnn(_cls, lambda m, x: m(x), SEQ, module=lambda c=_cls: getattr(nn, c)(
        3, 4, batch_first=True))
rnn("RNN.relu_2layers", lambda m, x: m(x), SEQ, module=lambda: nn.RNN(
    3, 4, num_layers=2, nonlinearity="relu", batch_first=True))
rnn("LSTM.bidirectional", lambda m, x: m(x), SEQ, module=lambda: nn.LSTM(
    3, 4, bidirectional=True, batch_first=True))
rnn("LSTM.proj_size", lambda m, x: m(x), SEQ, module=lambda: nn.LSTM(
    3, 4, proj_size=2, batch_first=True))
rnn("GRU.2layers_h0", lambda m, x, h: m(x, h), F(5, 2, 3), F(2, 2, 4),
    module=lambda: nn.GRU(3, 4, num_layers=2))
rnn("LSTM.unbatched", lambda m, x: m(x), F(5, 3), module=lambda: nn.LSTM(3, 4))
for _cls in ["RNNCell", "LSTMCell", "GRUCell"]:
    rnn(_cls, lambda m, x: m(x), F(2, 3), module=lambda c=_cls: getattr(nn, c)(3, 4))

# -- attention -----------------------------------------------------------------------------
Q = F(2, 2, 3, 4)
attn("sdpa", F_.scaled_dot_product_attention, Q, F(2, 2, 5, 4), F(2, 2, 5, 4))
attn("sdpa.causal", lambda q, k, v: F_.scaled_dot_product_attention(
    q, k, v, is_causal=True), Q, F(2, 2, 3, 4), F(2, 2, 3, 4))
attn("sdpa.float_mask", F_.scaled_dot_product_attention, Q, F(2, 2, 5, 4),
     F(2, 2, 5, 4), F(3, 5))
attn("sdpa.bool_mask", lambda q, k, v, m: F_.scaled_dot_product_attention(
    q, k, v, m | torch.eye(3, 5, dtype=torch.bool, device=m.device)), Q, F(2, 2, 5, 4),
     F(2, 2, 5, 4), B(3, 5))
attn("MultiheadAttention", lambda m, q, k: m(q, k, k), F(2, 3, 8), F(2, 5, 8),
     module=lambda: nn.MultiheadAttention(8, 2, batch_first=True))
attn("MultiheadAttention.mask_no_weights", lambda m, q, p: m(
    q, q, q, key_padding_mask=p & torch.tensor([False, True, True], device=p.device),
    need_weights=False), F(2, 3, 8),
     B(2, 3), module=lambda: nn.MultiheadAttention(8, 2, batch_first=True, bias=False))
attn("TransformerEncoderLayer", lambda m, x: m(x), F(2, 4, 8),
     module=lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True))
attn("TransformerDecoderLayer", lambda m, x, y: m(x, y), F(2, 3, 8), F(2, 4, 8),
     module=lambda: nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                               norm_first=True))

# -- losses --------------------------------------------------------------------------------
LOGITS, T3 = F(4, 3), I(3, 4)
for _name in ["mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"]:
    loss(_name, getattr(F_, _name), X, Y)
loss("soft_margin_loss", lambda x, t: F_.soft_margin_loss(x, t.float() * 2 - 1), X,
     I(2, 3, 4))
loss("cross_entropy", F_.cross_entropy, LOGITS, T3)
loss("cross_entropy.probs_smoothing", lambda x, t: F_.cross_entropy(
    x, t.softmax(1), label_smoothing=0.1), LOGITS, F(4, 3))
loss("cross_entropy.2d_weight_ignore", lambda x, t, w: F_.cross_entropy(
    x, t, w, ignore_index=1), F(2, 3, 2, 2), I(3, 2, 2, 2), C(3))
loss("nll_loss.sum", lambda x, t: F_.nll_loss(x.log_softmax(1), t, reduction="sum"),
     LOGITS, T3)
loss("nll_loss.none", lambda x, t: F_.nll_loss(x, t, reduction="none"), LOGITS, T3)
loss("binary_cross_entropy", lambda x, t: F_.binary_cross_entropy(x.sigmoid(), t),
     X, C(3, 4))
loss("binary_cross_entropy_with_logits", lambda x, t, w: F_.binary_cross_entropy_with_logits(
    x, t, pos_weight=w + 0.5), X, C(3, 4), C(4))
loss("kl_div", lambda x, t: F_.kl_div(x.log_softmax(1), t.softmax(1),
                                      reduction="batchmean"), X, Y)
loss("poisson_nll_loss", F_.poisson_nll_loss, X, P(3, 4))
loss("gaussian_nll_loss", F_.gaussian_nll_loss, X, Y, P(3, 4))
loss("hinge_embedding_loss", lambda x, t: F_.hinge_embedding_loss(x, t.float() * 2 - 1),
     X, I(2, 3, 4))
loss("cosine_embedding_loss", lambda a, b, t: F_.cosine_embedding_loss(
    a, b, t.float() * 2 - 1), X, Y, I(2, 3))
loss("margin_ranking_loss", lambda a, b, t: F_.margin_ranking_loss(
    a, b, t.float() * 2 - 1), F(5), F(5), I(2, 5))
loss("triplet_margin_loss", F_.triplet_margin_loss, X, Y, F(3, 4))
loss("triplet_margin_with_distance_loss", F_.triplet_margin_with_distance_loss, X, Y,
     F(3, 4))
loss("multilabel_soft_margin_loss", lambda x, t: F_.multilabel_soft_margin_loss(
    x, t.float()), X, I(2, 3, 4))
loss("multilabel_margin_loss", lambda x: F_.multilabel_margin_loss(
    x, torch.tensor([[3, 0, -1, 1], [1, 2, -1, 0], [0, -1, 2, 2]], device=x.device)), X)
loss("multi_margin_loss", F_.multi_margin_loss, LOGITS, T3)
loss("ctc_loss", lambda x, t: F_.ctc_loss(x.log_softmax(2), t, [6, 5], [3, 2]),
     F(6, 2, 4), I(3, 2, 3))
loss("ctc_loss.tensor_lengths_none", lambda x, t, n: F_.ctc_loss(
    x.log_softmax(2), t + 1, torch.full((2,), 6, device=x.device), n + 2, reduction="none"),
     F(6, 2, 4), I(3, 2, 3), I(2, 2))
loss("l1_loss.none", lambda a, b: F_.l1_loss(a, b, reduction="none"), X, Y)

# -- linear algebra ------------------------------------------------------------------------
SQ = F(3, 3)
la("mm", torch.mm, F(2, 3), F(3, 4))
la("bmm", torch.bmm, F(2, 2, 3), F(2, 3, 4))
la("matmul", torch.matmul, F(2, 2, 3), F(3, 4))
la("addmm", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2), F(4), F(2, 3),
   F(3, 4))
la("addbmm", torch.addbmm, F(2, 4), F(3, 2, 3), F(3, 3, 4))
la("baddbmm", torch.baddbmm, F(2, 2, 4), F(2, 2, 3), F(2, 3, 4))
la("addmv", torch.addmv, F(2), F(2, 3), F(3))
la("addr", torch.addr, F(2, 3), F(2), F(3))
la("mv", torch.mv, F(2, 3), F(3))
la("dot", torch.dot, F(4), F(4))
la("vdot", torch.vdot, F(4), F(4))
la("inner", torch.inner, X, Y)
la("outer", torch.outer, F(3), F(4))
la("einsum", lambda a, b: torch.einsum("bij,bjk->bik", a, b), F(2, 2, 3), F(2, 3, 4))
la("tensordot", lambda a, b: torch.tensordot(a, b, dims=([1], [0])), X, F(4, 2))
la("linear", lambda m, x: m(x), F(2, 3), module=lambda: nn.Linear(3, 4))
la("bilinear", lambda m, a, b: m(a, b), F(2, 3), F(2, 4), module=lambda: nn.Bilinear(3, 4, 2))
la("multi_dot", lambda a, b, c: torch.linalg.multi_dot([a, b, c]), F(2, 3), F(3, 4),
   F(4, 2))
la("vecdot", torch.linalg.vecdot, X, Y)
la("cross", lambda a, b: torch.linalg.cross(a, b), F(2, 3), F(2, 3))
la("det", lambda a: torch.linalg.det(_spd(a)), SQ)
la("slogdet", lambda a: torch.linalg.slogdet(_spd(a)), SQ)
la("logdet", lambda a: torch.logdet(_spd(a)), SQ)
la("inv", lambda a: torch.linalg.inv(_spd(a)), SQ)
la("inv_ex", lambda a: torch.linalg.inv_ex(_spd(a)).inverse, SQ)
la("solve", lambda a, b: torch.linalg.solve(_spd(a), b), SQ, F(3, 2))
la("cholesky", lambda a: torch.linalg.cholesky(_spd(a)), SQ)
la("cholesky_ex", lambda a: torch.linalg.cholesky_ex(_spd(a)).L, SQ)
la("cholesky_solve", lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(_spd(a))),
   SQ, F(3, 2))
la("cholesky_inverse", lambda a: torch.cholesky_inverse(torch.linalg.cholesky(_spd(a))), SQ)
la("qr", torch.linalg.qr, F(4, 3), tol=1e-4)
la("svdvals", torch.linalg.svdvals, F(4, 3), tol=1e-4)
la("svd.reconstruct", lambda a: (lambda u, s, v: u @ torch.diag_embed(s) @ v)(
    *torch.linalg.svd(a, full_matrices=False)), F(4, 3), tol=1e-4)
la("eigvalsh", lambda a: torch.linalg.eigvalsh(_spd(a)), SQ, tol=1e-4)
la("eigh.reconstruct", lambda a: (lambda w, v: v @ torch.diag_embed(w) @ v.mT)(
    *torch.linalg.eigh(_spd(a))), SQ, tol=1e-4)
la("pinv", torch.linalg.pinv, F(4, 3), tol=1e-4)
la("matrix_norm.fro", torch.linalg.matrix_norm, F(3, 4))
la("matrix_norm.nuc", lambda a: torch.linalg.matrix_norm(a, "nuc"), F(3, 4), tol=1e-4)
la("norm.2", lambda a: torch.linalg.norm(a, 2), F(3, 4), tol=1e-4)
la("cond", lambda a: torch.linalg.cond(_spd(a)), SQ, tol=1e-4)
la("matrix_rank", lambda a: torch.linalg.matrix_rank(a), F(4, 3), grad=False)
la("matrix_power", lambda a: torch.linalg.matrix_power(a, 3), SQ)
la("matrix_exp", torch.linalg.matrix_exp, SQ)
la("lu_factor", lambda a: torch.linalg.lu_factor(_spd(a)), SQ)
la("lu", lambda a: torch.linalg.lu(a), SQ)
la("lu_solve", lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(_spd(a)), b),
   SQ, F(3, 2))
la("solve_triangular", lambda a, b: torch.linalg.solve_triangular(
    torch.linalg.cholesky(_spd(a)), b, upper=False), SQ, F(3, 2))
la("triangular_solve", lambda a, b: torch.triangular_solve(
    b, torch.linalg.cholesky(_spd(a)), upper=False), SQ, F(3, 2))
la("householder_product", lambda a, t: torch.linalg.householder_product(a, t), F(4, 3),
   F(2))
la("vander", lambda x: torch.linalg.vander(x, N=3), F(4))
la("tensorinv", lambda a: torch.linalg.tensorinv(_spd(a).reshape(3, 3), ind=1), SQ)
la("ldl_factor", lambda a: torch.linalg.ldl_factor(_spd(a))[0], SQ, grad=False)

# -- FFT (real in, real out) ---------------------------------------------------------------
SIG = F(2, 8)
fft("fft.abs", lambda x: torch.fft.fft(x).abs(), SIG)
fft("ifft.real", lambda x: torch.fft.ifft(x).real, SIG)
fft("rfft.view_as_real", lambda x: torch.view_as_real(torch.fft.rfft(x)), SIG)
fft("irfft", lambda x: torch.fft.irfft(torch.fft.rfft(x) * 2, n=8), SIG)
fft("fft2.angle", lambda x: torch.fft.fft2(x).angle(), F(2, 4, 4), tol=1e-4)
fft("ifft2.imag", lambda x: torch.fft.ifft2(x).imag, F(2, 4, 4))
fft("rfft2.abs", lambda x: torch.fft.rfft2(x).abs(), F(2, 4, 4))
fft("irfft2", lambda x: torch.fft.irfft2(torch.fft.rfft2(x)), F(2, 4, 4))
fft("fftn.abs", lambda x: torch.fft.fftn(x, dim=(0, 1)).abs(), F(2, 4, 4))
fft("ifftn.real", lambda x: torch.fft.ifftn(x).real, F(2, 4, 4))
fft("rfftn.abs", lambda x: torch.fft.rfftn(x).abs(), F(2, 4, 4))
fft("irfftn", lambda x: torch.fft.irfftn(torch.fft.rfftn(x), s=(2, 4, 4)), F(2, 4, 4))
fft("hfft", lambda x: torch.fft.hfft(torch.fft.ifft(x)), SIG)
fft("ihfft.abs", lambda x: torch.fft.ihfft(x).abs(), SIG)
fft("fftshift", lambda x: torch.fft.fftshift(x) * 1, SIG)
fft("ifftshift", lambda x: torch.fft.ifftshift(x, dim=1) * 1, SIG)
fft("fftfreq", lambda x: x * torch.fft.fftfreq(8, device=x.device), SIG)
fft("rfftfreq", lambda x: x[:, :5] * torch.fft.rfftfreq(8, device=x.device), SIG)
fft("complex.polar_mul", lambda r, t: torch.view_as_real(
    torch.polar(r, t) * torch.complex(r, t)), P(2, 3), F(2, 3))
fft("stft.abs", lambda x: torch.stft(x, 4, hop_length=2, window=torch.hann_window(
    4, device=x.device), return_complex=True).abs(), F(2, 16), tol=1e-4)
fft("istft", lambda x: torch.istft(torch.stft(x, 4, hop_length=1, window=torch.ones(
    4, device=x.device), return_complex=True), 4, hop_length=1, window=torch.ones(
        4, device=x.device), length=16), F(2, 16), tol=1e-4)
