"""A captured program as named blobs, and back (docs/semantics.md S-61, S-62).

:class:`Program` is what one capture produces for an executor: the
:class:`~poptorch._capture.capture.Captured` graph plus the structure of the inputs it was
captured with. :func:`to_blobs` stores it with ``torch.export``'s serializer (the
program as JSON, without its weights) and safetensors (constants, host outputs);
:func:`from_blobs` rebuilds it. Weights are never part of a program: the executor
uploads its host model's tensors (docs/semantics.md S-62), so a cache entry serves any weights. The
rebuilt program is a ``torch.export`` program of ATen ops, so a training session
differentiates it with PyTorch autograd exactly like a freshly captured one; no Python
source of the model is needed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import types
import typing
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch._export.serde import serialize as serde
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from popart_compiler.errors import backend_error
from popart_compiler.ir import Graph
from popart_compiler.passes.placement import Placement
from poptorch._capture.args import Spec
from poptorch._capture.capture import Captured
from poptorch._files import schema as fs
from poptorch._files.container import dtype_name, dtype_of, tensors_to_bytes
from poptorch._files.program_checks import checked_program_json
from poptorch._files.shapes import check_structure, checked_tensors
from poptorch._files.structure import decode_spec, encode_spec

__all__ = ["Program", "to_blobs", "from_blobs", "state_signature", "structure_of",
           "host_ops", "HOST_OPS_REASON"]


@dataclasses.dataclass
class Program:
    """One captured program and the call structure it was captured for.

    Attributes:
        captured: graph, output structure and host outputs.
        input_spec: structure of the bound ``forward`` arguments.
        input_names: the bound argument names.
        num_positional: how many of them were passed positionally.
        blobs: the program serialized before compilation (:func:`to_blobs`), when
            it was read from or written to a file.
    """
    captured: Captured
    input_spec: Spec
    input_names: List[str]
    num_positional: int
    blobs: Optional[Dict[str, bytes]] = None


# -- torch.export (de)serialization ------------------------------------------------------

@contextlib.contextmanager
def _memoized_type_hints() -> Iterator[None]:
    """``torch._export.serde`` resolves the type hints of its schema dataclasses once
    per JSON object; they never change, so remember them while (de)serializing (halves
    the time for transformer-size programs)."""
    original = serde.typing
    memo: Dict[Any, Any] = {}

    def get_type_hints(cls, globalns=None, localns=None, include_extras=False):
        key = (cls, include_extras)
        if key not in memo:
            memo[key] = original.get_type_hints(cls, globalns=globalns, localns=localns,
                                                include_extras=include_extras)
        return memo[key]

    proxy = types.SimpleNamespace(**{k: getattr(typing, k) for k in dir(typing)
                                     if not k.startswith("__")})
    proxy.get_type_hints = get_type_hints
    serde.typing = proxy
    try:
        yield
    finally:
        serde.typing = original


def _serialize_program(program: ExportedProgram) -> bytes:
    with _memoized_type_hints():
        artifact = serde.serialize(program, serialize_state_dict=False,
                                   serialize_constants=False,
                                   serialize_example_inputs=False)
    return artifact.exported_program


def _deserialize_program(data: bytes, state: Dict[str, torch.Tensor],
                         constants: Dict[str, Any]) -> ExportedProgram:
    with _memoized_type_hints():
        program = serde.deserialize(serde.SerializedArtifact(data, state, constants, ((), {})))
    # torch's serializer drops the value of an op that returns nothing (e.g.
    # aten._assert_tensor_metadata from a ``.to(dtype)``); a capture records it as None
    for node in program.graph.nodes:
        if node.op == "call_function" and "val" not in node.meta:
            node.meta["val"] = None
    return program


def state_signature(program: ExportedProgram) -> List[Dict[str, Any]]:
    """Name, kind, shape, dtype and ``requires_grad`` of every parameter and persistent
    buffer of ``program`` (the weights a file or cache entry expects)."""
    out = []
    for spec in program.graph_signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER) or \
                spec.target not in program.state_dict:
            continue
        value = program.state_dict[spec.target]
        out.append({"name": spec.target,
                    "kind": "parameter" if spec.kind == InputKind.PARAMETER else "buffer",
                    "shape": list(value.shape), "dtype": dtype_name(value.dtype),
                    "requires_grad": bool(value.requires_grad)})
    return out


def _program_state(signature: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """A placeholder ``state_dict`` for a rebuilt program: uninitialised tensors of
    the stored shapes and dtypes. Their values are never used: the executor uploads the host model's
    weights before any run (docs/semantics.md S-62: weights come from the wrapper's model)."""
    state: Dict[str, torch.Tensor] = {}
    for entry in signature:
        value = torch.empty(entry["shape"], dtype=dtype_of(entry["dtype"]))
        if entry["kind"] == "parameter":
            value = torch.nn.Parameter(value, requires_grad=entry["requires_grad"])
        state[entry["name"]] = value
    return state


# -- whole programs ----------------------------------------------------------------------

#: Why a program with ``poptorch.CPU`` ops is never stored (issue 29, item 3).
HOST_OPS_REASON = ("a file holds data only, never Python code, and a host function has no "
                   "name another process could look it up by")


def host_ops(program: Program) -> List[str]:
    """The IDs of the ``poptorch.CPU`` ops ``program`` calls (in any sub-graph), sorted."""
    found = set()
    for module in program.captured.graph.program.graph_module.modules():
        graph = getattr(module, "graph", None)
        for node in getattr(graph, "nodes", ()):
            if node.op == "call_function" and \
                    str(node.target).startswith("poptorch.host_call") and node.args[1:]:
                found.add(str(node.args[1]).rpartition("#")[0])
    return sorted(found)


def to_blobs(program: Program) -> Dict[str, bytes]:
    """``program.json``, ``constants.safetensors``, ``host_outputs.safetensors`` and
    ``structure.json`` (input / output structure, weight layout, the placement of the
    blocks the capture recorded) of an (uncompiled) captured program. Weights are left
    out.

    Raises:
        poptorch.Error: the program holds something that cannot be stored (a
            ``poptorch.CPU`` host op, a custom class object, a custom-parser argument,
            a non-JSON constant argument).
    """
    ops = host_ops(program)
    if ops:
        raise backend_error(
            f"Cannot store the program: it calls the poptorch.CPU host op(s) "
            f"{', '.join(map(repr, ops))}, and {HOST_OPS_REASON}. Save a model without "
            "poptorch.CPU ops, or re-create the model and its wrapper in the loading "
            "process and compile it there.")
    exported = program.captured.graph.program
    constants = {}
    for name, value in exported.constants.items():
        if not isinstance(value, torch.Tensor):
            raise backend_error(f"Cannot export the program: constant {name} is a "
                                f"{type(value).__name__}, not a tensor.")
        constants[name] = value
    captured = program.captured
    structure = {
        "inputs": encode_spec(program.input_spec, "the inputs"),
        "input_names": list(program.input_names),
        "num_positional": program.num_positional,
        "outputs": encode_spec(captured.output_spec, "the outputs"),
        "output_leaves": list(captured.output_leaves),
        "state": state_signature(exported),
        "blocks": [[name, dataclasses.asdict(where)]
                   for name, where in captured.graph.blocks.items()],
    }
    return {
        "program.json": _serialize_program(exported),
        "constants.safetensors": tensors_to_bytes(constants),
        "host_outputs.safetensors": tensors_to_bytes(
            {str(i): t for i, t in enumerate(captured.host_outputs)}),
        "structure.json": json.dumps(structure).encode(),
    }


#: The blobs that make up a program (the rest of a file is metadata and weights).
_PROGRAM_BLOBS = ("program.json", "constants.safetensors", "host_outputs.safetensors",
                  "structure.json")


def structure_of(blobs: Dict[str, bytes], where: str = "structure.json") -> Dict[str, Any]:
    """The decoded and checked ``structure.json`` blob.

    Raises:
        Invalid: missing, not JSON or not of the declared shape.
    """
    if "structure.json" not in blobs:
        raise fs.Invalid("the blob structure.json is missing")
    try:
        structure = json.loads(blobs["structure.json"])
    except (ValueError, RecursionError) as exc:
        raise fs.Invalid(f"{where}: not JSON ({exc})") from None
    check_structure(structure, where)
    return structure


def _leaves(spec: Optional[Spec]) -> List[Spec]:
    if spec is None:
        return []
    if spec.kind == "tensor":
        return [spec]
    return [leaf for child in (spec.children or []) for leaf in _leaves(child)]


def _dims(shape) -> tuple:
    """A shape as compared between a structure and its program: the rank and all but
    the (batch) first dimension."""
    return len(shape), tuple(shape)[1:]


def _check_consistent(captured: Captured, program: "Program",
                      structure: Dict[str, Any]) -> None:
    """The stored structure matches the stored program (same inputs, outputs and
    weights), so that nothing fails later when the program runs."""
    graph = captured.graph
    exported = graph.program
    # The stored input structure is that of a whole call; the program's inputs are one
    # micro-batch of it (float64 inputs demoted): compare all but the batch dimension.
    inputs = [_dims(s.meta[1]) for s in _leaves(program.input_spec)]
    actual = [_dims(i.shape) if i is not None else None for i in graph.user_inputs]
    if inputs != actual:
        raise fs.Invalid(f"structure.json: the inputs {inputs} do not match the "
                         f"program's {actual}")
    leaves = captured.output_leaves
    specs = _leaves(captured.output_spec)
    if len(leaves) != len(specs) or any(
            i is not None and i >= graph.num_user_outputs for i in leaves) or \
            sum(i is None for i in leaves) != len(captured.host_outputs):
        raise fs.Invalid("structure.json: output_leaves do not match the program's "
                         "outputs")
    outputs = [_dims(s.meta[1]) for s, i in zip(specs, leaves) if i is not None]
    actual = [_dims(graph.user_outputs[i].shape) if graph.user_outputs[i] is not None
              else None for i in leaves if i is not None]
    if outputs != actual:
        raise fs.Invalid(f"structure.json: the outputs {outputs} do not match the "
                         f"program's {actual}")
    signature = {e["name"]: e for e in structure["state"]}
    for spec in exported.graph_signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER) or \
                spec.target not in exported.state_dict:
            continue
        node = next(n for n in graph.module.graph.nodes if n.name == spec.arg.name)
        val = node.meta.get("val")
        entry = signature.get(spec.target)
        # (dtypes may differ: float64 weights are captured as float32; a replica-
        # grouped weight is captured as one group's slice)
        if entry is None or not isinstance(val, torch.Tensor) or \
                list(val.shape) not in (entry["shape"], entry["shape"][1:]):
            raise fs.Invalid(f"structure.json: weight {spec.target} does not match the "
                             "program")


