"""Search ops of docs/api-sections.md api §8: CTC beam-search decoding (§8.14), farthest-point
sampling (§8.15) and nearest neighbours (§8.16).

``ctc_beam_search_decoder`` and ``fps`` are ``torch.library`` ops (one node each, run
with the actual values); ``nearest`` is written with ATen ops (a masked distance
``argmin``), so it is vectorised and differentiable like any other captured code.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from popart_compiler.errors import py_error
from poptorch._impl import isRunningOnIpu
from poptorch._ops import library

__all__ = ["ctc_beam_search_decoder", "fps", "nearest"]

_NEG_INF = -math.inf


def _logaddexp(a: float, b: float) -> float:
    if a == _NEG_INF:
        return b
    if b == _NEG_INF:
        return a
    top = max(a, b)
    return top + math.log1p(math.exp(-abs(a - b)))


def _beam_search(log_probs: List[List[float]], blank: int, beam_width: int
                 ) -> List[Tuple[Tuple[int, ...], float]]:
    """CTC prefix beam search over ``log_probs`` ``[T][C]``: the beams, best first, as
    ``(labels, log-probability)`` (blank and non-blank endings summed)."""
    beams: Dict[Tuple[int, ...], Tuple[float, float]] = {(): (0.0, _NEG_INF)}
    for frame in log_probs:
        grown: Dict[Tuple[int, ...], List[float]] = {}

        def add(prefix, which, value):
            entry = grown.setdefault(prefix, [_NEG_INF, _NEG_INF])
            entry[which] = _logaddexp(entry[which], value)

        for prefix, (p_blank, p_label) in beams.items():
            total = _logaddexp(p_blank, p_label)
            for label, p in enumerate(frame):
                if label == blank:
                    add(prefix, 0, total + p)
                elif prefix and prefix[-1] == label:
                    add(prefix + (label,), 1, p_blank + p)  # a repeat needs a blank
                    add(prefix, 1, p_label + p)  # the repeat collapses
                else:
                    add(prefix + (label,), 1, total + p)
        ranked = sorted(grown.items(), key=lambda kv: (-_logaddexp(*kv[1]), kv[0]))
        beams = {k: (v[0], v[1]) for k, v in ranked[:beam_width]}
    return [(k, _logaddexp(*v)) for k, v in beams.items()]


def _ctc_decode(probs: torch.Tensor, lengths: torch.Tensor, blank: int, beam_width: int,
                top_paths: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t_max, batch, _ = probs.shape
    scores = torch.full((batch, top_paths), _NEG_INF, dtype=probs.dtype)
    sizes = torch.zeros((batch, top_paths), dtype=torch.int32)
    paths = torch.zeros((batch, top_paths, t_max), dtype=torch.int32)
    values = probs.detach().float().cpu()
    for b in range(batch):
        steps = max(0, min(int(lengths[b]), t_max))
        beams = _beam_search(values[:steps, b].tolist(), blank, beam_width)
        for k, (labels, score) in enumerate(beams[:top_paths]):
            scores[b, k] = score
            sizes[b, k] = len(labels)
            paths[b, k, :len(labels)] = torch.tensor(labels, dtype=torch.int32)
    device = probs.device
    return scores.to(device), sizes.to(device), paths.to(device)


def _ctc_fake(probs, lengths, blank, beam_width, top_paths):
    t_max, batch, _ = probs.shape
    return (probs.new_empty((batch, top_paths)),
            probs.new_empty((batch, top_paths), dtype=torch.int32),
            probs.new_empty((batch, top_paths, t_max), dtype=torch.int32))


_CTC = library.define(
    "ctc_beam_search_decoder(Tensor probs, Tensor lengths, int blank, int beam_width, "
    "int top_paths) -> (Tensor, Tensor, Tensor)", _ctc_decode, _ctc_fake)


def ctc_beam_search_decoder(probs: torch.Tensor, lengths: torch.Tensor, blank: int = 0,
                            beam_width: int = 100, top_paths: int = 1
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CTC beam-search decoding (docs/api-sections.md api §8.14).

    Args:
        probs: log-probabilities ``[T, B, C]`` (float).
        lengths: valid time steps of each batch element ``[B]`` (integer).
        blank: the blank label.
        beam_width: beams kept after each time step.
        top_paths: best paths returned per batch element (<= ``beam_width``).

    Returns:
        ``(log_probs [B, top_paths], lengths [B, top_paths] int32,
        paths [B, top_paths, T] int32)``: the best label sequences (collapsed, blanks
        removed) with their total log-probability (sum over their alignments), zero
        padded. Missing paths have log-probability ``-inf`` and length 0. Outside a
        wrapped model: zero tensors of those shapes (PopTorch's CPU placeholder,
            docs/semantics.md S-4).

    Raises:
        poptorch.Error: ``probs`` or ``lengths`` not tensors, ``probs`` not 3-D,
            ``top_paths`` larger than ``beam_width`` or not positive.
    """
    if not isinstance(probs, torch.Tensor) or not isinstance(lengths, torch.Tensor):
        raise py_error("ctc_beam_search_decoder: probs and lengths must be tensors")
    if probs.dim() != 3:
        raise py_error(f"ctc_beam_search_decoder: probs must be [T, B, C], got shape "
                       f"{list(probs.shape)}")
    if not 0 < int(top_paths) <= int(beam_width):
        raise py_error(f"ctc_beam_search_decoder: need 0 < top_paths <= beam_width, got "
                       f"top_paths={top_paths}, beam_width={beam_width}")
    if not isRunningOnIpu():
        t_max, batch, _ = probs.shape
        return (torch.zeros((batch, top_paths), dtype=probs.dtype),
                torch.zeros((batch, top_paths), dtype=torch.int32),
                torch.zeros((batch, top_paths, t_max), dtype=torch.int32))
    return _CTC(probs, lengths, int(blank), int(beam_width), int(top_paths))


