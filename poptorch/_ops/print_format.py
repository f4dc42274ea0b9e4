"""Text layout of ``poptorch.ipu_print_tensor`` (api §8.2), as PopART prints tensors.

Nested bracket groups per dimension with the given brackets and separator; inner rows
on new lines indented by one space per level; summarised with ``edge_items`` per edge
and an ellipsis above ``summarise_threshold`` elements; lines wrapped at
``max_line_width`` characters; numbers with ``digits`` digits, aligned to a common
width unless ``digits`` is 0.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List

import torch

__all__ = ["PrintFormat", "format_tensor", "FLOAT_FORMATS"]

#: ``float_format`` values: the keys are what users pass.
FLOAT_FORMATS = {"auto": "auto", "fixed": "fixed", "scientific": "scientific",
                 "none": "none"}


@dataclasses.dataclass(frozen=True)
class PrintFormat:
    """The formatting arguments of ``ipu_print_tensor`` (defaults as in PopTorch)."""
    summarise_threshold: int = 1000
    edge_items: int = 3
    max_line_width: int = 80
    digits: int = 4
    float_format: str = "auto"
    separator: str = ", "
    open_bracket: str = "("
    close_bracket: str = ")"


def _number_formatter(values: torch.Tensor, fmt: PrintFormat):
    if not values.is_floating_point():
        return lambda v: str(int(v)) if values.dtype != torch.bool else str(bool(v))
    style = FLOAT_FORMATS[fmt.float_format]
    digits = max(fmt.digits, 1)
    if style == "auto":
        finite = values[torch.isfinite(values)].abs()
        large = finite.numel() and float(finite.max()) >= 1e8
        small = finite.numel() and float(finite[finite > 0].min() if bool((finite > 0).any())
                                          else 1.0) < 1e-4
        style = "scientific" if large or small else "fixed"
    if style == "fixed":
        return lambda v: f"{v:.{digits}f}" if math.isfinite(v) else str(v)
    if style == "scientific":
        return lambda v: f"{v:.{digits}e}" if math.isfinite(v) else str(v)
    return lambda v: repr(float(v))


def _indices(size: int, fmt: PrintFormat, summarise: bool) -> List[int]:
    """Positions shown along a dimension; -1 stands for the ellipsis."""
    if summarise and size > 2 * fmt.edge_items:
        return list(range(fmt.edge_items)) + [-1] + \
            list(range(size - fmt.edge_items, size))
    return list(range(size))


def _wrap(items: List[str], fmt: PrintFormat, indent: int) -> str:
    """``open + items joined by separator + close``, wrapped at ``max_line_width``."""
    text = fmt.open_bracket + fmt.separator.join(items) + fmt.close_bracket
    if fmt.max_line_width <= 0 or indent + len(text) <= fmt.max_line_width:
        return text
    lines, line = [], fmt.open_bracket
    for i, item in enumerate(items):
        piece = item + (fmt.separator if i < len(items) - 1 else fmt.close_bracket)
        if len(line) > len(fmt.open_bracket) and \
                indent + len(line) + len(piece.rstrip()) > fmt.max_line_width:
            lines.append(line.rstrip())
            line = " " * (len(fmt.open_bracket))
        line += piece
    lines.append(line)
    return ("\n" + " " * indent).join(lines)


def format_tensor(t: torch.Tensor, fmt: PrintFormat) -> str:
    """Format ``t`` (any shape, any dtype) as ``ipu_print_tensor`` prints it."""
    t = t.detach().cpu()
    summarise = fmt.summarise_threshold > 0 and t.numel() > fmt.summarise_threshold
    number = _number_formatter(t.float() if t.dtype == torch.half else t, fmt)
    if t.dim() == 0:
        return number(t.item())
    shown = [number(v) for v in t.reshape(-1).tolist()] if not summarise else None
    width = max((len(s) for s in shown), default=0) if shown is not None else 0
    if summarise:
        width = 0
    align = fmt.digits > 0

    def cell(v) -> str:
        s = number(v)
        return s.rjust(width) if align else s

    def render(sub: torch.Tensor, level: int) -> str:
        idx = _indices(sub.shape[0], fmt, summarise)
        if sub.dim() == 1:
            return _wrap(["..." if i < 0 else cell(sub[i].item()) for i in idx], fmt, level)
        rows = ["..." if i < 0 else render(sub[i], level + 1) for i in idx]
        pad = " " * (level + 1)
        inner = (fmt.separator.rstrip() + "\n").join(pad + r for r in rows)
        return fmt.open_bracket + "\n" + inner + "\n" + " " * level + fmt.close_bracket

    return render(t, 0)