def from_blobs(blobs: Dict[str, bytes], where: str,
               types_by_name: Optional[Dict[str, type]] = None) -> Program:
    """Rebuild a :class:`Program` from :func:`to_blobs`'s blobs, every part checked
    before it is used (:mod:`poptorch._files.program_checks`, :mod:`poptorch._files.shapes`).

    Args:
        blobs: the blobs (checked by the container reader).
        where: the file, for error messages.
        types_by_name: original named-tuple classes of the inputs, when available.

    Raises:
        poptorch.Error: "Invalid file <where>: <blob>: <what>": a missing or malformed
            part, anything a stored program may not contain (see
            :mod:`poptorch._files.program_checks`), or a program this torch cannot read.
    """
    try:
        return _from_blobs(blobs, types_by_name)
    except fs.Invalid as exc:
        raise fs.invalid_file(where, exc) from None


def _from_blobs(blobs: Dict[str, bytes],
                types_by_name: Optional[Dict[str, type]]) -> Program:
    missing = [name for name in _PROGRAM_BLOBS if name not in blobs]
    if missing:
        raise fs.Invalid(f"the blob {missing[0]} is missing")
    structure = structure_of(blobs)
    program_json = checked_program_json(blobs["program.json"])
    constants = checked_tensors(blobs["constants.safetensors"], "constants.safetensors")
    host_blob = blobs["host_outputs.safetensors"]
    host = checked_tensors(host_blob, "host_outputs.safetensors")
    if set(host) != {str(i) for i in range(len(host))}:
        raise fs.Invalid("host_outputs.safetensors: tensors must be named 0..n-1")
    input_spec = decode_spec(structure["inputs"], types_by_name)
    output_spec = decode_spec(structure["outputs"])
    try:
        state = _program_state(structure["state"])
    except (RuntimeError, ValueError) as exc:  # e.g. an integer weight with a gradient
        raise fs.Invalid(f"structure.json: state: {exc}") from None
    try:
        exported = _deserialize_program(program_json, state, constants)
        graph = Graph(exported, blocks={name: Placement(**where)
                                        for name, where in structure["blocks"]})
    except Exception as exc:  # noqa: BLE001 - anything torch raises on a bad program
        raise fs.Invalid(f"program.json: the stored program cannot be read by torch "
                         f"{torch.__version__} ({type(exc).__name__}: "
                         f"{str(exc)[:500]})") from None
    captured = Captured(graph, output_spec, list(structure["output_leaves"]),
                        [host[str(i)] for i in range(len(host))])
    program = Program(captured, input_spec, list(structure["input_names"]),
                      int(structure["num_positional"]),
                      blobs={k: v for k, v in blobs.items() if k in _PROGRAM_BLOBS})
    try:
        _check_consistent(captured, program, structure)
    except fs.Invalid:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's shape checks on a bad program
        raise fs.Invalid(f"program.json: the stored shapes cannot be checked "
                         f"({type(exc).__name__}: {str(exc)[:500]})") from None
    return program
