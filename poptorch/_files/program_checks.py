"""Checks of a stored program (``program.json``) before ``torch.export``'s deserializer
reads it (issue 19, items 1 and 2).

``torch._export.serde.serialize.deserialize`` trusts its input. Parts of a program that
it turns into code or imports, and that a crafted file could use to run code or touch
files when it is loaded or run:

* symbolic sizes, strides, offsets and conditions (``SymExpr.expr_str``): parsed with
  ``sympy.sympify``, which evaluates Python → must follow the integer grammar of
  :mod:`poptorch._files.sym_expr`;
* op targets (``Node.target``, ``Argument.as_operator``): resolved by name from
  ``torch``, ``operator`` and ``math`` (``torch.os.system`` resolves) and called when
  the graph runs → must name an ``aten`` / ``prims`` / ``poptorch`` op overload
  (except those that read or write files or print: ``aten::save``, ``from_file``,
  ``_print``, ``warn``), one of the control-flow higher-order ops, or one of the
  ``operator`` / ``math`` / ``torch.sym_*`` functions ``torch.export`` uses for
  symbolic arithmetic;
* pytree specs (``in_spec`` / ``out_spec``): their JSON may name an enum class by
  module, which is *imported* → only the plain containers (tuple, list, dict,
  OrderedDict) and contexts without ``__enum__`` objects;
* names that ``torch.fx`` writes into the Python source it generates and ``exec``-s
  (placeholder, node, argument and sub-graph names) → identifiers; parameter, buffer
  and constant names → dotted names;
* node metadata (stack traces, source functions, ``from_node``, ...): only the two
  entries PopTorch's compiler reads are kept (``nn_module_stack``, checked to be
  printable text; ``custom``, checked JSON); the rest is dropped;
* ``guards_code`` (Python source of input guards) must be empty, custom (TorchScript)
  objects are refused and verifiers must be the ATen / training ones.

Everything else is checked against the types of torch's schema dataclasses
(``torch._export.serde.schema``): a string where a number belongs, a missing field or a
union with two members is refused. :func:`checked_program_json` returns the program as
the deserializer may read it, or raises :class:`~poptorch._files.schema.Invalid`.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import json
import keyword
import re
import types
import typing
from typing import Any, Callable, Dict, FrozenSet

import torch
from torch._export.serde import schema
from torch._export.serde import serialize as serde
from torch._export.verifier import Verifier
from torch._ops import _higher_order_ops

from poptorch._files import schema as fs
from poptorch._files.sym_expr import SYMBOL_RE, check_expression

__all__ = ["checked_program_json", "check_op_target", "check_treespec"]

_MAX_DEPTH = 48
#: Higher-order ops a program may call: control flow and functionalization wrappers.
_HIGHER_ORDER_OPS = frozenset({
    "cond", "while_loop", "map_impl", "scan", "associative_scan",
    "wrap_with_set_grad_enabled", "wrap_with_autocast", "auto_functionalized",
    "auto_functionalized_v2", "with_effects", "invoke_subgraph", "run_with_rng_state",
    "run_and_save_rng_state"})
#: Namespaces of ``torch.ops`` a program may call.
_NAMESPACES = ("aten", "prims", "poptorch")
#: ATen ops with effects outside the tensors (files, printing).
_DENIED_OPS = frozenset({"save", "from_file", "_print", "warn"})
_OP_RE = re.compile(r"torch\.ops\.([A-Za-z_]\w{0,99})\.([A-Za-z_]\w{0,199})"
                    r"\.([A-Za-z_]\w{0,99})\Z")
_HOP_RE = re.compile(r"torch\.ops\.higher_order\.([A-Za-z_]\w{0,99})\Z")
_TREESPEC_TYPES = frozenset({"builtins.tuple", "builtins.list", "builtins.dict",
                             "collections.OrderedDict"})
_DEVICE_TYPES = frozenset({"cpu", "cuda", "meta"})
_VERIFIERS = frozenset({"", "ATEN", "TRAINING"})
_FLOAT_WORDS = frozenset({"Infinity", "-Infinity", "NaN"})

#: ``node.meta["custom"]``: the annotations PopTorch records (other keys are torch's).
_CUSTOM = fs.Obj({}, {
    "ipu_block": fs.Optional_(fs.Str(max_len=200)),
    "ipu_no_active_block": fs.Bool,
    "no_module_scope": fs.Bool,
    "name_scopes": fs.ListOf(fs.Pair(fs.Str(max_len=1000), fs.Int(0, 10_000))),
    "attributes": fs.MapOf(fs.Str(max_len=1000), fs.MapOf(fs.Str(max_len=1000),
                                                          fs.Any_)),
    "multi_conv": fs.MapOf(fs.Str(max_len=1000), fs.Any_),
    "available_memory_proportion": fs.Num,
}, extra=True)


# -- names ----------------------------------------------------------------------------

def _identifier(value: Any, where: str) -> None:
    if not isinstance(value, str) or not fs.IDENTIFIER.match(value) or \
            keyword.iskeyword(value):
        raise fs.Invalid(f"{where}: {fs._describe(value)} is not a valid name (a "
                         "Python identifier)")


def _argument_name(value: Any, where: str) -> None:
    """Keyword name of an op argument ('' for positional arguments of higher-order
    ops)."""
    if value != "":
        _identifier(value, where)


def _fqn(value: Any, where: str) -> None:
    if not isinstance(value, str) or not fs.FQN.match(value):
        raise fs.Invalid(f"{where}: {fs._describe(value)} is not a valid dotted name")


def _fqn_or_empty(value: Any, where: str) -> None:
    if value != "":
        _fqn(value, where)


def _text(value: Any, where: str) -> None:
    fs.Str(max_len=1 << 20)(value, where)


def _symbol(value: Any, where: str) -> None:
    if not isinstance(value, str) or not SYMBOL_RE.match(value):
        raise fs.Invalid(f"{where}: {fs._describe(value)} is not a torch.export symbol")


# -- op targets -----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _builtin_targets() -> FrozenSet[str]:
    """``"_operator.add"``, ``"math.ceil"``, ``"torch.sym_max"``, ...: the functions
    ``torch.export`` serializes by name, as the deserializer resolves them."""
    names = set()
    for fn in list(Verifier().allowed_builtin_ops()) + list(serde._SYM_OPS):
        name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', '')}"
        if serde.GraphModuleDeserializer().deserialize_operator(name) is fn:
            names.add(name)
    return frozenset(names)


@functools.lru_cache(maxsize=4096)
def _resolves_to_op(namespace: str, name: str, overload: str) -> bool:
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return isinstance(getattr(packet, overload), torch._ops.OpOverload)
    except (AttributeError, RuntimeError):
        return False


def check_op_target(value: Any, where: str = "target") -> None:
    """Check that ``value`` names an op a stored program may call (see the module
    docstring).

    Raises:
        Invalid: another name (a Python function, a file or print op, an op of another
            library, an unknown op).
    """
    if not isinstance(value, str) or len(value) > 400:
        raise fs.Invalid(f"{where}: expected an op name, got {fs._describe(value)}")
    if value in _builtin_targets():
        return
    hop = _HOP_RE.match(value)
    if hop:
        if hop.group(1) in _HIGHER_ORDER_OPS and hop.group(1) in _higher_order_ops:
            return
        raise fs.Invalid(f"{where}: {value} is not a control-flow operator a stored "
                         "program may call")
    match = _OP_RE.match(value)
    if match is None or match.group(1) not in _NAMESPACES:
        raise fs.Invalid(f"{where}: {fs._describe(value)} is not a PyTorch (aten, prims) "
                         "or PopTorch op: a stored program can only call those")
    if match.group(1) == "aten" and match.group(2) in _DENIED_OPS:
        raise fs.Invalid(f"{where}: {value} reads or writes files or prints: a stored "
                         "program may not call it")
    if not _resolves_to_op(*match.groups()):
        raise fs.Invalid(f"{where}: {value} is not an op of this PyTorch")


# -- pytree specs ---------------------------------------------------------------------

def _no_enum(value: Any, where: str, depth: int = 0) -> None:
    if depth > _MAX_DEPTH:
        raise fs.Invalid(f"{where}: nested too deeply")
    if isinstance(value, dict):
        if "__enum__" in value:
            raise fs.Invalid(f"{where}: a pytree context may not name a class")
        for v in value.values():
            _no_enum(v, where, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _no_enum(v, where, depth + 1)


def _treespec_node(node: Any, where: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise fs.Invalid(f"{where}: nested too deeply")
    fs.Obj({"type": fs.Optional_(fs.Str(choices=_TREESPEC_TYPES)),
            "context": fs.Optional_(fs.Str(max_len=1 << 20)),
            "children_spec": fs.ListOf(fs.Any_)})(node, where)
    if node["type"] is None:
        if node["context"] is not None or node["children_spec"]:
            raise fs.Invalid(f"{where}: a leaf with a context or children")
        return
    try:
        context = json.loads(node["context"]) if node["context"] is not None else None
    except (ValueError, RecursionError) as exc:
        raise fs.Invalid(f"{where}.context: not JSON ({exc})") from None
    _no_enum(context, f"{where}.context")
    for i, child in enumerate(node["children_spec"]):
        _treespec_node(child, f"{where}.children_spec[{i}]", depth + 1)


def check_treespec(value: Any, where: str = "spec") -> None:
    """Check a serialized pytree spec (``torch.utils._pytree.treespec_dumps``).

    Raises:
        Invalid: not protocol 1 of plain containers, or a context naming a class.
    """
    fs.Str(max_len=1 << 22)(value, where)
    try:
        data = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise fs.Invalid(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, list) or len(data) != 2 or data[0] != 1:
        raise fs.Invalid(f"{where}: expected [1, <spec>] (pytree protocol 1)")
    _treespec_node(data[1], where, 0)


# -- node metadata --------------------------------------------------------------------

def _checked_metadata(value: Any, where: str) -> Dict[str, str]:
    """The metadata entries PopTorch reads, checked; the others dropped."""
    fs.MapOf(fs.Str(max_len=200), fs.Str(max_len=1 << 22))(value, where)
    kept = {}
    stack = value.get("nn_module_stack")
    if stack is not None:
        if not stack.isprintable():
            raise fs.Invalid(f"{where}.nn_module_stack: contains control characters")
        kept["nn_module_stack"] = stack
    custom = value.get("custom")
    if custom is not None:
        try:
            decoded = json.loads(custom)
        except (ValueError, RecursionError) as exc:
            raise fs.Invalid(f"{where}.custom: not JSON ({exc})") from None
        _CUSTOM(decoded, f"{where}.custom")
        kept["custom"] = custom
    return kept


# -- the schema walk ------------------------------------------------------------------

#: String fields by (schema class, field): how their text is checked.
_STRINGS: Dict[tuple, Callable[[Any, str], None]] = {
    **{(c, f): _identifier for c, f in (
        ("TensorArgument", "name"), ("TokenArgument", "name"),
        ("SymIntArgument", "as_name"), ("SymFloatArgument", "as_name"),
        ("SymBoolArgument", "as_name"),
        ("GraphArgument", "name"), ("Node", "name"), ("InputToConstantInputSpec", "name"),
        ("GradientToUserInputSpec", "user_input_name"),
        ("UserInputMutationSpec", "user_input_name"),
        ("ModuleCallSignature", "forward_arg_names"), ("NamedTupleDef", "field_names"))},
    **{(c, f): _fqn for c, f in (
        ("InputToParameterSpec", "parameter_name"), ("InputToBufferSpec", "buffer_name"),
        ("InputToTensorConstantSpec", "tensor_constant_name"),
        ("BufferMutationSpec", "buffer_name"), ("GradientToParameterSpec", "parameter_name"),
        ("ParameterMutationSpec", "parameter_name"))},
    ("ModuleCallEntry", "fqn"): _fqn_or_empty,
    ("NamedArgument", "name"): _argument_name,
    ("Node", "target"): check_op_target,
    ("Argument", "as_operator"): check_op_target,
    ("ModuleCallSignature", "in_spec"): check_treespec,
    ("ModuleCallSignature", "out_spec"): check_treespec,
    ("Device", "type"): fs.Str(choices=_DEVICE_TYPES),
    ("ExportedProgram", "verifiers"): fs.Str(choices=_VERIFIERS),
}
#: Keys of dict fields by (schema class, field).
_KEYS: Dict[tuple, Callable[[Any, str], None]] = {
    ("Graph", "tensor_values"): _identifier, ("Graph", "sym_int_values"): _identifier,
    ("Graph", "sym_bool_values"): _identifier, ("Graph", "sym_float_values"): _identifier,
    ("ExportedProgram", "opset_version"): _identifier,
    ("ExportedProgram", "range_constraints"): _symbol,
}


@functools.lru_cache(maxsize=None)
def _plan(tp: Any) -> tuple:
    """How to check a value of schema type ``tp``: ``(kind, detail)``."""
    if isinstance(tp, str):
        tp = getattr(schema, tp)
    if isinstance(tp, typing.ForwardRef):
        tp = getattr(schema, tp.__forward_arg__)
    if typing.get_origin(tp) is typing.Annotated:
        tp = tp.__origin__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return ("optional", next(a for a in args if a is not type(None)))
    if isinstance(tp, type) and issubclass(tp, schema._Union):
        return ("union", tp)
    if dataclasses.is_dataclass(tp):
        return ("dataclass", tp)
    if origin is list:
        return ("list", args[0])
    if origin is dict:
        return ("dict", args[1])
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return ("enum", (tp.__name__, frozenset(m.value for m in tp)))
    if tp in (bool, int, float, str):
        return (tp.__name__, None)
    raise TypeError(f"unexpected schema type {tp!r}")


_INT_RANGE = fs.Int(-(1 << 63), (1 << 63) - 1)


class _Walker:
    """Checks a JSON value against a schema type of ``torch._export.serde.schema``."""

    def __init__(self):
        self.depth = 0
        self.expr_kind = "int"

    def visit(self, tp: Any, value: Any, where: str, owner: str = "", field: str = ""):
        kind, detail = _plan(tp)
        if kind == "optional":
            if value is not None:
                self.visit(detail, value, where, owner, field)
        elif kind == "union":
            self.union(detail, value, where)
        elif kind == "dataclass":
            self.dataclass(detail, value, where)
        elif kind == "list":
            if not isinstance(value, list) or len(value) > 10_000_000:
                fs._fail(where, "a list", value)
            for i, item in enumerate(value):
                self.visit(detail, item, f"{where}[{i}]", owner, field)
        elif kind == "dict":
            if not isinstance(value, dict):
                fs._fail(where, "an object", value)
            key_check = _KEYS.get((owner, field), _text)
            for key, item in value.items():
                key_check(key, f"{where} key")
                self.visit(detail, item, f"{where}[{key!r}]", owner, field)
        elif kind == "enum":
            if type(value) is not int or value not in detail[1]:
                fs._fail(where, f"a {detail[0]} code", value)
        elif kind == "bool":
            fs.Bool(value, where)
        elif kind == "int":
            _INT_RANGE(value, where)
        elif kind == "float":  # torch writes infinities and NaN as strings
            if type(value) not in (int, float) and value not in _FLOAT_WORDS:
                fs._fail(where, "a number", value)
        else:
            _STRINGS.get((owner, field), _text)(value, where)

    def union(self, cls: type, value: Any, where: str) -> None:
        if not isinstance(value, dict) or len(value) != 1:
            fs._fail(where, f"an object with one {cls.__name__} member", value)
        (key, item), = value.items()
        hints = _hints(cls)
        if key not in hints:
            raise fs.Invalid(f"{where}: {key!r} is not a {cls.__name__} member")
        name = cls.__name__
        if key == "as_custom_obj" or name == "InputSpec" and key == "custom_obj":
            raise fs.Invalid(f"{where}: custom (TorchScript) objects are not supported "
                             "in files")
        previous = self.expr_kind
        self.expr_kind = {"SymBool": "bool", "SymFloat": "float"}.get(name, "int")
        try:
            self.visit(hints[key], item, f"{where}.{key}", name, key)
        finally:
            self.expr_kind = previous

    def dataclass(self, cls: type, value: Any, where: str) -> None:
        self.depth += 1
        try:
            if self.depth > _MAX_DEPTH:
                raise fs.Invalid(f"{where}: nested more than {_MAX_DEPTH} levels deep")
            if not isinstance(value, dict):
                fs._fail(where, f"a {cls.__name__} object", value)
            name = cls.__name__
            if name == "CustomObjArgument":
                raise fs.Invalid(f"{where}: custom (TorchScript) objects are not "
                                 "supported in files")
            hints = _hints(cls)
            for f in dataclasses.fields(cls):
                if f.name not in value:
                    if f.default is dataclasses.MISSING and \
                            f.default_factory is dataclasses.MISSING:
                        raise fs.Invalid(f"{where}: the field {f.name!r} is missing")
                    continue
                item, at = value[f.name], f"{where}.{f.name}"
                if (name, f.name) in (("Node", "metadata"),):
                    value[f.name] = _checked_metadata(item, at)
                elif (name, f.name) == ("GraphModule", "metadata"):
                    fs.MapOf(fs.Str(max_len=200), fs.Str())(item, at)
                    value[f.name] = {}
                elif (name, f.name) == ("ExportedProgram", "guards_code"):
                    fs.ListOf(fs.Any_, max_len=0)(item, at)
                elif (name, f.name) == ("Graph", "custom_obj_values"):
                    if item:
                        raise fs.Invalid(f"{at}: custom (TorchScript) objects are not "
                                         "supported in files")
                elif (name, f.name) == ("SymExpr", "expr_str"):
                    try:
                        check_expression(item, self.expr_kind)
                    except ValueError as exc:
                        raise fs.Invalid(f"{at}: {exc}") from None
                else:
                    self.visit(hints[f.name], item, at, name, f.name)
            if name == "TensorMeta":
                self.tensor_meta(value, where)
        finally:
            self.depth -= 1

    @staticmethod
    def tensor_meta(value: Dict[str, Any], where: str) -> None:
        if len(value["sizes"]) > 64 or len(value["strides"]) != len(value["sizes"]):
            raise fs.Invalid(f"{where}: {len(value['sizes'])} sizes and "
                             f"{len(value['strides'])} strides")
        for i, size in enumerate(value["sizes"] + [value["storage_offset"]]):
            if isinstance(size.get("as_int"), int) and size["as_int"] < 0:
                raise fs.Invalid(f"{where}: negative size or offset {size['as_int']}")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls, globalns=vars(schema))


def checked_program_json(data: bytes, where: str = "program.json") -> bytes:
    """Check a ``program.json`` blob (see the module docstring).

    Returns:
        The JSON the deserializer may read: the same program with node metadata
        reduced to ``nn_module_stack`` and ``custom``.

    Raises:
        Invalid: the first part that is malformed or not allowed, with its path.
    """
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise fs.Invalid(f"{where}: not JSON ({type(exc).__name__}: {exc})") from None
    walker = _Walker()
    walker.visit(schema.ExportedProgram, doc, where)
    major = doc["schema_version"]["major"]
    if major != schema.SCHEMA_VERSION[0]:
        raise fs.Invalid(f"{where}: torch.export schema version {major} (this torch "
                         f"reads {schema.SCHEMA_VERSION[0]})")
    return json.dumps(doc).encode()
