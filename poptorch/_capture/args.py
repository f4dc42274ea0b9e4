"""Argument binding, flattening and validation (docs/semantics.md S-11, S-14, S-20…S-24)."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from popart_compiler.errors import py_error
from poptorch._capture.custom_parsers import getCustomArgParser
from poptorch._logging import logger

__all__ = ["ArgsParser", "BoundArgs", "Spec", "flatten", "unflatten", "validate", "keys_mismatch",
           "RECOMPILE"]

#: What a call with other inputs than the compiled ones must do (docs/semantics.md S-22).
RECOMPILE = (
    "The inputs given at run time differ from the ones the model was compiled with. "
    "To run with these inputs, create a new wrapper or call destroy() on this one: the "
    "next call then recompiles.")


@dataclasses.dataclass
class Spec:
    """The structure of an argument or output.

    ``kind`` is one of ``"tensor"`` (``meta`` = (dtype, shape)), ``"tuple"``,
    ``"namedtuple"``, ``"list"``, ``"dict"`` (``meta`` = keys in order), ``"custom"``
    (``meta`` = (parser, original object)) or ``"const"`` (``meta`` = the value).
    ``pytype`` is the Python type to rebuild.
    """
    kind: str
    pytype: type
    meta: Any = None
    children: List["Spec"] = dataclasses.field(default_factory=list)


def keys_mismatch(unexpected, missing) -> str:
    """PopTorch's wording: ``Unexpected arguments: z. Missing arguments: x.``"""
    return (f"Unexpected arguments: {', '.join(map(str, unexpected))}. "
            f"Missing arguments: {', '.join(map(str, missing))}.")


