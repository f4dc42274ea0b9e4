"""The executable file format: a zip container of named blobs (docs/semantics.md S-62,
docs/api-sections.md api §2.13).

Layout of a ``.poptorch`` file (also used for executable-cache entries, docs/semantics.md S-61)::

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

Blobs are stored uncompressed; the reader refuses a compressed entry before inflating
it and checks every declared size against the size of the file, so a file cannot make
it allocate more than its own size. Every blob is checked against the manifest's
SHA-256 before use, so a truncated or edited file is refused with an
:class:`poptorch.Error` naming the blob. A checksum is no signature (whoever edits a
file recomputes it): the contents are checked by :mod:`poptorch._files.shapes` and
:mod:`poptorch._files.program_checks` before anything is built from them. Files are written
to a temporary name in the target directory and renamed into place (``os.replace``): a
reader never sees a partial file, and nothing that is not a regular file is replaced.
JSON values that are not plain JSON (enums, dtypes, tuples, option objects) use the
tagged encoding of :func:`encode` / :func:`decode`, which only ever rebuilds classes of
``poptorch``'s own option and enum modules: nothing in a file is unpickled or executed
unless the caller asks for the pickled model.
"""
from __future__ import annotations

import enum
import hashlib
import importlib
import json
import os
import stat
import tempfile
import zipfile
from typing import Any, Dict, Optional

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from popart_compiler.errors import Error, backend_error
from poptorch import enums as _enums

__all__ = ["FORMAT", "FORMAT_VERSION", "write_container", "read_container", "encode",
           "decode", "tensors_to_bytes", "tensors_from_bytes", "dtype_name", "dtype_of",
           "DTYPES", "MAX_MANIFEST_BYTES"]

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


def kind_of(mode: int) -> str:
    """What a file of ``os.stat`` mode ``mode`` is, for messages ("a directory")."""
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return what
    return "not a regular file"


def not_regular(path: str) -> Optional[str]:
    """What ``path`` is when it exists and is not a regular file (a link, directory,
    device, FIFO or socket: never replaced), else ``None``."""
    if not os.path.lexists(path):
        return None
    mode = os.lstat(path).st_mode
    return None if stat.S_ISREG(mode) else kind_of(mode)


def write_container(path: str, blobs: Dict[str, bytes]) -> None:
    """Atomically write ``blobs`` as a container at ``path``.

    The data goes to a temporary file in the same directory, is flushed to disk and
    renamed over ``path``: concurrent readers see the old file or the new one, and a
    process killed while writing leaves at most a stray temporary file.

    Raises:
        OSError: the directory is not writable.
        poptorch.Error: ``path`` exists and is not a regular file (never replaced).
    """
    what = not_regular(path)
    if what is not None:
        raise backend_error(f"Cannot write {path}: it exists and is {what}, which is "
                            "never replaced.")
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


#: Largest ``manifest.json`` accepted (a manifest lists a dozen blobs in 2 KB).
MAX_MANIFEST_BYTES = 1 << 20
_CHUNK = 1 << 20


