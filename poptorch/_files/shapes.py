"""The declared shapes of the JSON and tensor blobs of a ``.poptorch`` file (see
:mod:`poptorch._files.container` for the layout and :mod:`poptorch._files.schema` for
the combinators), and the checks of the values they decode to.

``structure.json`` (:data:`STRUCTURE`), ``metadata.json`` (:data:`METADATA`), the
optimizer record inside it (:data:`OPTIMIZER`) and the tagged JSON values (options,
constants, defaults) are all checked here before the loader uses any of them;
:func:`checked_tensors` reads a safetensors blob and checks names, dtypes and shapes.
Every failure is a :class:`~poptorch._files.schema.Invalid` that says where.
"""
from __future__ import annotations

import enum
import inspect
import keyword
from typing import Any, Dict, Iterable, Optional

import torch

from popart_compiler.errors import Error

from popart_compiler.session_options import SessionOptions
from poptorch._files import schema as fs
from poptorch._files.container import decode, tensors_from_bytes
from poptorch._files.structure import decode_signature
from poptorch._options.execution_strategy import STRATEGY_BASE
from poptorch.options import Options

__all__ = ["SPEC", "STRUCTURE", "METADATA", "OPTIMIZER", "tagged", "checked_options",
           "checked_tensors", "decoded"]

_DTYPE = fs.Str(choices=fs.DTYPES)
_SHAPE = fs.ListOf(fs.Int(0, 1 << 48), max_len=64)
_IDENT = fs.Str(pattern=fs.IDENTIFIER)
_FQN = fs.Str(pattern=fs.FQN)


def decoded(value: Any, where: str) -> Any:
    """:func:`poptorch._files.container.decode` of ``value``.

    Raises:
        Invalid: a malformed tagged value (what ``decode`` rejected, or a value of
            the wrong JSON type inside a tag).
    """
    try:
        return decode(value)
    except Error as exc:
        raise fs.Invalid(f"{where}: {exc.message}") from None
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
        raise fs.Invalid(f"{where}: malformed tagged value ({type(exc).__name__}: "
                         f"{exc})") from None


def tagged(value: Any, where: str) -> None:
    """Shape of a tagged JSON value (see :func:`poptorch._files.container.encode`)."""
    decoded(value, where)


# -- structure.json -------------------------------------------------------------------

def _names(value: Any, where: str) -> None:
    """Field names of a named tuple (what ``collections.namedtuple`` accepts)."""
    fs.ListOf(_IDENT, max_len=10_000)(value, where)
    if len(set(value)) != len(value) or any(
            keyword.iskeyword(n) or n.startswith("_") for n in value):
        raise fs.Invalid(f"{where}: invalid or repeated named-tuple field names")


def _spec(value: Any, where: str) -> None:
    fs.Obj({"kind": fs.Str(choices=("tensor", "const", "tuple", "list", "namedtuple",
                                     "dict"))}, extra=True)(value, where)
    kind = value["kind"]
    base = {"kind": fs.Any_}
    if kind == "tensor":
        fs.Obj({**base, "dtype": _DTYPE, "shape": _SHAPE})(value, where)
    elif kind == "const":
        fs.Obj({**base, "value": tagged})(value, where)
    else:
        extra = {"namedtuple": {"type": _IDENT, "fields": _names},
                 "dict": {"keys": tagged}}.get(kind, {})
        fs.Obj({**base, "children": fs.ListOf(SPEC, max_len=100_000), **extra})(
            value, where)
        if kind == "namedtuple":
            if keyword.iskeyword(value["type"]) or \
                    len(value["fields"]) != len(value["children"]):
                raise fs.Invalid(f"{where}: named tuple {value['type']!r} with "
                                 f"{len(value['fields'])} fields and "
                                 f"{len(value['children'])} values")
        if kind == "dict":
            keys = decoded(value["keys"], f"{where}.keys")
            if not isinstance(keys, list) or len(keys) != len(value["children"]):
                raise fs.Invalid(f"{where}.keys: expected a list of "
                                 f"{len(value['children'])} keys")
            try:
                hash(tuple(tuple(k) if isinstance(k, list) else k for k in keys))
            except TypeError:
                raise fs.Invalid(f"{where}.keys: keys must be hashable") from None


