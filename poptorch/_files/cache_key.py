"""The executable-cache key (docs/semantics.md S-61; issue 29, item 1): a SHA-256 computed before
capture from everything the captured program can depend on, or ``None`` (the program
is then captured at every compile and never cached) when something the model's
``forward`` can read cannot be recorded. See :mod:`poptorch._files.cache` for what
goes in and :mod:`poptorch._files.cache_values` for which values can be recorded.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from typing import Any, Dict, List, Optional

import torch
from torch.nn.modules import module as _torch_module

from popart_compiler.errors import Error

from poptorch._executor import instrument as _instrument
from poptorch._files.cache_values import Unkeyable
from poptorch._files.code_digest import CodeDigest, code_digest, is_user_code
from poptorch._files.container import FORMAT_VERSION, encode
from poptorch._files.structure import encode_spec
from poptorch._logging import logger

__all__ = ["CacheRequest", "cache_key", "model_description"]


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


#: Options that do not change what is compiled: where the cache is, and which process of
#: a distributed run compiles (all processes of one run share one entry, docs/semantics.md S-28).
_NOT_IN_KEY = frozenset({"cachePath", "enableEngineCaching", "distributed_process_id"})

#: ``nn.Module`` attributes described elsewhere (weights, sub-modules, hooks) or that
#: cannot change ``forward`` (state-dict hooks, PopTorch's link to its executor).
_SKIPPED = frozenset({
    "_parameters", "_buffers", "_modules", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
    "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", _instrument._MODEL_KEY})

#: Hook tables of a module, with the flag tables that go with them.
_HOOKS = (("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)),
          ("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
          ("_backward_pre_hooks", ()), ("_backward_hooks", ()))

#: torch's global module hooks (they run for every module).
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                 "_global_backward_pre_hooks", "_global_backward_hooks",
                 "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs")


def _hooks(digest: CodeDigest, module: torch.nn.Module, where: str) -> List[Any]:
    """The hooks of ``module`` in order (ids of handles, which differ between processes,
    left out), with their flags."""
    state = vars(module)
    out = []
    for table, flags in _HOOKS:
        hooks = state.get(table) or {}
        out.append([[digest.value(h, f"{where} (a hook in {table})"),
                     [k in (state.get(f) or {}) for f in flags]] for k, h in hooks.items()])
    return out


def _global_hooks(digest: CodeDigest) -> List[Any]:
    out = []
    for name in _GLOBAL_HOOKS:
        table = getattr(_torch_module, name, None) or {}
        out.append([digest.value(v, f"torch's global module hook {name}")
                    for v in table.values()])
    return out


def model_description(model: torch.nn.Module) -> Dict[str, Any]:
    """What the key records of ``model``: for every sub-module its path, class,
    ``training`` flag, attribute values and hooks; the weights' names, shapes, dtypes
    and ``requires_grad``; torch's global module hooks; the digest of the user code.

    Raises:
        Unkeyable: a value ``forward`` can read cannot be recorded.
    """
    with _instrument.syncing():
        named = list(model.named_modules(remove_duplicate=False))
        parameters = list(model.named_parameters(remove_duplicate=False))
        buffers = list(model.named_buffers(remove_duplicate=False))
    weights = {id(t): n for n, t in parameters + buffers}
    submodules: Dict[int, str] = {}
    for path, module in named:
        submodules.setdefault(id(module), path)
    digest = CodeDigest(weights, submodules)
    classes: Dict[int, type] = {}
    modules = []
    root = _instrument.original_class(model) if _instrument.is_instrumented(model) \
        else type(model)
    for path, module in named:
        cls = _instrument.original_class(module) if _instrument.is_instrumented(
            module) else type(module)
        classes.setdefault(id(cls), cls)
        where = root.__qualname__ + (f".{path}" if path else "")
        hooks = _hooks(digest, module, where)
        attrs = [[k, digest.value(v, f"{where}.{k}")] for k, v in sorted(vars(module).items())
                 if k not in _SKIPPED and not any(k == t for t, _ in _HOOKS)]
        modules.append([path, f"{cls.__module__}.{cls.__qualname__}", attrs, hooks])
    state = [[n, "p", list(t.shape), str(t.dtype), bool(t.requires_grad)]
             for n, t in parameters]
    state += [[n, "b", list(t.shape), str(t.dtype)] for n, t in buffers]
    global_hooks = _global_hooks(digest)
    return {"modules": modules, "state": state, "global_hooks": global_hooks,
            "aliases": [_aliases(parameters + buffers), _aliases(named)],
            "library_classes": _library_class_data(digest, classes.values()),
            "code": code_digest(classes.values(), (), digest)}


def _library_class_data(digest: CodeDigest, classes) -> List[Any]:
    """What the bodies of the library classes the model's classes derive from hold,
    as :meth:`CodeDigest.library_attribute` describes it: a value or function a user
    put there (``torch.nn.Linear.factor = 3``, ``torch.nn.Linear.act = ...``, read as
    ``self.factor``) changes the key; user classes are in the code digest."""
    out = []
    seen = set()
    for cls in classes:
        for base in cls.__mro__:
            if base is object or id(base) in seen or is_user_code(base):
                continue
            seen.add(id(base))
            data = [[name, digest.library_attribute(value, f"{base.__qualname__}.{name}")]
                    for name, value in sorted(vars(base).items())
                    if not name.startswith("__")]
            out.append([f"{base.__module__}.{base.__qualname__}", data])
    return out


def _aliases(named) -> List[List[str]]:
    """``[name, first name]`` for every entry of ``named`` (``(name, object)`` pairs, all
    duplicates kept) whose object came earlier under another name: tied weights and
    shared sub-modules, which a program captured with separate ones would not share."""
    first: Dict[int, str] = {}
    out = []
    for name, obj in named:
        if id(obj) in first:
            out.append([name, first[id(obj)]])
        else:
            first[id(obj)] = name
    return out


def _torch_state() -> Dict[str, Any]:
    """torch's process-wide settings that code can read or that change what a capture
    gives: grad and inference mode, autocast, the default dtype and device,
    deterministic algorithms, backend flags."""
    backends = torch.backends
    return {
        "grad": [torch.is_grad_enabled(), torch.is_inference_mode_enabled()],
        "autocast": [[torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))]
                     for d in ("cpu", "cuda")],
        "default_dtype": str(torch.get_default_dtype()),
        "default_device": str(torch.get_default_device()),
        "deterministic": [torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()],
        "matmul_precision": torch.get_float32_matmul_precision(),
        "backends": [bool(getattr(getattr(backends, b, None), "enabled", False))
                     for b in ("mkldnn", "cudnn")],
    }


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


def cache_key(request: CacheRequest) -> Optional[str]:
    """The cache key of ``request`` (64 hexadecimal digits), or ``None`` with one INFO
    line saying why when the model holds or reads a value the key cannot record
    (:class:`~poptorch._files.cache_values.Unkeyable`) or the inputs or options cannot
    be encoded (a custom-parser argument, a non-JSON constant)."""
    try:
        described = model_description(request.model)
    except Unkeyable as exc:
        logger.info("Executable cache not used: %s holds %s, which the cache key cannot "
                    "record, so the program is captured at every compile.", exc.where,
                    exc.what)
        return None
    except Exception as exc:  # noqa: BLE001 - a value that fails to describe itself
        logger.info("Executable cache not used: describing the model for the cache key "
                    "failed (%s: %s), so the program is captured at every compile.",
                    type(exc).__name__, exc)
        return None
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
        "torch_state": _torch_state(),
        "model": described,
        "options": options,
        "replica_groupings": groupings,
        "inputs": [inputs, list(request.names), request.num_positional],
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
