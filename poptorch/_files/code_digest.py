"""A digest of the Python code a model runs, for the executable-cache key (docs/semantics.md S-61;
issue 19, item 8), computed from code objects: no source file is read, so models
defined in a notebook cell, with ``exec`` or with ``python -c`` are keyed like any other.

What goes in, for every class of the model (each sub-module's class and the classes it
inherits from, except ``torch``'s and ``poptorch``'s own, which the versions in the key
cover):

* every function, method, property and static / class method in the class body: its
  byte code, constants, names, argument layout and flags (not its file name or line
  numbers: moving code does not change the key), defaults and closure values;
* transitively, the user code those functions reach through their globals and closures:
  functions and classes of modules that are not installed packages (not in the standard
  library, ``site-packages`` or ``dist-packages``), also through a module attribute
  (``helpers.act``);
* the values of the plain globals and class attributes they read (numbers, strings and
  containers of them, read when the key is computed; tensors by their bytes; other
  objects by their type).

Not covered: code of installed packages other than ``torch`` / ``poptorch`` (upgrade
one → clear the cache), and behaviour that depends on state outside the code (files,
environment variables, attributes of other objects).
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import types
from typing import Any, Dict, Iterable, List, Set

import torch

__all__ = ["code_digest"]

_OWN = ("torch", "poptorch", "popart_compiler", "popdist", "builtins")
_LIBRARY_DIRS = tuple(os.path.realpath(p) for p in {
    sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if p)
_FUNCTIONS = (types.FunctionType, types.MethodType)
#: Upper bound on the functions and classes one digest follows (a guard against
#: walking a whole library by accident).
_MAX_OBJECTS = 5000


def _is_own(module: str) -> bool:
    return module.partition(".")[0] in _OWN


def _is_library_path(path: str) -> bool:
    path = os.path.realpath(path)
    if any(part in ("site-packages", "dist-packages") for part in path.split(os.sep)):
        return True
    return any(path.startswith(d + os.sep) for d in _LIBRARY_DIRS)


def _file_of(obj: Any) -> str:
    """Where ``obj``'s code comes from: a function's code file name (``<string>`` for
    ``exec``), a class's first method's, else its module's file ('' if none)."""
    code = getattr(getattr(obj, "__func__", obj), "__code__", None)
    if isinstance(obj, type):
        code = next((m.__code__ for m in vars(obj).values()
                     if isinstance(m, types.FunctionType)), None)
    if isinstance(code, types.CodeType):
        return code.co_filename
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    return getattr(module, "__file__", None) or ""


def _is_user_code(obj: Any) -> bool:
    """``obj`` (a function or class) is the user's: not ``torch`` / ``poptorch``, not
    from the standard library or an installed package."""
    module = getattr(obj, "__module__", "") or ""
    if _is_own(module) or module in sys.builtin_module_names:
        return False
    path = _file_of(obj)
    return not (os.path.isabs(path) and _is_library_path(path))


def _is_user_module(module: types.ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    return not _is_own(module.__name__) and not (path and _is_library_path(path))


class _Digest:
    def __init__(self):
        self.hash = hashlib.sha256()
        self.seen: Set[int] = set()
        self.pending: List[Any] = []

    def add(self, *parts: Any) -> None:
        for part in parts:
            self.hash.update(part if isinstance(part, bytes) else repr(part).encode())
            self.hash.update(b"\0")

    # -- values -------------------------------------------------------------------------
    def value(self, value: Any, depth: int = 0) -> Any:
        """A description of a global / default / closure value (queues user code)."""
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return value
        if isinstance(value, (tuple, list, set, frozenset)) and depth < 4 and \
                len(value) <= 1000:
            items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) \
                else value
            return (type(value).__name__, [self.value(v, depth + 1) for v in items])
        if isinstance(value, dict) and depth < 4 and len(value) <= 1000:
            return ("dict", sorted((repr(k), repr(self.value(v, depth + 1)))
                                   for k, v in value.items()))
        if isinstance(value, torch.dtype):
            return str(value)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            return f"{value.dtype}{list(value.shape)}:" + \
                hashlib.sha256(data.numpy().tobytes()).hexdigest()
        if isinstance(value, (type, *_FUNCTIONS)) and _is_user_code(value):
            self.pending.append(value)
            return f"<{value.__module__}.{getattr(value, '__qualname__', '')}>"
        return f"<{type(value).__module__}.{type(value).__qualname__}>"

    # -- code ---------------------------------------------------------------------------
    def code(self, code: types.CodeType, scope: Dict[str, Any]) -> None:
        self.add(code.co_code, code.co_names, code.co_varnames, code.co_freevars,
                 code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
                 code.co_kwonlyargcount, code.co_flags)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self.code(const, scope)
            else:
                self.add(self.value(const))
        for name in code.co_names:  # globals it reads, and module attributes
            if name in scope:
                target = scope[name]
                if isinstance(target, types.ModuleType):
                    if _is_user_module(target):
                        for attr in code.co_names:
                            self.add(name, attr, self.value(getattr(target, attr, None)))
                    continue
                self.add(name, self.value(target))

    def function(self, fn: Any) -> None:
        fn = getattr(fn, "__func__", fn)
        fn = getattr(fn, "__wrapped__", fn)
        code = getattr(fn, "__code__", None)
        if not isinstance(code, types.CodeType):
            self.add(self.value(fn))
            return
        self.add(getattr(fn, "__qualname__", ""))
        self.code(code, getattr(fn, "__globals__", {}))
        self.add([self.value(v) for v in (fn.__defaults__ or ())])
        self.add(sorted((k, repr(self.value(v))) for k, v in
                        (fn.__kwdefaults__ or {}).items()))
        for cell in fn.__closure__ or ():
            try:
                self.add(self.value(cell.cell_contents))
            except ValueError:  # an empty cell
                self.add("<empty>")

    def cls(self, cls: type) -> None:
        self.add(f"{cls.__module__}.{cls.__qualname__}")
        for name, member in sorted(vars(cls).items()):
            if name in ("__dict__", "__weakref__", "__module__", "__doc__"):
                continue
            self.add(name)
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, property):
                for accessor in (member.fget, member.fset, member.fdel):
                    if accessor is not None:
                        self.function(accessor)
            elif isinstance(member, types.FunctionType):
                self.function(member)
            else:
                self.add(self.value(member))

    def run(self) -> str:
        count = 0
        while self.pending:
            item = self.pending.pop()
            if id(item) in self.seen:
                continue
            self.seen.add(id(item))
            count += 1
            if count > _MAX_OBJECTS:
                self.add("<truncated>")
                break
            if isinstance(item, type):
                self.cls(item)
            else:
                self.function(item)
        return self.hash.hexdigest()


def code_digest(classes: Iterable[type], functions: Iterable[Any] = ()) -> str:
    """SHA-256 of the code of ``classes`` (and the user classes they inherit from) and
    of ``functions`` (e.g. forward hooks), with the user code they reach (see the
    module docstring)."""
    digest = _Digest()
    roots: List[Any] = []
    for cls in classes:
        roots.extend(c for c in cls.__mro__ if not _is_own(c.__module__)
                     and c is not object)
    for fn in functions:
        if not _is_own(getattr(fn, "__module__", "") or ""):
            roots.append(fn)
    for root in roots:  # the model's own classes always, wherever they are installed
        digest.pending.append(root)
    digest.pending.reverse()
    return digest.run()