#: ``encode_spec`` output (argument / output structure), recursive.
SPEC = fs.Lazy(lambda: _spec)

STRUCTURE = fs.Obj({
    "inputs": fs.Optional_(SPEC),
    "input_names": fs.ListOf(fs.Str(max_len=1000), max_len=10_000),
    "num_positional": fs.Int(0, 10_000),
    "outputs": fs.Optional_(SPEC),
    "output_leaves": fs.ListOf(fs.Optional_(fs.Int(0, 1 << 30))),
    "state": fs.ListOf(fs.Obj({"name": _FQN, "kind": fs.Str(choices=("parameter",
                                                                       "buffer")),
                               "shape": _SHAPE, "dtype": _DTYPE,
                               "requires_grad": fs.Bool})),
    "blocks": fs.ListOf(fs.Pair(fs.Str(max_len=1000), fs.Obj(
        {"ipu": fs.Int(0, 1 << 20), "stage": fs.Int(0, 1 << 20),
         "phase": fs.Int(0, 1 << 20)}))),
})


def check_structure(structure: Dict[str, Any], where: str) -> None:
    """:data:`STRUCTURE` plus the consistency of its parts."""
    fs.check(structure, STRUCTURE, where)
    if structure["num_positional"] > len(structure["input_names"]):
        raise fs.Invalid(f"{where}: num_positional {structure['num_positional']} > "
                         f"{len(structure['input_names'])} inputs")
    names = [e["name"] for e in structure["state"]]
    if len(set(names)) != len(names):
        raise fs.Invalid(f"{where}.state: a weight is listed twice")


# -- metadata.json --------------------------------------------------------------------

_SIGNATURE = fs.Optional_(fs.ListOf(fs.Obj(
    {"name": _IDENT, "kind": fs.Int(0, 4)},
    {"default": tagged, "no_default": fs.Bool}), max_len=10_000))

_WEIGHT_KINDS = ("parameter", "parameter_frozen", "buffer", "buffer_non_persistent")

#: The optimizer record of :mod:`poptorch._files.optimizer_record`.
OPTIMIZER = fs.Obj({
    "class": fs.Str(max_len=200),
    "defaults": tagged,
    "groups": fs.ListOf(fs.Obj({"params": fs.ListOf(_FQN), "hyper": tagged}),
                        min_len=1, max_len=100_000),
    "attributes": tagged,
})

METADATA = fs.Obj({
    "kind": fs.Str(choices=("executable", "cache-entry")),
}, {
    "poptorch_version": fs.Str(max_len=200),
    "torch_version": fs.Str(max_len=200),
    "training": fs.Bool,
    "export_model": fs.Bool,
    "options": tagged,
    "replica_groupings": tagged,
    "signature": _SIGNATURE,
    "weights": fs.Obj({"kinds": fs.MapOf(_FQN, fs.Str(choices=_WEIGHT_KINDS)),
                       "aliases": fs.MapOf(_FQN, _FQN)}),
    "optimizer": OPTIMIZER,
    "rng_state": fs.Optional_(fs.ListOf(fs.Int(0, (1 << 64) - 1), max_len=1 << 16)),
})

#: Keys an exported file's metadata must have.
EXECUTABLE_KEYS = ("poptorch_version", "torch_version", "training", "export_model",
                   "options", "replica_groupings", "signature")


def check_signature(data: Optional[list], where: str) -> inspect.Signature:
    """The ``forward`` signature stored by ``encode_signature``, rebuilt."""
    try:
        return decode_signature(data)
    except (ValueError, TypeError) as exc:  # order of kinds, defaults, names
        raise fs.Invalid(f"{where}: {exc}") from None


# -- options --------------------------------------------------------------------------

