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
* the values of the globals and class attributes they read, and of their defaults and
  closure cells, described by :mod:`poptorch._files.cache_values` when the key is
  computed (numbers, strings, containers of them and tensors by value; library
  functions, classes and modules by name; user code by its code). A value it cannot
  describe (an arbitrary object, a ``types.SimpleNamespace``) raises
  :class:`~poptorch._files.cache_values.Unkeyable`: the cache is then not used.

Reading ``os.environ`` (``os.getenv``) or a function that reads files (``open``,
``pathlib.Path``, ``torch.load``) is unkeyable
(:func:`~poptorch._files.cache_values.outside_state`). Not covered: code of installed
packages other than ``torch`` / ``poptorch`` (upgrade one → clear the cache), and state
user code reaches only through a library's code (a library function that reads a file).
"""
from __future__ import annotations

import builtins
import dis
import enum
import functools
import hashlib
import os
import sys
import sysconfig
import types
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from poptorch._files.cache_values import (Describer, Unkeyable, is_plain_data,
                                          outside_state)

__all__ = ["code_digest", "CodeDigest", "is_user_code"]

_OWN = ("torch", "poptorch", "popart_compiler", "popdist", "builtins")
_LIBRARY_DIRS = tuple(os.path.realpath(p) for p in {
    sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if p)
_BUILTINS = vars(builtins)
_MISSING = object()
#: Upper bound on the functions and classes one digest follows (a guard against
#: walking a whole library by accident; beyond it the model is not cached).
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
    ``exec``), a class's first method defined in its body's (not one it was given, as
    an ``enum.Enum`` subclass is given ``Enum.__new__``), else its module's file ('' if
    none)."""
    code = getattr(getattr(obj, "__func__", obj), "__code__", None)
    if isinstance(obj, type):
        own = obj.__qualname__ + "."
        code = next((m.__code__ for m in vars(obj).values()
                     if isinstance(m, types.FunctionType)
                     and m.__qualname__.startswith(own)), None)
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


def is_user_code(obj: Any) -> bool:
    """Public name of :func:`_is_user_code`."""
    return _is_user_code(obj)


