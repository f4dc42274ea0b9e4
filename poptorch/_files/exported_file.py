"""Reading an exported ``.poptorch`` file with every part checked before anything is
built from it (issue 19, items 1-3): what ``poptorch.load``, ``loadExecutable`` and
``importPoptorchMetadataFromFile`` read.

:func:`read_file` reads the container (sizes and checksums,
:func:`poptorch._files.container.read_container`) and the metadata's kind and version;
:func:`check_file` then checks the rest against the declared shapes
(:mod:`poptorch._files.shapes`): options, ``forward`` signature, replica groupings, the
weights blob against the weight layout and against the program's weights, the
optimizer record and, for ``poptorch.load``, the program itself
(:func:`poptorch._files.program.from_blobs`). A malformed part raises ``poptorch.Error``
"Invalid file <path>: <blob>: <what>" before any object is created.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
from typing import Any, Dict, Optional, Tuple

import torch

from popart_compiler.errors import backend_error

from poptorch._files import schema as fs
from poptorch import enums
from poptorch._files.shapes import (EXECUTABLE_KEYS, METADATA, check_signature, checked_options,
                           checked_tensors, decoded)
from poptorch._files.program import Program, from_blobs, structure_of
from poptorch._files.container import read_container

__all__ = ["CheckedFile", "read_file", "check_file"]


@dataclasses.dataclass
class CheckedFile:
    """The checked parts of an exported file.

    Attributes:
        meta: ``metadata.json`` (shape-checked).
        structure: ``structure.json`` (shape-checked).
        options: the stored ``poptorch.Options``.
        signature: ``forward``'s stored signature.
        groupings: replica-grouped weight name → ``(CommGroupType, shards,
            VariableRetrievalMode)``.
        weights: the stored weights by name (with ``with_model``).
        program: the stored program (with ``with_model``).
    """
    meta: Dict[str, Any]
    structure: Dict[str, Any]
    options: Any
    signature: inspect.Signature
    groupings: Dict[str, Tuple[Any, int, Any]]
    weights: Optional[Dict[str, torch.Tensor]] = None
    program: Optional[Program] = None


def read_file(filename: str) -> Tuple[Dict[str, bytes], Dict[str, Any]]:
    """The blobs and the (not yet checked) metadata of an exported file.

    Raises:
        poptorch.Error: an unreadable container, no metadata or program, metadata that
            is not a JSON object, or an executable-cache entry.
    """
    path = os.fspath(filename)
    blobs = read_container(path)
    if "metadata.json" not in blobs or "program.json" not in blobs:
        raise backend_error(f"Invalid file {path}: it does not contain Poptorch "
                            "metadata and a program.")
    try:
        meta = json.loads(blobs["metadata.json"])
        fs.check(meta, fs.Obj({"kind": fs.Str(max_len=100)},
                              {"poptorch_version": fs.Str(max_len=200)}, extra=True),
                 "metadata.json")
    except (ValueError, RecursionError) as exc:
        raise fs.invalid_file(path, exc if isinstance(exc, fs.Invalid) else
                              f"metadata.json: not JSON ({exc})") from None
    if meta["kind"] != "executable":
        raise backend_error(f"Invalid file {path}: it is an executable-cache entry, "
                            "not a file written by save() / compileAndExport().")
    return blobs, meta


def _groupings(value: Any, kinds: Optional[Dict[str, str]]) -> Dict[str, Tuple]:
    where = "metadata.json.replica_groupings"
    groupings = decoded(value, where)
    if not isinstance(groupings, dict):
        fs._fail(where, "a dict", groupings)
    for name, grouping in groupings.items():
        if not (isinstance(name, str) and fs.IDENTIFIER.match(name) and
                isinstance(grouping, tuple) and len(grouping) == 3 and
                isinstance(grouping[0], enums.CommGroupType) and
                type(grouping[1]) is int and grouping[1] >= 1 and
                isinstance(grouping[2], enums.VariableRetrievalMode)):
            raise fs.Invalid(f"{where}: malformed grouping of {name!r}")
        if kinds is not None and not kinds.get(name, "").startswith("parameter"):
            raise fs.Invalid(f"{where}: {name!r} is not a parameter of the model")
    return groupings


def _check_weights(meta: Dict[str, Any], blobs: Dict[str, bytes],
                   structure: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The stored weights, consistent with their layout and with the program."""
    if "weights" not in meta or "weights.safetensors" not in blobs:
        raise fs.Invalid("the file was exported with the model but holds no weights")
    kinds, aliases = meta["weights"]["kinds"], meta["weights"]["aliases"]
    weights = checked_tensors(blobs["weights.safetensors"], "weights.safetensors",
                              names=kinds)
    for alias, target in aliases.items():
        if alias in kinds or target not in kinds:
            raise fs.Invalid(f"metadata.json.weights: alias {alias!r} of {target!r}")
    for entry in structure["state"]:
        name = aliases.get(entry["name"], entry["name"])
        tensor = weights.get(name)
        if tensor is None or list(tensor.shape) != entry["shape"] or \
                str(tensor.dtype).rpartition(".")[2] != entry["dtype"]:
            raise fs.Invalid(f"weights.safetensors: the program's weight "
                             f"{entry['name']} ({entry['shape']} {entry['dtype']}) is "
                             "missing or has another shape or dtype")
    return weights


def check_file(path: str, blobs: Dict[str, bytes], meta: Dict[str, Any],
               with_model: bool) -> CheckedFile:
    """Check every part of an exported file (see the module docstring).

    Args:
        with_model: also check the weights and the optimizer and rebuild the program
            (``poptorch.load``); otherwise only what ``loadExecutable`` needs before it
            compares the file with its model.

    Raises:
        poptorch.Error: "Invalid file <path>: <where>: <what>".
    """
    try:
        fs.check(meta, METADATA, "metadata.json")
        missing = [k for k in EXECUTABLE_KEYS if k not in meta]
        if missing:
            raise fs.Invalid(f"metadata.json: the key {missing[0]!r} is missing")
        structure = structure_of(blobs)
        checked = CheckedFile(
            meta, structure, checked_options(meta["options"], "metadata.json.options"),
            check_signature(meta["signature"], "metadata.json.signature"),
            _groupings(meta["replica_groupings"],
                       meta["weights"]["kinds"] if with_model and "weights" in meta
                       else None))
        if with_model:
            checked.weights = _check_weights(meta, blobs, structure)
            if meta["export_model"] and meta["training"] != ("optimizer" in meta):
                raise fs.Invalid(
                    f"metadata.json: training is {str(meta['training']).lower()} but "
                    f"the file {'holds no' if meta['training'] else 'holds an'} "
                    "optimizer (an exported training executable always holds one, an "
                    "inference executable none)")
            if meta["training"] and "optimizer.safetensors" not in blobs:
                raise fs.Invalid("the blob optimizer.safetensors is missing")
    except fs.Invalid as exc:
        raise fs.invalid_file(path, exc) from None
    if with_model:
        checked.program = from_blobs(blobs, path)
    return checked