def _read_capped(archive: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> bytes:
    """The bytes of entry ``info``, read in chunks and never more than ``limit + 1``
    (an entry whose data runs past its declared size is refused by the caller)."""
    parts, total = [], 0
    with archive.open(info) as stream:
        while total <= limit:
            chunk = stream.read(min(_CHUNK, limit + 1 - total))
            if not chunk:
                break
            parts.append(chunk)
            total += len(chunk)
    return b"".join(parts)


def read_container(path: str) -> Dict[str, bytes]:
    """Read and verify a container.

    Nothing is inflated: PopTorch writes every blob stored (uncompressed), so a
    compressed entry is refused before any of it is read, and every declared size is
    checked against the size of the file first. The memory a file can make the reader
    allocate is therefore bounded by the size of the file (a decompression bomb is
    refused with no more memory than a good file of its size takes).

    Returns:
        Blob name → bytes, every blob checked against its manifest size and checksum.

    Raises:
        poptorch.Error: "Invalid file <path>: <reason>": missing file, not a zip /
            truncated, no manifest (not a PopTorch file), a malformed manifest, another
            format or format version, a compressed, oversized, duplicated or missing
            blob or a checksum mismatch.
    """
    def invalid(reason: str) -> Error:
        return backend_error(f"Invalid file {path}: {reason}")

    if not os.path.isfile(path):
        raise invalid("not a regular file" if os.path.exists(path) else "no such file")
    try:
        file_size = os.path.getsize(path)
        with zipfile.ZipFile(path, "r") as archive:
            infos: Dict[str, zipfile.ZipInfo] = {}
            for info in archive.infolist():
                if info.filename in infos:
                    raise invalid(f"blob {info.filename} appears twice")
                infos[info.filename] = info
                if info.compress_type != zipfile.ZIP_STORED:
                    raise invalid(f"blob {info.filename} is compressed (zip method "
                                  f"{info.compress_type}); PopTorch files store blobs "
                                  "uncompressed and compressed ones are not inflated")
                if max(info.file_size, info.compress_size) > file_size:
                    raise invalid(f"blob {info.filename} declares {info.file_size} "
                                  f"bytes, more than the whole file ({file_size} bytes)")
            if _MANIFEST not in infos:
                raise invalid("the file does not contain Poptorch metadata (no "
                              f"{_MANIFEST}): it was not written by "
                              "PoplarExecutor.save() / compileAndExport()")
            if infos[_MANIFEST].file_size > MAX_MANIFEST_BYTES:
                raise invalid(f"{_MANIFEST} is {infos[_MANIFEST].file_size} bytes (at "
                              f"most {MAX_MANIFEST_BYTES})")
            manifest = json.loads(_read_capped(archive, infos[_MANIFEST],
                                               MAX_MANIFEST_BYTES))
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
                shown = manifest.get("format") if isinstance(manifest, dict) else manifest
                raise invalid(f"unknown format {shown!r} (expected {FORMAT!r})")
            version = manifest.get("format_version")
            if type(version) is not int or version != FORMAT_VERSION:
                raise invalid(f"format version {version!r} is not supported by this "
                              f"PopTorch (which reads version {FORMAT_VERSION}): export "
                              "the model again with this version")
            entries = manifest.get("blobs")
            if not isinstance(entries, dict) or not all(
                    isinstance(e, dict) and type(e.get("size")) is int and
                    isinstance(e.get("sha256"), str) for e in entries.values()):
                raise invalid(f"malformed {_MANIFEST} (expected blobs: {{name: "
                              "{sha256, size}}})")
            declared = sum(e["size"] for e in entries.values())
            if declared > file_size:
                raise invalid(f"the manifest declares {declared} bytes of blobs, more "
                              f"than the whole file ({file_size} bytes)")
            for name, entry in entries.items():
                if name not in infos:
                    raise invalid(f"blob {name} is missing (the file is truncated)")
                if infos[name].file_size != entry["size"]:
                    raise invalid(f"blob {name} is corrupted (size mismatch)")
            blobs = {}
            for name, entry in entries.items():
                data = _read_capped(archive, infos[name], entry["size"])
                if len(data) != entry["size"] or _sha256(data) != entry["sha256"]:
                    raise invalid(f"blob {name} is corrupted (checksum mismatch)")
                blobs[name] = data
            return blobs
    except Error:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError,
            KeyError, TypeError, RecursionError, NotImplementedError) as exc:
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
    value = DTYPES.get(name) if isinstance(name, str) else None
    if value is None:
        raise backend_error(f"Invalid file: {name!r} is not a torch dtype")
    return value


#: ``"float32"`` → ``torch.float32`` for every dtype of this torch.
DTYPES = {dtype_name(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


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


def _public_module(cls: type) -> str:
    """The module a file names ``cls`` by: ``poptorch.enums`` for the enums it
    re-exports from ``popart_compiler.enums``, else the class's own module."""
    if getattr(_enums, cls.__qualname__, None) is cls:
        return "poptorch.enums"
    return cls.__module__


def _encode_object(value: Any, where: str) -> Any:
    cls = type(value)
    module = _public_module(cls)
    if module not in _ALLOWED_MODULES:
        raise backend_error(
            f"Cannot export {where}: values of type {cls.__module__}.{cls.__qualname__} "
            "cannot be stored in an executable file (only numbers, strings, lists, "
            "dicts, dtypes and poptorch option / enum values can).")
    name = f"{module}:{cls.__qualname__}"
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
    if not isinstance(target, type) or _public_module(target) != module_name:
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
