"""Executable caching (docs/semantics.md S-61, S-28): ``Options.enableExecutableCaching(path)`` or
``POPTORCH_CACHE_DIR``.

A cache entry is the captured program in the executable file format
(:mod:`poptorch._files.container`), without weights: the executor always uploads the
host model's current weights, so an entry serves any weight values. Its file name is a
SHA-256 key computed **before** capturing (capture is the work the cache saves;
:mod:`poptorch._files.cache_key`) from:

* the format version, the ``poptorch``, ``torch`` and Python versions and a
  ``backend`` entry (execution backend and device, from the options);
* the model: for every sub-module its path, class, ``training`` flag, attribute values
  and hooks (``BeginBlock``'s included), torch's global module hooks, a digest of the
  code of every class involved and of the user code it reaches with the values that
  code reads (:mod:`poptorch._files.code_digest`: byte code, never source files, so
  classes defined in a notebook, ``exec`` or ``python -c`` are cached too); the name,
  kind, shape, dtype and ``requires_grad`` of every parameter and buffer, and which
  weights and sub-modules are shared;
* the training flag, torch's process-wide state (grad and inference mode, autocast, the
  default dtype and device, deterministic algorithms, backend flags), every option
  (except the cache path) and the replica grouping of weights;
* the input signature: argument names, structure, shapes, dtypes and non-tensor values.

Every value is recorded by value or by a name that resolves to the same library object
(:mod:`poptorch._files.cache_values`); one that cannot be recorded (an arbitrary object,
a ``types.SimpleNamespace``, a sub-module in a plain ``dict``, a ``poptorch.CPU`` op,
``os.environ``, a function that reads files)
turns the cache off for that compile with one INFO line naming it: the cache never
serves a program captured for other state (issue 29). Code of installed packages other
than ``torch`` / ``poptorch`` is not part of the key: clear the cache directory after
upgrading one.

An entry's ``metadata.json`` records its key: an entry whose key is not the compile's
(renamed, copied) is discarded with a warning and rebuilt. A program with
``poptorch.CPU`` host ops is never written (a file holds no Python code): one INFO line
per entry and process.

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

import json
import os
from typing import Any, Callable, Dict, Optional, Set

import torch
from filelock import FileLock, Timeout

from popart_compiler.errors import Error, backend_error

from poptorch._options import environment as config
from poptorch._executor import instrument as _instrument
from poptorch._files.cache_key import CacheRequest, cache_key
from poptorch._files.structure import encode_spec
from poptorch._logging import logger
from poptorch._files.program import (HOST_OPS_REASON, Program, from_blobs, host_ops,
                                     structure_of, to_blobs)
from poptorch._files.schema import Invalid, invalid_file
from poptorch._files.container import not_regular, read_container, write_container

__all__ = ["CacheRequest", "cache_directory", "cache_key", "obtain_program",
           "lock_timeout", "LOCK_TIMEOUT_ENV", "DEFAULT_LOCK_TIMEOUT_S"]

#: Environment variable: longest wait (seconds) for another process's cache-entry lock.
LOCK_TIMEOUT_ENV = "POPTORCH_CACHE_LOCK_TIMEOUT"
#: Wait for a cache-entry lock when :data:`LOCK_TIMEOUT_ENV` is not set (seconds).
DEFAULT_LOCK_TIMEOUT_S = float(config.VARIABLES[LOCK_TIMEOUT_ENV].default)


def cache_directory(options) -> Optional[str]:
    """The cache directory of ``options`` or ``None`` when caching is off."""
    popart = options._Popart.options
    if not popart.get("enableEngineCaching", False) or not popart.get("cachePath"):
        return None
    return str(popart["cachePath"])


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


def _load_entry(path: str, request: CacheRequest, key: str) -> Optional[Program]:
    """The program of the entry at ``path`` written for ``key``, or ``None`` when there
    is none or it is unusable (then it is deleted, with one warning)."""
    if not os.path.exists(path):
        return None
    try:
        blobs = read_container(path)
        meta = json.loads(blobs.get("metadata.json", b"null"))
        if not isinstance(meta, dict) or meta.get("kind") != "cache-entry":
            raise backend_error(f"Invalid file {path}: not an executable-cache entry")
        if meta.get("key") != key:
            raise backend_error(
                f"Invalid file {path}: it was written for the key {meta.get('key')!r}, not "
                f"for this compilation's key {key!r} (renamed or copied from another "
                "entry)")
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


#: Entries this process did not write because their program calls host ops (said once).
_NOT_WRITTEN: Set[str] = set()


def _write_entry(path: str, key: str, program: Program) -> None:
    ops = host_ops(program)
    if ops:
        if path not in _NOT_WRITTEN:
            _NOT_WRITTEN.add(path)
            logger.info("Executable cache not used for %s: the program calls the "
                        "poptorch.CPU host op(s) %s, and %s; it is captured at every "
                        "compile.", path, ", ".join(map(repr, ops)), HOST_OPS_REASON)
        return
    try:
        program.blobs = to_blobs(program)
        blobs = dict(program.blobs)
        blobs["metadata.json"] = json.dumps({"kind": "cache-entry", "key": key,
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
        program = _load_entry(path, request, key)
        if program is not None:
            return program
        program = capture()
        _write_entry(path, key, program)
        return program
    finally:
        lock.release()
