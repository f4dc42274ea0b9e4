"""Text layout of ``poptorch.ipu_print_tensor`` (docs/api-sections.md api §8.2), as Poplar's
``PrintTensor`` formats tensors for PopTorch.

* Nested bracket groups per dimension with the given brackets; the elements of the
  innermost dimension are joined by ``separator`` exactly as given (``" "``, ``","`` or
  ``", "``); inner rows go on new lines indented by one space per level, with no
  separator between rows.
* Above ``summarise_threshold`` elements (0: never) ``edge_items`` are shown at each
  edge of every dimension, around an ellipsis (``edge_items=0``: the ellipsis alone,
  ``(...)``).
* A row longer than ``max_line_width`` (0: never wrap) is continued on new lines
  indented two characters past its opening bracket; the first element always stays
  on the bracket's line.
* ``digits`` counts the significant digits of a float, the exponent excluded:
  ``digits=8`` prints ``1.4962566`` (fixed) or ``1.4962566e+00`` (scientific). Fixed
  notation keeps the integer digits of the largest magnitude and gives the rest to
  decimals. ``"auto"`` picks fixed unless a magnitude needs more than ``digits``
  integer digits or is smaller than the last decimal fixed notation can show;
  ``"none"`` formats each element on its own (``%g`` with ``digits`` significant
  digits). Elements are right-aligned to a common width; ``digits=0`` switches all
  analysis off (each element in C++'s default ``%g`` format, unaligned).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, List

import torch

from popart_compiler.errors import Error

__all__ = ["PrintFormat", "format_tensor", "FLOAT_FORMATS", "make_format"]

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


class FloatFormatError(Error, KeyError):
    """Unknown ``float_format``: a ``poptorch.Error`` that is also the ``KeyError``
    PopTorch raises (docs/api-sections.md api §8.2), so ``except KeyError`` keeps working."""


_COUNTS = {"summarise_threshold": "0 disables summarising",
           "edge_items": "0 shows only the ellipsis",
           "max_line_width": "0 disables wrapping",
           "digits": "0 disables the analysis"}


def make_format(summarise_threshold, edge_items, max_line_width, digits, float_format,
                separator, open_bracket, close_bracket) -> PrintFormat:
    """Check the formatting arguments of ``ipu_print_tensor`` and bundle them.

    Counts must be ``int`` >= 0 (``bool`` refused); ``float_format`` one of
    :data:`FLOAT_FORMATS`, matched case-sensitively as PopTorch's dictionary lookup;
    ``separator`` and the brackets ``str``.

    Raises:
        poptorch.Error: a count that is not an int >= 0, or a layout string that is
            not a ``str``; the message names the argument and the allowed values.
        FloatFormatError: (a ``poptorch.Error`` and ``KeyError``) unknown
            ``float_format``.
    """
    counts = dict(summarise_threshold=summarise_threshold, edge_items=edge_items,
                  max_line_width=max_line_width, digits=digits)
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise Error(f"ipu_print_tensor: {name} must be an int >= 0 "
                        f"({_COUNTS[name]}), got {value!r}")
    if not isinstance(float_format, str) or float_format not in FLOAT_FORMATS:
        allowed = ", ".join(repr(k) for k in FLOAT_FORMATS)
        raise FloatFormatError(f"ipu_print_tensor: float_format must be one of "
                               f"{allowed} (lower case), got {float_format!r}")
    strings = dict(separator=separator, open_bracket=open_bracket,
                   close_bracket=close_bracket)
    for name, value in strings.items():
        if not isinstance(value, str):
            raise Error(f"ipu_print_tensor: {name} must be a str, got {value!r}")
    return PrintFormat(summarise_threshold, edge_items, max_line_width, digits,
                       FLOAT_FORMATS[float_format], separator, open_bracket, close_bracket)


def _integer_digits(magnitude: float) -> int:
    """Digits before the decimal point of ``magnitude`` (at least 1)."""
    return len(str(int(magnitude))) if magnitude >= 1 else 1


def _float_formatter(values: torch.Tensor, fmt: PrintFormat) -> Callable[[float], str]:
    digits = fmt.digits
    if digits <= 0:
        return lambda v: f"{v:g}"
    style = FLOAT_FORMATS[fmt.float_format]
    if style == "none":
        return lambda v: f"{v:.{digits}g}"
    finite = values[torch.isfinite(values)].abs().double()
    largest = float(finite.max()) if finite.numel() else 0.0
    decimals = max(digits - _integer_digits(largest), 0)
    if style == "auto":
        nonzero = finite[finite > 0]
        smallest = float(nonzero.min()) if nonzero.numel() else 1.0
        too_small = smallest < 10.0 ** -decimals
        style = "scientific" if _integer_digits(largest) > digits or too_small else "fixed"
    if style == "fixed":
        return lambda v: f"{v:.{decimals}f}" if math.isfinite(v) else str(v)
    return lambda v: f"{v:.{digits - 1}e}" if math.isfinite(v) else str(v)


def _number_formatter(values: torch.Tensor, fmt: PrintFormat) -> Callable[[float], str]:
    if values.dtype == torch.bool:
        return lambda v: str(bool(v))
    if not values.is_floating_point():
        return lambda v: str(int(v))
    return _float_formatter(values, fmt)


def _indices(size: int, fmt: PrintFormat, summarise: bool) -> List[int]:
    """Positions shown along a dimension; -1 stands for the ellipsis."""
    if summarise and size > 2 * fmt.edge_items:
        return list(range(fmt.edge_items)) + [-1] + \
            list(range(size - fmt.edge_items, size))
    return list(range(size))


def _row(items: List[str], fmt: PrintFormat, indent: int) -> str:
    """``open + items joined by separator + close``, wrapped at ``max_line_width``;
    ``indent`` is the number of spaces before the opening bracket."""
    if not items:
        return fmt.open_bracket + fmt.close_bracket
    pieces = [item + (fmt.separator if i < len(items) - 1 else fmt.close_bracket)
              for i, item in enumerate(items)]
    continuation = " " * (indent + len(fmt.open_bracket) + 1)
    lines, line = [], " " * indent + fmt.open_bracket
    for i, piece in enumerate(pieces):
        if i and fmt.max_line_width > 0 and \
                len(line) + len(piece.rstrip()) > fmt.max_line_width:
            lines.append(line.rstrip())
            line = continuation
        line += piece
    lines.append(line)
    return "\n".join(lines)[indent:]


def format_tensor(t: torch.Tensor, fmt: PrintFormat) -> str:
    """Format ``t`` (any shape, any dtype) as ``ipu_print_tensor`` prints it."""
    t = t.detach().cpu()
    if t.dtype in (torch.half, torch.bfloat16):
        t = t.float()
    summarise = fmt.summarise_threshold > 0 and t.numel() > fmt.summarise_threshold
    if t.dim() == 0:
        return _number_formatter(t, fmt)(t.item())
    shown = _shown(t, fmt) if summarise else t
    number = _number_formatter(shown, fmt)
    width = max((len(number(v)) for v in shown.reshape(-1).tolist()), default=0) \
        if fmt.digits > 0 else 0

    def render(sub: torch.Tensor, level: int) -> str:
        idx = _indices(sub.shape[0], fmt, summarise)
        if sub.dim() == 1:
            return _row(["..." if i < 0 else number(sub[i].item()).rjust(width)
                         for i in idx], fmt, level)
        if not idx:
            return fmt.open_bracket + fmt.close_bracket
        rows = ["..." if i < 0 else render(sub[i], level + 1) for i in idx]
        pad = " " * (level + 1)
        return fmt.open_bracket + "\n" + "\n".join(pad + r for r in rows) + "\n" + \
            " " * level + fmt.close_bracket

    return render(t, 0)


def _shown(t: torch.Tensor, fmt: PrintFormat) -> torch.Tensor:
    """The elements a summarised print shows (the edges of every dimension)."""
    for dim in range(t.dim()):
        if t.shape[dim] > 2 * fmt.edge_items:
            keep = [i for i in _indices(t.shape[dim], fmt, True) if i >= 0]
            t = t.index_select(dim, torch.tensor(keep, dtype=torch.long))
    return t
