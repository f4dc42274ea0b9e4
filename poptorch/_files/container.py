"""The executable file format: a zip container of named blobs (spec S-62, api §2.13).

Layout of a ``.poptorch`` file (also used for executable-cache entries, S-61)::

    manifest.json          {"format": "poptorch-executable", "format_version": 2,
                            "blobs": {<name>: {"sha256": <hex>, "size": <bytes>}}}
    metadata.json          versions, options, input/output structure, model signature,
                           optimizer settings, RNG state (JSON, see ``program.py``)
    program.json           the captured forward program (torch.export serialization)
    constants.safetensors  the program's constant tensors
    weights.safetensors    parameters and buffers (exported files only)
    ...                    other ``*.safetensors`` blobs (inputs, optimizer state)
    model.pkl              the pickled Python model (only with ``export_model=True``;
                           read only when the caller opts in)

Every blob is checked against the manifest's SHA-256 before use, so a truncated or
edited file is refused with an :class:`poptorch.Error` naming the blob. Files are written
to a temporary name in the target directory and renamed into place (``os.replace``):
a reader never sees a partial file. JSON values that are not plain JSON (enums,
dtypes, tuples, option objects) use the tagged encoding of :func:`encode` /
:func:`decode`, which only ever rebuilds classes of ``poptorch``'s own option and
enum modules: nothing in a file is unpickled or executed unless the caller asks for
the pickled model.
"""
from __future__ import annotations

import enum
import hashlib
import importlib
import json
import os
import tempfile
import zipfile
from typing import Any, Dict

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from popart_compiler.errors import Error, backend_error

__all__ = ["FORMAT", "FORMAT_VERSION", "write_container", "read_container", "encode",
           "decode", "tensors_to_bytes", "tensors_from_bytes", "dtype_name", "dtype_of"]

FORMAT = "poptorch-executable"
#: Bumped whenever the layout or the meaning of a blob changes.
FORMAT_VERSION = 2
_MANIFEST = "manifest.json"

