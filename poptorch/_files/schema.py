"""Shape checks of the JSON parts of a ``.poptorch`` file (issue 19, item 2).

A file whose checksums match can still hold anything: an attacker recomputes the
manifest. Every JSON blob is therefore checked against a declared shape before any of
its values is used, so that a list where an object belongs, a missing key, a string
where a number belongs or an unknown dtype gives ``poptorch.Error`` "Invalid file
<path>: <blob>: <where>: <what>" instead of an ``AttributeError`` / ``KeyError`` deep
inside the loader, and nothing is changed before the whole file was checked.

A shape is built from the small combinators below (``Obj``, ``ListOf``, ``MapOf``,
``Int``, ``Str``, ...); :func:`check` walks a value against it and raises
:class:`Invalid` naming the path of the first mismatch (``structure.json: state[2].
shape[0]: expected an integer >= 0, got "8"``).
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Dict, Iterable, Optional

from popart_compiler.errors import Error, backend_error

from poptorch._files.container import DTYPES

__all__ = ["Invalid", "invalid_file", "check", "Any_", "Bool", "Int", "Num", "Str",
           "OneOf", "Optional_", "ListOf", "MapOf", "Obj", "Pair", "Lazy", "IDENTIFIER",
           "FQN", "DTYPES"]

#: Longest list or string accepted anywhere in a JSON blob.
_MAX_ITEMS = 10_000_000


class Invalid(ValueError):
    """A part of a file is malformed; ``str(exc)`` says where and what."""


def invalid_file(path: str, exc: BaseException) -> Error:
    """``poptorch.Error`` "Invalid file <path>: <what exc says>"."""
    return backend_error(f"Invalid file {path}: {exc}")


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(where: str, expected: str, value: Any) -> None:
    raise Invalid(f"{where}: expected {expected}, got {type(value).__name__} "
                  f"{_describe(value)}")


# -- names and dtypes -----------------------------------------------------------------

#: A Python identifier (node, argument and field names).
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}\Z")
#: A dotted module path (``layers.0.weight``): identifiers and list indices.
FQN = re.compile(r"[A-Za-z0-9_]{1,200}(?:\.[A-Za-z0-9_]{1,200}){0,63}\Z")



# -- combinators ----------------------------------------------------------------------

Shape = Callable[[Any, str], None]


def check(value: Any, shape: Shape, where: str) -> Any:
    """Check ``value`` against ``shape``; returns ``value``.

    Raises:
        Invalid: the first mismatch, with its path.
    """
    shape(value, where)
    return value


def Any_(value: Any, where: str) -> None:  # noqa: N802 - a shape, like the others
    """Any JSON value."""


def Bool(value: Any, where: str) -> None:  # noqa: N802
    if not isinstance(value, bool):
        _fail(where, "true or false", value)


def Int(low: Optional[int] = None, high: Optional[int] = None) -> Shape:  # noqa: N802
    """An integer (not a boolean) in ``[low, high]``."""
    def shape(value: Any, where: str) -> None:
        if type(value) is not int or (low is not None and value < low) or \
                (high is not None and value > high):
            bounds = "" if low is None else f" >= {low}"
            bounds += "" if high is None else f" <= {high}"
            _fail(where, f"an integer{bounds}", value)
    return shape


def Num(value: Any, where: str) -> None:  # noqa: N802
    """A finite or infinite number (not a boolean)."""
    if type(value) not in (int, float) or (isinstance(value, float) and math.isnan(value)):
        _fail(where, "a number", value)


def Str(pattern: Optional[re.Pattern] = None, choices: Iterable[str] = (),  # noqa: N802
        max_len: int = 1 << 20) -> Shape:
    """A string: matching ``pattern`` / one of ``choices`` when given."""
    allowed = frozenset(choices)

    def shape(value: Any, where: str) -> None:
        if not isinstance(value, str) or len(value) > max_len:
            _fail(where, "a string", value)
        if allowed and value not in allowed:
            _fail(where, f"one of {sorted(allowed)}", value)
        if pattern is not None and not pattern.match(value):
            _fail(where, f"a name matching {pattern.pattern!r}", value)
    return shape


def OneOf(*shapes: Shape) -> Shape:  # noqa: N802
    """The first of ``shapes`` that fits (the error is that of the last one)."""
    def shape(value: Any, where: str) -> None:
        for candidate in shapes[:-1]:
            try:
                candidate(value, where)
                return
            except Invalid:
                continue
        shapes[-1](value, where)
    return shape


def Optional_(inner: Shape) -> Shape:  # noqa: N802
    """``null`` or ``inner``."""
    def shape(value: Any, where: str) -> None:
        if value is not None:
            inner(value, where)
    return shape


def ListOf(item: Shape, min_len: int = 0, max_len: int = _MAX_ITEMS) -> Shape:  # noqa: N802
    def shape(value: Any, where: str) -> None:
        if not isinstance(value, list) or not min_len <= len(value) <= max_len:
            _fail(where, f"a list of {min_len}..{max_len} items", value)
        for i, v in enumerate(value):
            item(v, f"{where}[{i}]")
    return shape


def Pair(first: Shape, second: Shape) -> Shape:  # noqa: N802
    """A list of exactly two items."""
    def shape(value: Any, where: str) -> None:
        if not isinstance(value, list) or len(value) != 2:
            _fail(where, "a list of 2 items", value)
        first(value[0], f"{where}[0]")
        second(value[1], f"{where}[1]")
    return shape


def MapOf(key: Shape, item: Shape) -> Shape:  # noqa: N802
    """An object whose keys fit ``key`` and values fit ``item``."""
    def shape(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            _fail(where, "an object", value)
        for k, v in value.items():
            key(k, f"{where} key")
            item(v, f"{where}[{k!r}]")
    return shape


def Obj(required: Dict[str, Shape], optional: Optional[Dict[str, Shape]] = None,
        extra: bool = False) -> Shape:  # noqa: N802
    """An object with the ``required`` keys and any of the ``optional`` ones (other
    keys only with ``extra``)."""
    optional = optional or {}

    def shape(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            _fail(where, "an object", value)
        for name, inner in required.items():
            if name not in value:
                raise Invalid(f"{where}: the key {name!r} is missing")
            inner(value[name], f"{where}.{name}")
        for name, inner in optional.items():
            if name in value:
                inner(value[name], f"{where}.{name}")
        if not extra:
            unknown = sorted(set(value) - set(required) - set(optional), key=str)
            if unknown:
                raise Invalid(f"{where}: unknown key {unknown[0]!r}")
    return shape


def Lazy(get: Callable[[], Shape]) -> Shape:  # noqa: N802
    """A shape defined later (recursive shapes), depth-limited."""
    depth = [0]

    def shape(value: Any, where: str) -> None:
        depth[0] += 1
        try:
            if depth[0] > 64:
                raise Invalid(f"{where}: nested more than 64 levels deep")
            get()(value, where)
        finally:
            depth[0] -= 1
    return shape