def _fps(src: torch.Tensor, ptr: List[int], ratio: float, random_start: bool
         ) -> torch.Tensor:
    chosen = []
    for lo, hi in zip(ptr[:-1], ptr[1:]):
        points = src[lo:hi].reshape(hi - lo, -1)
        count = math.ceil(ratio * (hi - lo))
        first = int(torch.randint(hi - lo, (), device=src.device)) if random_start else 0
        picked = [first]
        distance = torch.full((hi - lo,), math.inf, dtype=points.dtype, device=src.device)
        for _ in range(count - 1):
            distance = torch.minimum(distance,
                                     (points - points[picked[-1]]).pow(2).sum(-1))
            picked.append(int(distance.argmax()))
        chosen.extend(lo + i for i in picked)
    return torch.tensor(chosen, dtype=torch.int64, device=src.device)


def _fps_count(ptr: Sequence[int], ratio: float) -> int:
    return sum(math.ceil(ratio * (hi - lo)) for lo, hi in zip(ptr[:-1], ptr[1:]))


_FPS = library.define(
    "fps(Tensor src, int[] ptr, float ratio, bool random_start) -> Tensor", _fps,
    lambda src, ptr, ratio, random_start: src.new_empty((_fps_count(ptr, ratio),),
                                                        dtype=torch.int64),
    tags=(torch.Tag.nondeterministic_seeded,))


def fps(src: torch.Tensor, ptr: List[int], ratio: float = 0.5,
        random_start: bool = False) -> torch.Tensor:
    """Farthest-point sampling, torch_cluster semantics (docs/api-sections.md api §8.15).

    For each segment ``src[ptr[i]:ptr[i+1]]`` pick ``ceil(ratio × size)`` points: the
    first (or a random one with ``random_start``), then repeatedly the point farthest
    (Euclidean) from those already chosen.

    Args:
        src: points ``[N, D]``.
        ptr: segment boundaries, ``ptr[0] = 0`` … ``ptr[-1] = N``.
        ratio: fraction of each segment to sample, in (0, 1].
        random_start: start from a random point of each segment (device RNG).

    Returns:
        int64 indices into ``src`` (int32 when returned from the device, docs/semantics.md S-44).

    Raises:
        poptorch.Error: ``src`` not a tensor, ``ptr`` not a list or with fewer than 2
            elements, ``ratio`` not a float, ``random_start`` not a bool.
    """
    if not isinstance(src, torch.Tensor):
        raise py_error("fps: src must be a tensor")
    if not isinstance(ptr, list):
        raise py_error("fps: ptr must be a list of ints")
    if len(ptr) < 2:
        raise py_error("fps: ptr must hold at least 2 elements")
    if not isinstance(ratio, float):
        raise py_error("fps: ratio must be a float")
    if not isinstance(random_start, bool):
        raise py_error("fps: random_start must be a bool")
    return _FPS(src, [int(p) for p in ptr], ratio, random_start)


BatchArg = Union[None, torch.Tensor, List[int]]


def _batch_vector(batch: BatchArg, n: int, like: Optional[torch.Tensor],
                  device) -> torch.Tensor:
    if batch is None:
        return torch.zeros(n, dtype=torch.int64, device=device)
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, list) and all(isinstance(b, int) for b in batch):
        dtype = like.dtype if isinstance(like, torch.Tensor) else torch.int64
        return torch.tensor(batch, dtype=dtype, device=device)
    raise py_error(f"nearest: batch ids must be a tensor or a list of ints, got "
                   f"{type(batch).__name__}")


def nearest(x: torch.Tensor, y: torch.Tensor, batch_x: BatchArg = None,
            batch_y: BatchArg = None) -> torch.Tensor:
    """For each point of ``x``, the index of the nearest point of ``y`` with the same
    batch id (torch_cluster semantics, docs/api-sections.md api §8.16).

    Args:
        x: ``[N, D]`` (or ``[N]``); y: ``[M, D]`` (or ``[M]``).
        batch_x / batch_y: sorted batch ids (tensors or lists of ints), default all 0.
            A list takes the dtype of the other argument when that one is a tensor.

    Returns:
        int64 ``[N]`` indices into ``y`` (Euclidean distance; ties take the lowest
        index).

    Raises:
        poptorch.Error: ``x`` or ``y`` not tensors; batch ids of another type.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise py_error("nearest: x and y must be tensors")
    xs = x.reshape(x.shape[0], -1)
    ys = y.reshape(y.shape[0], -1)
    bx = _batch_vector(batch_x, xs.shape[0], batch_y, x.device)
    by = _batch_vector(batch_y, ys.shape[0], batch_x, x.device)
    distance = (xs[:, None, :] - ys[None, :, :]).pow(2).sum(-1)
    distance = torch.where(bx[:, None] == by[None, :], distance,
                           torch.full_like(distance, math.inf))
    return distance.argmin(dim=1)