#: Modules whose classes the tagged JSON encoding may rebuild (options and enums).
_ALLOWED_MODULES = ("poptorch.options", "poptorch._options.groups",
                    "poptorch._options.dict", "poptorch._options.execution_strategy",
                    "poptorch.enums", "poptorch.optim", "poptorch._options.backend")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_blobs(stream, blobs: Dict[str, bytes]) -> None:
    """Write the manifest and ``blobs`` into the zip ``stream``."""
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION,
                "blobs": {name: {"sha256": _sha256(data), "size": len(data)}
                          for name, data in blobs.items()}}
    with zipfile.ZipFile(stream, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(_MANIFEST, json.dumps(manifest, indent=1))
        for name, data in blobs.items():
            archive.writestr(name, data)


def write_container(path: str, blobs: Dict[str, bytes]) -> None:
    """Atomically write ``blobs`` as a container at ``path``.

    The data goes to a temporary file in the same directory, is flushed to disk and
    renamed over ``path``: concurrent readers see the old file or the new one, and a
    process killed while writing leaves at most a stray temporary file.

    Raises:
        OSError: the directory is not writable.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".poptorch", dir=directory)
    try:
        with os.fdopen(fd, "wb") as stream:
            _write_blobs(stream, blobs)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_container(path: str) -> Dict[str, bytes]:
    """Read and verify a container.

    Returns:
        Blob name → bytes, every blob checked against its manifest checksum.

    Raises:
        poptorch.Error: "Invalid file <path>: <reason>": missing file, not a zip /
            truncated, no manifest (not a PopTorch file), another format or format
            version, a missing blob or a checksum mismatch.
    """
    def invalid(reason: str) -> Error:
        return backend_error(f"Invalid file {path}: {reason}")

    if not os.path.isfile(path):
        raise invalid("no such file")
    try:
        with zipfile.ZipFile(path, "r") as archive:
            names = set(archive.namelist())
            if _MANIFEST not in names:
                raise invalid("the file does not contain Poptorch metadata (no "
                              f"{_MANIFEST}): it was not written by "
                              "PoplarExecutor.save() / compileAndExport()")
            manifest = json.loads(archive.read(_MANIFEST))
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
                raise invalid(f"unknown format {manifest.get('format')!r} "
                              f"(expected {FORMAT!r})")
            version = manifest.get("format_version")
            if version != FORMAT_VERSION:
                raise invalid(f"format version {version} is not supported by this "
                              f"PopTorch (which reads version {FORMAT_VERSION}): export "
                              "the model again with this version")
            blobs = {}
            for name, entry in manifest.get("blobs", {}).items():
                if name not in names:
                    raise invalid(f"blob {name} is missing (the file is truncated)")
                data = archive.read(name)
                if len(data) != entry.get("size") or _sha256(data) != entry.get("sha256"):
                    raise invalid(f"blob {name} is corrupted (checksum mismatch)")
                blobs[name] = data
            return blobs
    except Error:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError,
            KeyError, json.JSONDecodeError) as exc:
        raise invalid(f"the file is truncated or corrupted ({type(exc).__name__}: "
                      f"{exc})") from None


# -- tensors ---------------------------------------------------------------------------

def tensors_to_bytes(tensors: Dict[str, torch.Tensor]) -> bytes:
    """Safetensors bytes of ``tensors`` (contiguous CPU copies)."""
    return _st_save({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()})


def tensors_from_bytes(data: bytes) -> Dict[str, torch.Tensor]:
    """Tensors of a safetensors blob (empty bytes → empty dict)."""
    return dict(_st_load(data)) if data else {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"``."""
    return str(dtype).rpartition(".")[2]


def dtype_of(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`.

    Raises:
        poptorch.Error: not a torch dtype name.
    """
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise backend_error(f"Invalid file: {name!r} is not a torch dtype")
    return value


# -- tagged JSON -----------------------------------------------------------------------

def encode(value: Any, where: str = "value") -> Any:
    """A JSON-compatible form of ``value``: plain JSON values, lists, tuples, sets,
    dicts with any hashable encodable keys, ``torch.dtype``, members of ``poptorch``
    enums and instances of ``poptorch`` option / execution-strategy classes.

    Raises:
        poptorch.Error: a value of another type (``where`` names its location).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        if isinstance(value, enum.Enum):
            return _encode_object(value, where)
        return value
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [encode(v, where) for v in sorted(value, key=repr)]}
    if isinstance(value, dict):
        return {"__dict__": [[encode(k, where), encode(v, f"{where}[{k!r}]")]
                             for k, v in value.items()]}
    return _encode_object(value, where)


def _encode_object(value: Any, where: str) -> Any:
    cls = type(value)
    if cls.__module__ not in _ALLOWED_MODULES:
        raise backend_error(
            f"Cannot export {where}: values of type {cls.__module__}.{cls.__qualname__} "
            "cannot be stored in an executable file (only numbers, strings, lists, "
            "dicts, dtypes and poptorch option / enum values can).")
    name = f"{cls.__module__}:{cls.__qualname__}"
    if isinstance(value, enum.Enum):
        return {"__enum__": name, "name": value.name}
    return {"__object__": name, "state": encode(dict(vars(value)), where)}


def _class_of(name: str) -> type:
    module_name, _, qualname = str(name).partition(":")
    if module_name not in _ALLOWED_MODULES:
        raise backend_error(f"Invalid file: class {name} is not a poptorch option class")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if not isinstance(target, type) or target.__module__ != module_name:
        raise backend_error(f"Invalid file: unknown class {name}")
    return target


def decode(value: Any) -> Any:
    """Inverse of :func:`encode`.

    Raises:
        poptorch.Error: a tag that names a class outside ``poptorch``'s option and
            enum modules, or an unknown enum member.
    """
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__dtype__" in value:
        return dtype_of(value["__dtype__"])
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__set__" in value:
        return {decode(v) for v in value["__set__"]}
    if "__dict__" in value:
        return {_hashable(decode(k)): decode(v) for k, v in value["__dict__"]}
    if "__enum__" in value:
        cls = _class_of(value["__enum__"])
        if not issubclass(cls, enum.Enum) or value.get("name") not in cls.__members__:
            raise backend_error(f"Invalid file: {value.get('name')!r} is not a member of "
                                f"{value['__enum__']}")
        return cls[value["name"]]
    if "__object__" in value:
        cls = _class_of(value["__object__"])
        obj = cls.__new__(cls)
        state = decode(value.get("state", {"__dict__": []}))
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise backend_error(f"Invalid file: bad state for {value['__object__']}")
        obj.__dict__.update(state)  # no setter or __init__ of the class runs
        return obj
    return {k: decode(v) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