def flatten(value: Any, tensors: List[torch.Tensor]) -> Spec:
    """Append every tensor inside ``value`` to ``tensors`` and return its structure."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return Spec("tensor", type(value), (value.dtype, tuple(value.shape)))
    parser = getCustomArgParser(value)
    if parser is not None:
        found = list(parser.yieldTensors(value))
        tensors.extend(found)
        return Spec("custom", type(value), (parser, value),
                    [Spec("tensor", type(t), (t.dtype, tuple(t.shape))) for t in found])
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return Spec("namedtuple", type(value), None, [flatten(v, tensors) for v in value])
    if isinstance(value, tuple):
        return Spec("tuple", type(value), None, [flatten(v, tensors) for v in value])
    if isinstance(value, list):
        return Spec("list", type(value), None, [flatten(v, tensors) for v in value])
    if isinstance(value, dict):
        keys = list(value.keys())
        children = {k: flatten(value[k], tensors) for k in _canonical(keys)}
        return Spec("dict", type(value), keys, [children[k] for k in keys])
    return Spec("const", type(value), value)


def _canonical(keys: List[Any]) -> List[Any]:
    """Key order in which a dict's tensors are flattened: independent of insertion order
    (docs/semantics.md S-22: dict key order does not matter), so equal dicts give the same tensor
    order."""
    try:
        return sorted(keys)
    except TypeError:
        return sorted(keys, key=repr)


def unflatten(spec: Spec, tensors: Iterator[Any]) -> Any:
    """Rebuild a value of structure ``spec`` taking tensors from ``tensors``."""
    kind = spec.kind
    if kind == "tensor":
        return next(tensors)
    if kind == "const":
        return spec.meta
    if kind == "custom":
        parser, original = spec.meta
        return parser.reconstruct(original, tensors)
    if kind == "dict":
        by_key = dict(zip(spec.meta, spec.children))
        values = {k: unflatten(by_key[k], tensors) for k in _canonical(spec.meta)}
        items = [(k, values[k]) for k in spec.meta]
        try:
            return spec.pytype(items)
        except TypeError:
            return dict(items)
    children = [unflatten(c, tensors) for c in spec.children]
    if kind == "namedtuple":
        return spec.pytype(*children)
    if kind == "tuple":
        return tuple(children) if spec.pytype is tuple else spec.pytype(children)
    if kind == "list":
        return children if spec.pytype is list else spec.pytype(children)
    raise ValueError(f"unknown spec kind {kind}")


def _type_name(t: type) -> str:
    return getattr(t, "__name__", str(t))


def validate(name: str, compiled: Spec, now: Spec) -> None:
    """Raise the docs/semantics.md S-22 error for the first difference between ``compiled`` and
    ``now``."""

    def fail(text: str):
        raise py_error(f"{text}\n{RECOMPILE}")

    def kind_of(spec: Spec):
        return "tensor" if spec.kind == "tensor" else spec.pytype

    if kind_of(compiled) != kind_of(now) and not (
            compiled.kind == now.kind == "dict"):
        fail(f"Type mismatch for {name}: expected {_type_name(compiled.pytype)} but got "
             f"{_type_name(now.pytype)}.")
    if compiled.kind == "tensor":
        dtype0, shape0 = compiled.meta
        dtype1, shape1 = now.meta
        if dtype0 != dtype1:
            fail(f"Data type mismatch for {name}: expected {dtype0} but got {dtype1}.")
        if shape0 != shape1:
            fail(f"Shape mismatch for {name}: expected {torch.Size(shape0)} but got "
                 f"{torch.Size(shape1)}.")
        return
    if compiled.kind == "const":
        same = compiled.meta is now.meta
        if not same:
            try:
                same = bool(compiled.meta == now.meta)
            except Exception:  # objects without a boolean equality
                same = False
        if not same:
            fail(f"Value mismatch for {name}: expected {compiled.meta} but got {now.meta}.")
        return
    if compiled.kind == "dict":
        keys0, keys1 = list(compiled.meta), list(now.meta)
        if set(keys0) != set(keys1):
            unexpected = [k for k in keys1 if k not in keys0]
            missing = [k for k in keys0 if k not in keys1]
            fail(f"Keys mismatch for {name}: {keys_mismatch(unexpected, missing)}")
        children1 = dict(zip(keys1, now.children))
        for key, child in zip(keys0, compiled.children):
            validate(f"{name}[{key}]", child, children1[key])
        return
    if len(compiled.children) != len(now.children):
        fail(f"Length mismatch for {name}: expected {len(compiled.children)} elements but "
             f"got {len(now.children)}.")
    for i, (c0, c1) in enumerate(zip(compiled.children, now.children)):
        validate(f"{name}[{i}]", c0, c1)


@dataclasses.dataclass
class BoundArgs:
    """Arguments bound to ``forward``'s signature (docs/semantics.md S-20).

    Attributes:
        names: display name of each top-level argument (positional parameters, then
            ``*args`` elements as ``*<name>[i]``, then keyword-only / ``**kwargs`` keys).
        values: the argument values in that order.
        num_positional: how many of them are passed positionally.
    """
    names: List[str]
    values: List[Any]
    num_positional: int

    def call(self, fn: Callable, values: Optional[List[Any]] = None):
        values = self.values if values is None else values
        n = self.num_positional
        return fn(*values[:n], **dict(zip(self.names[n:], values[n:])))


class ArgsParser:
    """Binds call arguments to the signature of the captured module's ``forward``.

    Args:
        forward: the bound ``forward`` of the module being wrapped.
    """

    def __init__(self, forward: Callable):
        try:
            self._sig: Optional[inspect.Signature] = inspect.signature(forward)
        except (TypeError, ValueError):
            self._sig = None
        self._warned_dict = False
        # the signature's parts, worked out once (``bind`` runs on every call)
        P = inspect.Parameter
        params = list(self._sig.parameters.values()) if self._sig is not None else []
        self._variadic_only = self._sig is None or bool(params) and all(
            p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) for p in params)
        self._positional = [p for p in params
                            if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        self._var_pos = next((p for p in params if p.kind == P.VAR_POSITIONAL), None)
        self._kw_only = [p for p in params if p.kind == P.KEYWORD_ONLY]
        self._var_kw = next((p for p in params if p.kind == P.VAR_KEYWORD), None)
        self._allowed = [p.name for p in self._positional if p.kind != P.POSITIONAL_ONLY]
        self._allowed += [p.name for p in self._kw_only]
        self._known = {p.name for p in self._positional} | {p.name for p in self._kw_only}

    @property
    def signature(self) -> Optional[inspect.Signature]:
        """``forward``'s signature, or ``None`` when it has none."""
        return self._sig

    def bind(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> BoundArgs:
        """Bind ``args`` / ``kwargs`` (docs/semantics.md S-20).

        Raises:
            AssertionError: too many arguments; an unknown keyword; a parameter given
                both positionally and by keyword.
            poptorch.Error: "Mandatory parameter <name> missing".
        """
        if any(isinstance(v, dict) for v in list(args) + list(kwargs.values())) \
                and not self._warned_dict:
            logger.warning("Dictionary inputs are only partially supported: keys are "
                           "matched by name and their order is ignored.")
            self._warned_dict = True
        if self._variadic_only:
            return self._variadic(args, kwargs)
        positional, var_pos, kw_only = self._positional, self._var_pos, self._kw_only
        allowed = self._allowed
        if len(args) > len(positional) and var_pos is None:
            raise AssertionError(
                f"Too many arguments provided: forward takes {len(positional)} "
                f"positional argument(s) but {len(args)} were given.")
        for key in kwargs:
            if key not in allowed and self._var_kw is None:
                raise AssertionError(f"{key} is not a valid parameter."
                                     f"Allowed values are {allowed}")
        names: List[str] = []
        values: List[Any] = []

        def take(p: inspect.Parameter) -> None:
            if p.name in kwargs:
                value = kwargs[p.name]
            elif p.default is not inspect.Parameter.empty:
                value = p.default
            else:
                raise py_error(f"Mandatory parameter {p.name} missing")
            names.append(p.name)
            values.append(value)

        for i, p in enumerate(positional):
            if i < len(args):
                if p.name in kwargs:
                    raise AssertionError(f"Parameter {p.name} was passed more than once")
                names.append(p.name)
                values.append(args[i])
            else:
                take(p)
        if var_pos is not None:
            for i, value in enumerate(args[len(positional):]):
                names.append(f"*{var_pos.name}[{i}]")
                values.append(value)
        num_positional = len(values)
        for p in kw_only:
            take(p)
        for key, value in kwargs.items():
            if key not in self._known:
                names.append(key)
                values.append(value)
        return BoundArgs(names, values, num_positional)

    @staticmethod
    def _variadic(args, kwargs) -> BoundArgs:
        names = [f"*args[{i}]" for i in range(len(args))] + list(kwargs)
        return BoundArgs(names, list(args) + list(kwargs.values()), len(args))


def check_batch(name: str, tensor: torch.Tensor, factor: int, d: int, r: int, g: int,
                a: int) -> None:
    """docs/semantics.md S-11: the leading dimension must be a multiple of ``N = D × (R/g) × A``.

    Raises:
        AssertionError: stating the shape, the dimension and the formula with numbers.
    """
    if tensor.dim() == 0:
        if factor != 1:
            raise AssertionError(
                f"Input {name} is a scalar (0-d tensor) but the combined batch factor is "
                f"deviceIterations({d}) * replicationFactor({r}) / inputGroupSize({g}) * "
                f"gradientAccumulation({a}) = {factor}; scalars are only accepted when it "
                "is 1. See the PopTorch batching documentation.")
        return
    if tensor.shape[0] % factor:
        raise AssertionError(
            f"Invalid batch dimension: In the input {name}, the batch dimension "
            f"({tensor.shape[0]}) of shape {list(tensor.shape)} must be a multiple of "
            f"deviceIterations({d}) * replicationFactor({r}) / inputGroupSize({g}) * "
            f"gradientAccumulation({a}) = {factor}. See the PopTorch batching "
            "documentation (combined batch size = micro-batch size x that factor).")


def leaf_names(name: str, spec: Spec) -> List[str]:
    """Display name of every tensor leaf of ``spec`` (``name[i]``, ``name[key]``)."""
    if spec.kind == "tensor":
        return [name]
    if spec.kind == "custom":
        return [f"{name}[{i}]" for i in range(len(spec.children))]
    if spec.kind == "dict":
        by_key = dict(zip(spec.meta, spec.children))
        return [n for key in _canonical(spec.meta)
                for n in leaf_names(f"{name}[{key}]", by_key[key])]
    return [n for i, c in enumerate(spec.children) for n in leaf_names(f"{name}[{i}]", c)]

