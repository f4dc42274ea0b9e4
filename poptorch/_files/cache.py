"""Executable caching (docs/semantics.md S-61, S-28): ``Options.enableExecutableCaching(path)`` or
``POPTORCH_CACHE_DIR``.

A cache entry is the captured program in the executable file format
(:mod:`poptorch._serialization`), without weights: the executor always uploads the
host model's current weights, so an entry serves any weight values. Its file name is a
SHA-256 key computed **before** capturing (capture is the work the cache saves) from:

* the format version, the ``poptorch``, ``torch`` and Python versions and a
  ``backend`` entry (execution backend and device, from the options);
* the model: for every sub-module its path, class, attribute values (numbers,
  strings, ... and the type of other objects; ``training``, ``Block`` ids included) and
  forward hooks (``BeginBlock``); a digest of the code of every class involved and of
  the user code it reaches (:mod:`poptorch._code_digest`: byte code, never source
  files, so classes defined in a notebook, ``exec`` or ``python -c`` are cached
  too); the name, kind, shape, dtype and ``requires_grad`` of every parameter and
  buffer, and the values of plain tensor attributes (they become constants of the
  program);
* the training flag, every option (except the cache path) and the replica grouping of
  weights;
* the input signature: argument names, structure, shapes, dtypes and non-tensor values.

Code of installed packages other than ``torch`` / ``poptorch`` is not part of the key:
clear the cache directory after upgrading one.

Writes are atomic (temporary file + ``os.replace``); a lock file per entry
(``<entry>.lock``, an OS file lock that the system releases when its process dies, so
a dead process's lock is taken over at once) makes concurrent processes of one run -
e.g. the processes of a distributed run (docs/semantics.md S-28) - compile once: the first captures
and fills the entry, the others wait and load it. A process waits for a lock at most
``POPTORCH_CACHE_LOCK_TIMEOUT`` seconds (default :data:`DEFAULT_LOCK_TIMEOUT_S`), logging at INFO
which entry it waits for; after that it compiles without the cache and says so in a warning. An
entry that cannot be read, is malformed in any way or does not fit the model (its weights, inputs)
gives one warning ("Invalid file <entry>: <what is wrong>"), is deleted and rebuilt: a bad entry
never makes a compile fail. An entry path that is not a regular file (a directory, symbolic link,
FIFO, device) is
never read, deleted or replaced: one warning, and the executable is compiled without
the cache. The directory is never pruned. Unlike the Poplar
IPU Model, caching works on our IPU Model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional

import torch
from filelock import FileLock, Timeout

from popart_compiler.errors import Error, backend_error

from poptorch import _config as config
from poptorch._executor import instrument as _instrument
from poptorch._files.code_digest import code_digest
from poptorch._files.structure import encode_spec
from poptorch._logging import logger
from poptorch._files.program import Program, from_blobs, structure_of, to_blobs
from poptorch._files.schema import Invalid, invalid_file
from poptorch._files.container import (FORMAT_VERSION, encode, not_regular, read_container,
                                       write_container)

__all__ = ["CacheRequest", "cache_directory", "cache_key", "obtain_program",
           "lock_timeout", "LOCK_TIMEOUT_ENV", "DEFAULT_LOCK_TIMEOUT_S"]

#: Environment variable: longest wait (seconds) for another process's cache-entry lock.
LOCK_TIMEOUT_ENV = "POPTORCH_CACHE_LOCK_TIMEOUT"
#: Wait for a cache-entry lock when :data:`LOCK_TIMEOUT_ENV` is not set (seconds).
DEFAULT_LOCK_TIMEOUT_S = float(config.VARIABLES[LOCK_TIMEOUT_ENV].default)


@dataclasses.dataclass
class CacheRequest:
    """One compilation as the executable cache sees it.

    Attributes:
        model: the module captured (its structure, code and weights make the key; an
            entry's weights must match its parameters and buffers).
        options: the executor's ``Options``.
        training: a training compilation.
        groupings: replica groupings of weights (docs/semantics.md S-27), by parameter name.
        spec: the structure of the bound call arguments.
        names: the bound argument names.
        num_positional: how many were passed positionally.
        device: the torch device the kernels run on.
        backend: the compiler backend (``eager`` / ``inductor`` / ``auto``).
        version: the PopTorch version.
    """
    model: torch.nn.Module
    options: Any
    training: bool
    groupings: Dict[str, Any]
    spec: Any
    names: List[str]
    num_positional: int
    device: str
    backend: str
    version: str

#: Options that do not change the compiled program.
#: Options that do not change what is compiled: where the cache is, and which process of
#: a distributed run compiles (all processes of one run share one entry, docs/semantics.md S-28).
_NOT_IN_KEY = frozenset({"cachePath", "enableEngineCaching", "distributed_process_id"})


def cache_directory(options) -> Optional[str]:
    """The cache directory of ``options`` or ``None`` when caching is off."""
    popart = options._Popart.options
    if not popart.get("enableEngineCaching", False) or not popart.get("cachePath"):
        return None
    return str(popart["cachePath"])


def _simple(value: Any) -> Any:
    """A JSON-able description of an attribute value for the key."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_simple(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _tensor_hash(value: torch.Tensor) -> str:
    """Dtype, shape and SHA-256 of the bytes of a plain tensor attribute."""
    data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return f"{value.dtype}{list(value.shape)}:{hashlib.sha256(data.numpy()).hexdigest()}"


def _hook_description(hook: Any) -> Any:
    cls = type(hook)
    state = vars(hook) if hasattr(hook, "__dict__") else {}
    return [f"{cls.__module__}.{cls.__qualname__}",
            getattr(hook, "__qualname__", ""), {k: _simple(v) for k, v in state.items()}]


def _model_description(model: torch.nn.Module) -> Dict[str, Any]:
    classes: Dict[int, type] = {}
    hook_functions: List[Any] = []
    modules = []
    with _instrument.syncing():
        for path, module in model.named_modules(remove_duplicate=False):
            cls = _instrument.original_class(module) if _instrument.is_instrumented(
                module) else type(module)
            classes.setdefault(id(cls), cls)
            attrs = {k: _simple(v) for k, v in sorted(vars(module).items())
                     if not isinstance(v, torch.Tensor)}
            tables = (module._forward_pre_hooks, module._forward_hooks)
            hooks = [_hook_description(h) for table in tables for h in table.values()]
            hook_functions.extend(h for table in tables for h in table.values())
            constants = {k: _tensor_hash(v) for k, v in sorted(vars(module).items())
                         if isinstance(v, torch.Tensor)
                         and not isinstance(v, torch.nn.Parameter)}
            modules.append([path, f"{cls.__module__}.{cls.__qualname__}", module.training,
                            attrs, hooks, constants])
        state = [[n, "p", list(t.shape), str(t.dtype), bool(t.requires_grad)]
                 for n, t in model.named_parameters(remove_duplicate=False)]
        state += [[n, "b", list(t.shape), str(t.dtype)]
                  for n, t in model.named_buffers(remove_duplicate=False)]
    return {"modules": modules, "state": state,
            "code": code_digest(classes.values(), hook_functions)}


def cache_key(request: CacheRequest) -> Optional[str]:
    """The cache key of ``request``, or ``None`` when the inputs or options cannot be
    encoded (a custom-parser argument, a non-JSON constant)."""
    described = _model_description(request.model)
    try:
        options = encode(request.options)
        inputs = encode_spec(request.spec, "the inputs")
        groupings = encode(dict(request.groupings))
    except Error as exc:
        logger.info("Executable cache not used: %s", exc.message)
        return None
    options = _drop_keys(options, _NOT_IN_KEY)
    parts = {
        "format_version": FORMAT_VERSION,
        "versions": [request.version, torch.__version__,
                     f"{sys.version_info[0]}.{sys.version_info[1]}"],
        "backend": {"name": request.backend, "device": request.device},
        "training": request.training,
        "model": described,
        "options": options,
        "replica_groupings": groupings,
        "inputs": [inputs, list(request.names), request.num_positional],
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _drop_keys(value: Any, keys) -> Any:
    """``value`` without dict entries (tagged or plain) whose key is in ``keys``."""
    if isinstance(value, list):
        return [_drop_keys(v, keys) for v in value]
    if not isinstance(value, dict):
        return value
    if "__dict__" in value:
        return {"__dict__": [[k, _drop_keys(v, keys)] for k, v in value["__dict__"]
                             if not (isinstance(k, str) and k in keys)]}
    return {k: _drop_keys(v, keys) for k, v in value.items()}


def lock_timeout() -> float:
    """``POPTORCH_CACHE_LOCK_TIMEOUT`` in seconds (default 300; 0 = do not wait).

    Raises:
        poptorch.Error: the variable is not a number >= 0.
    """
    text = config.text(LOCK_TIMEOUT_ENV)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise backend_error(f"{LOCK_TIMEOUT_ENV}={text!r} is not a valid timeout: give a "
                            "number of seconds >= 0.")
    return seconds


def _entry_fits(request: CacheRequest, structure: Dict[str, Any]) -> Optional[str]:
    """Why the checked entry does not fit this compilation, or ``None``."""
    with _instrument.syncing():
        host = dict(request.model.named_parameters(remove_duplicate=False))
        host.update(request.model.named_buffers(remove_duplicate=False))
    for entry in structure["state"]:
        tensor = host.get(entry["name"])
        if tensor is None or entry["name"] not in request.groupings and (
                list(tensor.shape) != entry["shape"] or
                str(tensor.dtype).rpartition(".")[2] != entry["dtype"]):
            return f"weight {entry['name']} does not match the model"
    if structure["inputs"] != encode_spec(request.spec, "the inputs") or \
            structure["input_names"] != list(request.names) or \
            structure["num_positional"] != request.num_positional:
        return "its inputs do not match this call"
    return None


def _load_entry(path: str, request: CacheRequest) -> Optional[Program]:
    """The program of the entry at ``path``, or ``None`` when there is none or it is
    unusable (then it is deleted, with one warning)."""
    if not os.path.exists(path):
        return None
    try:
        blobs = read_container(path)
        meta = json.loads(blobs.get("metadata.json", b"null"))
        if not isinstance(meta, dict) or meta.get("kind") != "cache-entry":
            raise backend_error(f"Invalid file {path}: not an executable-cache entry")
        structure = structure_of(blobs)
        reason = _entry_fits(request, structure)
        if reason is not None:
            raise backend_error(f"Invalid file {path}: {reason}")
        program = from_blobs(blobs, path)
    except Exception as exc:  # noqa: BLE001 - whatever is wrong, the entry is rebuilt
        message = exc.message if isinstance(exc, Error) else invalid_file(
            path, exc if isinstance(exc, Invalid) else
            f"{type(exc).__name__}: {exc}").message
        logger.warning("Discarding the unusable executable cache entry %s (%s): it is "
                       "rebuilt.", path, message)
        try:
            os.unlink(path)  # a regular file (obtain_program leaves anything else)
        except OSError as unlink_error:
            logger.debug("Could not delete %s: %s", path, unlink_error)
        return None
    logger.info("Loaded the executable from the cache: %s", path)
    return program


def _write_entry(path: str, program: Program) -> None:
    try:
        program.blobs = to_blobs(program)
        blobs = dict(program.blobs)
        blobs["metadata.json"] = json.dumps({"kind": "cache-entry",
                                             "torch_version": torch.__version__}
                                            ).encode()
        write_container(path, blobs)
        logger.info("Wrote the executable to the cache: %s", path)
    except Exception as exc:  # noqa: BLE001 - a program that cannot be stored
        logger.warning("Could not write the executable cache entry %s: %s", path,
                       getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}")


def obtain_program(request: CacheRequest, capture: Callable[[], Program]) -> Program:
    """The program for ``request``: from its cache entry when caching is on and the
    entry is present and usable, else ``capture()`` (which then fills the entry).

    Waits at most :func:`lock_timeout` seconds for another process holding the entry's
    lock, then captures without the cache (warning).

    Raises:
        Whatever ``capture()`` raises. Cache I/O failures and unusable entries only log
        a warning.
    """
    directory = cache_directory(request.options)
    key = cache_key(request) if directory is not None else None
    if directory is None or key is None:
        return capture()
    path = os.path.join(directory, key + ".poptorch")
    timeout = lock_timeout()
    try:
        os.makedirs(directory, exist_ok=True)
        lock = FileLock(path + ".lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.info("Waiting (at most %.0f s, %s) for another process that holds the "
                        "lock of the executable cache entry %s", timeout,
                        LOCK_TIMEOUT_ENV, path)
            lock.acquire(timeout=timeout)
    except Timeout:
        logger.warning("The executable cache entry %s stayed locked by another process "
                       "for %.0f s (%s): compiling without the cache.", path, timeout,
                       LOCK_TIMEOUT_ENV)
        return capture()
    except OSError as exc:
        logger.warning("Executable cache %s not usable (%s): compiling without it.",
                       directory, exc)
        return capture()
    try:
        what = not_regular(path)
        if what is not None:
            logger.warning("The executable cache entry %s is %s, which the cache never "
                           "reads, deletes or replaces: compiling without the cache "
                           "(remove it to cache this executable again).", path, what)
            return capture()
        program = _load_entry(path, request)
        if program is not None:
            return program
        program = capture()
        _write_entry(path, program)
        return program
    finally:
        lock.release()
