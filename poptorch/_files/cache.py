"""Executable caching (spec S-61, S-28): ``Options.enableExecutableCaching(path)`` or
``POPTORCH_CACHE_DIR``.

A cache entry is the captured program in the executable file format
(:mod:`poptorch._files.container`), without weights: the executor always uploads the
host model's current weights, so an entry serves any weight values. Its file name is a
SHA-256 key computed **before** capturing (capture is the work the cache saves) from:

* the format version, the ``poptorch``, ``torch`` and Python versions and a
  ``backend`` entry (execution backend and device, from the options);
* the model: for every sub-module its path, class, attribute values (numbers,
  strings, ... and the type of other objects; ``training``, ``Block`` ids included) and
  forward hooks (``BeginBlock``), the
  SHA-256 of the source file of every class involved, the name, kind, shape, dtype
  and ``requires_grad`` of every parameter and buffer, and the values of plain tensor
  attributes (they become constants of the program);
* the training flag, every option (except the cache path itself) and the replica
  grouping of weights;
* the input signature: argument names, structure, shapes, dtypes and non-tensor values.

Code the model calls outside those source files (helpers in other modules) is not
part of the key: clear the cache directory after editing such code. When a class's
source cannot be read (defined in an interactive session) nothing is cached.

Writes are atomic (temporary file + ``os.replace``); a lock file per entry
(``<entry>.lock``, an OS file lock released when a process dies) makes concurrent
processes of one run - e.g. the processes of a distributed run (S-28) - compile once:
the first captures and fills the entry, the others wait and load it. An entry that
cannot be read (corrupted, another format version) is ignored with a warning and
rebuilt. The directory is never pruned. Unlike the Poplar IPU Model, caching works on
our IPU Model.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional

import torch
from filelock import FileLock

from popart_compiler.errors import Error
from poptorch._executor import instrument
from poptorch._files.container import (FORMAT_VERSION, encode, read_container,
                                       write_container)
from poptorch._files.program import Program, encode_spec, from_blobs, to_blobs
from poptorch._logging import logger

__all__ = ["cache_directory", "cache_key", "obtain_program"]

#: Options that do not change the compiled program.
#: Options that do not change what is compiled: where the cache is, and which process of
#: a distributed run compiles (all processes of one run share one entry, S-28).
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


def _source_hash(cls: type, hashes: Dict[str, str]) -> bool:
    """Record the SHA-256 of the file defining ``cls``; False if unreadable."""
    if cls.__module__ in ("torch", "builtins") or cls.__module__.startswith("torch."):
        return True  # covered by the torch version
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        path = None
    if path is None or not os.path.isfile(path):
        return False
    if path not in hashes:
        with open(path, "rb") as f:
            hashes[path] = hashlib.sha256(f.read()).hexdigest()
    return True


def _tensor_hash(value: torch.Tensor) -> str:
    """Dtype, shape and SHA-256 of the bytes of a plain tensor attribute."""
    data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return f"{value.dtype}{list(value.shape)}:{hashlib.sha256(data.numpy()).hexdigest()}"


def _hook_description(hook: Any) -> Any:
    cls = type(hook)
    state = vars(hook) if hasattr(hook, "__dict__") else {}
    return [f"{cls.__module__}.{cls.__qualname__}",
            getattr(hook, "__qualname__", ""), {k: _simple(v) for k, v in state.items()}]


def _model_description(model: torch.nn.Module) -> Optional[Dict[str, Any]]:
    hashes: Dict[str, str] = {}
    modules = []
    with instrument.syncing():
        for path, module in model.named_modules(remove_duplicate=False):
            cls = instrument.original_class(module) if instrument.is_instrumented(
                module) else type(module)
            if not _source_hash(cls, hashes):
                logger.info("Executable cache not used: the source of %s.%s cannot be "
                            "read.", cls.__module__, cls.__qualname__)
                return None
            attrs = {k: _simple(v) for k, v in sorted(vars(module).items())
                     if not isinstance(v, torch.Tensor)}
            hooks = [_hook_description(h) for table in (
                module._forward_pre_hooks, module._forward_hooks)
                for h in table.values()]
            constants = {k: _tensor_hash(v) for k, v in sorted(vars(module).items())
                         if isinstance(v, torch.Tensor)
                         and not isinstance(v, torch.nn.Parameter)}
            modules.append([path, f"{cls.__module__}.{cls.__qualname__}", module.training,
                            attrs, hooks, constants])
        state = [[n, "p", list(t.shape), str(t.dtype), bool(t.requires_grad)]
                 for n, t in model.named_parameters(remove_duplicate=False)]
        state += [[n, "b", list(t.shape), str(t.dtype)]
                  for n, t in model.named_buffers(remove_duplicate=False)]
    return {"modules": modules, "sources": sorted(hashes.values()), "state": state}


def cache_key(model: torch.nn.Module, options: Any, training: bool,
              groupings: Dict[str, Any], spec, names: List[str], num_positional: int,
              device: str, backend: str, version: str) -> Optional[str]:
    """The cache key of compiling ``model`` (training or not, with these options and
    replica groupings, by PopTorch ``version``) for inputs of structure ``spec``
    bound to argument ``names``, or ``None`` when the model cannot be keyed
    (unreadable source, unencodable option or input)."""
    described = _model_description(model)
    if described is None:
        return None
    try:
        options = encode(options)
        inputs = encode_spec(spec, "the inputs")
        groupings = encode(dict(groupings))
    except Error as exc:
        logger.info("Executable cache not used: %s", exc.message)
        return None
    options = _drop_keys(options, _NOT_IN_KEY)
    parts = {
        "format_version": FORMAT_VERSION,
        "versions": [version, torch.__version__,
                     f"{sys.version_info[0]}.{sys.version_info[1]}"],
        "backend": {"name": backend, "device": device},
        "training": training,
        "model": described,
        "options": options,
        "replica_groupings": groupings,
        "inputs": [inputs, list(names), num_positional],
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


def _load_entry(path: str) -> Optional[Program]:
    if not os.path.exists(path):
        return None
    try:
        program = from_blobs(read_container(path))
    except Error as exc:
        logger.warning("Ignoring the unreadable executable cache entry %s (%s): it is "
                       "rebuilt.", path, exc.message)
        return None
    logger.info("Loaded the executable from the cache: %s", path)
    return program


def obtain_program(directory: Optional[str], key: Optional[str],
                   capture: Callable[[], Program]) -> Program:
    """The program for this compilation: from the cache entry ``key`` in ``directory``
    when present and readable, else ``capture()`` (which then fills the entry).

    Raises:
        Whatever ``capture()`` raises. Cache I/O failures only log a warning.
    """
    if directory is None or key is None:
        return capture()
    try:
        os.makedirs(directory, exist_ok=True)
        lock = FileLock(os.path.join(directory, key + ".poptorch.lock"))
        lock.acquire()
    except OSError as exc:
        logger.warning("Executable cache %s not usable (%s): compiling without it.",
                       directory, exc)
        return capture()
    try:
        path = os.path.join(directory, key + ".poptorch")
        program = _load_entry(path)
        if program is not None:
            return program
        program = capture()
        try:
            program.blobs = to_blobs(program)
            blobs = dict(program.blobs)
            blobs["metadata.json"] = json.dumps({"kind": "cache-entry",
                                                 "torch_version": torch.__version__}
                                                ).encode()
            write_container(path, blobs)
            logger.info("Wrote the executable to the cache: %s", path)
        except (Error, OSError) as exc:
            logger.warning("Could not write the executable cache entry %s: %s", path,
                           getattr(exc, "message", exc))
        return program
    finally:
        lock.release()
