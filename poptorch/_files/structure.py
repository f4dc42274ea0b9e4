"""The argument / output structure of a captured program and ``forward``'s signature,
as JSON data (stored in executable files and cache entries, docs/semantics.md S-62), and back."""
from __future__ import annotations

import collections
import inspect
from typing import Any, Dict, List, Optional

import torch

from popart_compiler.errors import backend_error
from poptorch._capture.args import Spec
from poptorch._files.container import decode, dtype_name, dtype_of, encode

__all__ = ["encode_spec", "decode_spec", "encode_signature", "decode_signature"]


def encode_spec(spec: Optional[Spec], where: str) -> Any:
    """JSON form of an argument / output structure.

    Raises:
        poptorch.Error: a custom-parser argument or a constant that is not JSON data.
    """
    if spec is None:
        return None
    if spec.kind == "tensor":
        dtype, shape = spec.meta
        return {"kind": "tensor", "dtype": dtype_name(dtype), "shape": list(shape)}
    if spec.kind == "custom":
        raise backend_error(f"Cannot export {where}: arguments handled by a custom "
                            "argument parser cannot be stored in an executable file.")
    if spec.kind == "const":
        return {"kind": "const", "value": encode(spec.meta, where)}
    out: Dict[str, Any] = {"kind": spec.kind,
                           "children": [encode_spec(c, f"{where}[{i}]")
                                        for i, c in enumerate(spec.children)]}
    if spec.kind == "namedtuple":
        out["type"] = spec.pytype.__name__
        out["fields"] = list(spec.pytype._fields)
    if spec.kind == "dict":
        out["keys"] = encode(list(spec.meta), where)
    return out


def decode_spec(data: Any, types_by_name: Optional[Dict[str, type]] = None
                ) -> Optional[Spec]:
    """Inverse of :func:`encode_spec`. Named tuples are rebuilt with
    ``collections.namedtuple`` unless ``types_by_name`` has the original class."""
    if data is None:
        return None
    kind = data["kind"]
    if kind == "tensor":
        return Spec("tensor", torch.Tensor, (dtype_of(data["dtype"]), tuple(data["shape"])))
    if kind == "const":
        value = decode(data["value"])
        return Spec("const", type(value), value)
    children = [decode_spec(c, types_by_name) for c in data["children"]]
    if kind == "namedtuple":
        pytype = (types_by_name or {}).get(data["type"]) or \
            collections.namedtuple(data["type"], data["fields"])
        return Spec("namedtuple", pytype, None, children)
    if kind == "dict":
        return Spec("dict", dict, decode(data["keys"]), children)
    return Spec(kind, {"tuple": tuple, "list": list}[kind], None, children)


def encode_signature(forward) -> Optional[List[Dict[str, Any]]]:
    """The parameters of ``forward`` (names, kinds, JSON defaults), or ``None`` when it
    has no inspectable signature. Defaults that are not JSON data are dropped (the
    argument becomes mandatory for a model loaded without its Python source)."""
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):
        return None
    out = []
    for p in sig.parameters.values():
        entry: Dict[str, Any] = {"name": p.name, "kind": int(p.kind)}
        if p.default is not inspect.Parameter.empty:
            try:
                entry["default"] = encode(p.default, f"the default of {p.name}")
            except Exception:  # a tensor or an object: no default after loading
                entry["no_default"] = True
        out.append(entry)
    return out


def decode_signature(data: Optional[List[Dict[str, Any]]]) -> inspect.Signature:
    """An ``inspect.Signature`` equal to the one :func:`encode_signature` stored."""
    if data is None:
        return inspect.Signature([inspect.Parameter(
            "args", inspect.Parameter.VAR_POSITIONAL)])
    params = []
    for entry in data:
        default = decode(entry["default"]) if "default" in entry else \
            inspect.Parameter.empty
        params.append(inspect.Parameter(entry["name"], inspect._ParameterKind(entry["kind"]),
                                        default=default))
    return inspect.Signature(params)