def _same_layout(value: Any, default: Any, where: str, depth: int = 0,
                 complete: bool = False) -> None:
    """``value`` (decoded from a file) has the attributes and value types of
    ``default`` (a fresh object of the same kind); ``complete``: a dict that must have
    every key of ``default`` (the values of an options group)."""
    if depth > 32:
        raise fs.Invalid(f"{where}: nested too deeply")
    if isinstance(default, dict):
        if not isinstance(value, dict):
            fs._fail(where, "a dict", value)
        missing = sorted(set(default) - set(value), key=str) if complete else []
        if missing:
            raise fs.Invalid(f"{where}: the option {missing[0]!r} is missing")
        for key, item in value.items():
            if key in default:
                _same_layout(item, default[key], f"{where}[{key!r}]", depth + 1)
        return
    if hasattr(default, "__dict__") and not isinstance(default, (type, enum.Enum)):
        base = STRATEGY_BASE if isinstance(default, STRATEGY_BASE) else type(default)
        if not isinstance(value, base):
            fs._fail(where, f"a {base.__qualname__}", value)
        if type(value) is type(default):
            missing = sorted(set(vars(default)) - set(vars(value)))
            unknown = sorted(set(vars(value)) - set(vars(default)))
            if missing or unknown:
                raise fs.Invalid(f"{where}: {'missing' if missing else 'unknown'} "
                                 f"attribute {(missing or unknown)[0]!r}")
            for key, item in vars(value).items():
                _same_layout(item, vars(default)[key], f"{where}.{key}", depth + 1,
                             complete=key == "_values")
        return
    if default is None or value is None:
        return
    kinds = (bool, int, float, str, list, tuple, enum.Enum)
    for kind in kinds:
        if isinstance(default, kind):
            if kind in (int, float) and not isinstance(default, bool):
                ok = type(value) in (int, float) or isinstance(value, enum.IntEnum)
            else:
                ok = isinstance(value, kind) if kind is not enum.Enum else \
                    type(value) is type(default)
            if not ok:
                fs._fail(where, f"a {type(default).__name__}", value)
            return


def checked_options(value: Any, where: str):
    """The ``poptorch.Options`` a file stores, checked: the attributes of a fresh
    ``Options`` with values of the same types, accepted by the compiler
    (``SessionOptions.from_dict``).

    Raises:
        Invalid: anything else.
    """
    options = decoded(value, where)
    if type(options) is not Options:
        fs._fail(where, "poptorch.Options", options)
    # the built-in defaults: the environment (POPTORCH_DEFAULT_OPTIONS) may create
    # options that the saving process did not have
    _same_layout(options, Options(_environment=False), where)
    try:
        values = options.toDict()
        values.pop("compilation_progress_bar_fn", None)
        for _short, (_long, _inherit, mode, period) in options.anchored_tensors.items():
            int(mode), int(period)
        SessionOptions.from_dict(values)
    except Error as exc:
        raise fs.Invalid(f"{where}: {exc.message}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise fs.Invalid(f"{where}: {type(exc).__name__}: {exc}") from None
    return options


# -- tensors --------------------------------------------------------------------------

def checked_tensors(data: bytes, where: str,
                    expected: Optional[Dict[str, Any]] = None,
                    names: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
    """The tensors of a safetensors blob.

    Args:
        expected: name → ``(shape, dtype)`` every tensor must have (all of them
            present, no other).
        names: the exact set of names (when shapes are not known).

    Raises:
        Invalid: not a safetensors blob, or other names, shapes or dtypes.
    """
    try:
        tensors = tensors_from_bytes(data)
    except Exception as exc:  # noqa: BLE001 - SafetensorError is not exported
        raise fs.Invalid(f"{where}: not a safetensors blob ({type(exc).__name__}: "
                         f"{exc})") from None
    wanted = set(expected) if expected is not None else \
        (set(names) if names is not None else None)
    if wanted is not None and set(tensors) != wanted:
        missing, unknown = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted)
        raise fs.Invalid(f"{where}: {'missing' if missing else 'unexpected'} tensor "
                         f"{(missing or unknown)[0]!r}")
    for name, (shape, dtype) in (expected or {}).items():
        tensor = tensors[name]
        if list(tensor.shape) != list(shape) or tensor.dtype != dtype:
            raise fs.Invalid(f"{where}: tensor {name!r} is {list(tensor.shape)} "
                             f"{tensor.dtype} but the program expects {list(shape)} "
                             f"{dtype}")
    return tensors