def _is_user_module(module: types.ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    return not _is_own(module.__name__) and not (path and _is_library_path(path))


#: Dunder class attributes that hold no behaviour of ``forward`` (type annotations,
#: bookkeeping of ``abc``, ``typing`` and the compiler).
_SKIPPED_CLASS_ATTRIBUTES = frozenset({
    "__dict__", "__weakref__", "__module__", "__doc__", "__annotations__", "__qualname__",
    "__orig_bases__", "__parameters__", "__static_attributes__", "__firstlineno__",
    "__slots__", "__abstractmethods__", "_abc_impl", "__match_args__",
    "__dataclass_fields__", "__dataclass_params__", "__hash__", "__type_params__"})


#: Builtins that read variables by a name computed at run time, and attributes that reach
#: a frame's or a function's variables: code using them can read any global, which the
#: key cannot follow.
_DYNAMIC_GLOBALS = frozenset({"globals", "locals", "vars", "eval", "exec", "compile",
                              "__import__"})
_DYNAMIC_ATTRIBUTES = frozenset({"f_globals", "f_locals", "f_back", "f_builtins",
                                 "__globals__", "_getframe", "currentframe", "stack"})


def _reads_variables_by_name(code: types.CodeType) -> Optional[str]:
    """The name by which ``code`` reads variables chosen at run time (``globals()``,
    ``eval``, a frame's ``f_globals``), or ``None``."""
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in _DYNAMIC_GLOBALS:
            return f"{ins.argval}()"
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval in _DYNAMIC_ATTRIBUTES:
            return f".{ins.argval}"
    return None


class CodeDigest:
    """The digest of the user code a model reaches (see the module docstring).

    Args:
        weights: ``id(tensor) -> name`` of the model's parameters and buffers.
        submodules: ``id(module) -> path`` of the model's registered sub-modules.

    :meth:`value` describes one value (queueing the user code it holds);
    :meth:`run` digests everything queued.
    """

    def __init__(self, weights: Optional[Dict[int, str]] = None,
                 submodules: Optional[Dict[int, str]] = None):
        self.hash = hashlib.sha256()
        self.seen: Set[int] = set()
        self.pending: List[Tuple[Any, str, bool]] = []
        #: Inside the body of an installed package's class (see :meth:`cls`).
        self.library_state = False
        self.describer = Describer(self.queue, _is_user_code, _is_user_module,
                                   weights, submodules)

    def queue(self, item: Any, where: str) -> None:
        """Digest the code of ``item`` (a user function or class) found at ``where``."""
        if id(item) not in self.seen:
            self.pending.append((item, where, self.library_state))

    def add(self, *parts: Any) -> None:
        for part in parts:
            self.hash.update(part if isinstance(part, bytes) else repr(part).encode())
            self.hash.update(b"\0")

    def value(self, value: Any, where: str) -> Any:
        """See :meth:`Describer.value` (raises ``Unkeyable``)."""
        return self.describer.value(value, where)

    # -- code ---------------------------------------------------------------------------
    def code(self, code: types.CodeType, scope: Dict[str, Any], owner: str) -> None:
        dynamic = _reads_variables_by_name(code) if scope else None
        if dynamic is not None:
            raise Unkeyable(owner, f"code that reads variables by name at run time "
                                   f"({dynamic})")
        self.add(code.co_code, code.co_names, code.co_varnames, code.co_freevars,
                 code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
                 code.co_kwonlyargcount, code.co_flags)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self.code(const, scope, owner)
            else:
                self.add(self.value(const, f"a constant of {owner}"))
        for name in code.co_names:  # globals it reads, and module attributes
            where = f"the global {name} read by {owner}"
            if name not in scope:
                if scope and name in _BUILTINS:  # a builtin (or a value put there)
                    self.add(name, self.value(_BUILTINS[name], where))
                continue
            target = scope[name]
            if isinstance(target, types.ModuleType):
                self.module_attributes(name, target, code.co_names, where)
                continue
            self.add(name, self.value(target, where))

    def module_attributes(self, name: str, module: types.ModuleType, attrs, where: str,
                          seen: Optional[Set[int]] = None) -> None:
        """The module global ``name`` and the attributes ``attrs`` (names the code
        reads) of it: all of a user module's by value; of a library module, the plain
        data it holds (a value a user stored on it) and the names of its functions and
        classes (a function a user put in its place is seen), following its
        sub-modules (``torch.nn.functional.gelu``). ``os.environ`` and file readers
        are unkeyable (:func:`~poptorch._files.cache_values.outside_state`)."""
        seen = set() if seen is None else seen
        if id(module) in seen:
            return
        seen.add(id(module))
        self.add(name, "module", module.__name__)
        user = _is_user_module(module)
        for attr in attrs:
            value = vars(module).get(attr, _MISSING)  # no lazy imports
            if value is _MISSING:
                continue
            at = f"{where} ({name}.{attr})"
            if outside_state(value) is not None:
                raise Unkeyable(at, outside_state(value))
            if user:
                self.add(name, attr, self.value(value, at))
            elif isinstance(value, types.ModuleType) and not _is_user_module(value):
                self.module_attributes(f"{name}.{attr}", value, attrs, where, seen)
            else:
                self.add(name, attr, self.library_attribute(value, at))

    def library_attribute(self, value: Any, where: str) -> Any:
        """The description of ``value``, an attribute of a library module or class:
        plain data by value (``<library state>`` if it cannot be described); user code
        by its code; a library function or class by its module and qualified name (its
        code is the library's); a property or static / class method by its functions;
        an object of a user class as :meth:`value` does (unkeyable); any other object
        as ``<object>`` (the library's own state)."""
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            return [self.library_attribute(f, where)
                    for f in (value.fget, value.fset, value.fdel)]
        if outside_state(value) is not None:
            raise Unkeyable(where, outside_state(value))
        if is_plain_data(value) or isinstance(value, (functools.partial,
                                                      types.MethodType)):
            try:
                return self.value(value, where)
            except Unkeyable:
                return "<library state>"
        if isinstance(value, (type, types.FunctionType)) and _is_user_code(value):
            return self.value(value, where)
        if _is_user_code(type(value)):  # a library holds no objects of user classes
            return self.value(value, where)
        if callable(value):
            return ["library", getattr(value, "__module__", None),
                    getattr(value, "__qualname__", None)]
        return "<object>"

    def function(self, fn: Any, where: str) -> None:
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if not isinstance(code, types.CodeType):
            self.add(self.value(fn, where))
            return
        owner = getattr(fn, "__qualname__", "") or where
        self.add(owner)
        # a library function (e.g. a decorator's wrapper): its code and closure, not the
        # globals of its library, which the versions in the key cover
        scope = getattr(fn, "__globals__", {}) if _is_user_code(fn) else {}
        self.code(code, scope, owner)
        self.add(self.value(tuple(fn.__defaults__ or ()), f"the defaults of {owner}"))
        self.add(self.value(dict(fn.__kwdefaults__ or {}), f"the defaults of {owner}"))
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                self.add("<empty>")
                continue
            self.add(self.value(contents, f"the variable {name} of {owner}'s closure"))

    def cls(self, cls: type) -> None:
        self.add(f"{cls.__module__}.{cls.__qualname__}")
        user = _is_user_code(cls)
        members = cls.__members__ if issubclass(cls, enum.Enum) else {}
        for name, member in members.items():  # an enum's members by name and value
            self.add(name, self.value(member.value, f"{cls.__qualname__}.{name}"))
        for name, member in sorted(vars(cls).items()):
            if name in _SKIPPED_CLASS_ATTRIBUTES or name in members or members and not (
                    isinstance(member, types.FunctionType)
                    and member.__qualname__.startswith(cls.__qualname__ + ".")):
                continue  # an enum's machinery: only functions of its own body count
            self.add(name)
            self.tolerating(not user, self.member, cls, name, member)

    def tolerating(self, library_state: bool, fn, *args) -> None:
        """``fn(*args)``; with ``library_state`` (the body of an installed package's
        class, and the code it holds: what it made when it was defined is package state,
        which the key does not cover, like its code) an ``Unkeyable`` value is left out
        instead of raised."""
        if not library_state:
            fn(*args)
            return
        before, self.library_state = self.library_state, True
        try:
            fn(*args)
        except Unkeyable:
            self.add("<library state>")
        finally:
            self.library_state = before

    def member(self, cls: type, name: str, member: Any) -> None:
        """One attribute of a class body."""
        where = f"{cls.__qualname__}.{name}"
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property):
            for accessor in (member.fget, member.fset, member.fdel):
                if accessor is not None:
                    self.function(accessor, where)
        elif isinstance(member, types.FunctionType):
            self.function(member, where)
        else:
            self.add(self.value(member, where))

    def run(self) -> str:
        """Digest the queued code. Raises ``Unkeyable`` (see :meth:`value`)."""
        count = 0
        while self.pending:
            item, where, library_state = self.pending.pop()
            if id(item) in self.seen:
                continue
            self.seen.add(id(item))
            count += 1
            if count > _MAX_OBJECTS:
                raise Unkeyable(where, f"more than {_MAX_OBJECTS} functions and classes "
                                       "of user code, more than the key follows")
            if isinstance(item, type):
                self.tolerating(library_state, self.cls, item)
            else:
                self.tolerating(library_state, self.function, item, where)
        return self.hash.hexdigest()


def code_digest(classes: Iterable[type], functions: Iterable[Tuple[Any, str]] = (),
                digest: Optional[CodeDigest] = None) -> str:
    """SHA-256 of the code of ``classes`` (and the user classes they inherit from) and
    of ``functions`` (``(function, where)`` pairs, e.g. forward hooks), with the user
    code they reach (see the module docstring).

    Raises:
        Unkeyable: a value the code reads cannot be described.
    """
    digest = digest if digest is not None else CodeDigest()
    roots: List[Tuple[Any, str, bool]] = []
    for cls in classes:
        roots.extend((c, c.__qualname__, False) for c in cls.__mro__
                     if not _is_own(c.__module__) and c is not object)
    for fn, where in functions:
        if not _is_own(getattr(fn, "__module__", "") or ""):
            roots.append((fn, where, False))
    queued = list(digest.pending)
    digest.pending = list(reversed(roots)) + queued
    return digest.run()
