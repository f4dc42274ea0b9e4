"""Strict descriptions of the Python values a model's ``forward`` can read, for the
executable-cache key (issue 29, item 1).

:func:`Describer.value` turns a value into a JSON-able description that is equal for
two values exactly when a program captured with one is valid for the other, or raises
:class:`Unkeyable` when it cannot say (then the cache is not used for that model):

* ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``...``,
  ``range`` and ``slice``: by value (``2`` and ``2.0`` differ);
* ``list``, ``tuple``, ``dict``, ``OrderedDict``, ``set`` and ``frozenset`` (exactly those
  types): by their items, recursively;
* ``torch.dtype``, ``torch.device``, ``torch.Size``, ``torch.layout`` and
  ``torch.memory_format``; enum members (class, name and value);
* tensors: a weight of the model by its name (its value is uploaded at every run), any
  other strided tensor by dtype, shape, device type, ``requires_grad`` and the SHA-256
  of its bytes; a weak reference by what it refers to;
* a registered sub-module of the model by its path; a bound method by its object and
  function; ``functools.partial`` by function, arguments and keywords;
* user functions and classes by name, their code going into the code digest
  (:mod:`poptorch._files.code_digest`);
* functions, classes and modules of ``torch``, ``poptorch``, the standard library and
  installed packages by their qualified name, when that name resolves to the very same
  object in this process (``torch.relu``, ``torch.nn.functional.gelu``, ``math.pi``);
  a library's Python function without such a name (one a decorator wraps) by its code,
  closure and defaults;
* objects of library classes (``torch``, ``poptorch``, the standard library,
  installed packages) that keep their whole state in a plain ``__dict__`` (e.g.
  ``torch.no_grad()``, ``BeginBlock``'s hook, a ``transformers`` configuration) by class
  name and state (their class's code, like a library function's, is covered by the
  versions in the key, or not at all for other installed packages: clear the cache
  after upgrading one).

Everything else is unkeyable: any other object (``types.SimpleNamespace`` and other
objects of C classes, instances of user classes, a ``torch.nn.Module`` that is not a
registered sub-module, a ``poptorch.CPU`` host op), a library's builtin function
without a name, a user module held as a value, ``os.environ`` and the ``os`` functions
that read it, functions that read files (``open``, ``pathlib.Path``, ``torch.load``:
:func:`outside_state`), a tensor subclass, a sparse,
quantized or ``meta`` tensor, a container nested deeper than :data:`MAX_DEPTH` or larger than
:data:`MAX_ITEMS`, more than :data:`MAX_VALUES` values in all.
"""
from __future__ import annotations

import collections
import enum
import functools
import hashlib
import os
import sys
import types
import weakref
from typing import Any, Callable, Dict, Optional

import torch

__all__ = ["Unkeyable", "Describer", "MAX_DEPTH", "MAX_ITEMS", "MAX_VALUES", "library_name",
           "plain_object_class", "is_plain_data", "outside_state"]

#: Deepest container nesting described (deeper: unkeyable).
MAX_DEPTH = 8
#: Largest container described (larger: unkeyable).
MAX_ITEMS = 10000
#: Most values one key describes (more: unkeyable; bounds objects that refer to each
#: other many times over).
MAX_VALUES = 200000

_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis),
            type(NotImplemented))
_CONTAINERS = (list, tuple, dict, collections.OrderedDict, set, frozenset)
_TORCH_NAMED = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_MISSING = object()
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python


class Unkeyable(Exception):
    """A value the cache key cannot record.

    Attributes:
        where: where the value is (``Net.act``, ``Net.cfg['scale']``, ``global SCALE
            read by Net.forward``).
        what: what it is (``a function (mymod.<lambda>)``).
    """

    def __init__(self, where: str, what: str):
        super().__init__(f"{where} holds {what}")
        self.where = where
        self.what = what


def _root_module(name: str) -> str:
    return name.partition(".")[0]


def library_name(obj: Any) -> Optional[str]:
    """``module.qualname`` of a function, class or method descriptor when that name,
    looked up in ``sys.modules``, gives back ``obj`` itself (else ``None``)."""
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str):
        module = getattr(getattr(obj, "__objclass__", None), "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    root = sys.modules.get(module)
    if root is None:
        return None
    for path in dict.fromkeys((qualname, qualname.rpartition(".")[2])):
        target = root
        for part in path.split("."):
            target = getattr(target, part, _MISSING)
            if target is _MISSING:
                break
        if target is obj:
            return f"{module}.{path}"
    return None


def plain_object_class(value: Any, is_user_code: Callable[[Any], bool]) -> bool:
    """``value`` is an object of a library's Python class (``torch``, ``poptorch``, the
    standard library, an installed package: not the user's, named by a qualified name
    that resolves to it) whose whole state is its ``__dict__`` (no non-empty ``__slots__`` and
    no C-level class anywhere in its class hierarchy)."""
    cls = type(value)
    if is_user_code(cls) or library_name(cls) is None:
        return False
    if not isinstance(getattr(value, "__dict__", None), dict):
        return False
    if isinstance(value, (torch.nn.Module, torch.Tensor, type, types.ModuleType)):
        return False
    # every class a Python class (no C-level state) without __slots__
    return all(not vars(c).get("__slots__") and c.__flags__ & _HEAP_TYPE
               for c in cls.__mro__ if c is not object)


def is_plain_data(value: Any) -> bool:
    """``value`` is a scalar, a tensor or a container (not a function, class, module or
    other object)."""
    return type(value) in _SCALARS or type(value) in _CONTAINERS or \
        isinstance(value, (torch.Tensor, torch.Size, *_TORCH_NAMED, enum.Enum))


#: Library objects whose results depend on the process, not on anything the key
#: records: ``(module, attribute)`` and what :class:`Unkeyable` says of them.
_OUTSIDE_STATE = (
    (("os", "environ"), ("os", "environb"), ("os", "getenv"), ("os", "getenvb"),
     "the process environment (os.environ)"),
    (("builtins", "open"), ("io", "open"), ("io", "open_code"), ("io", "FileIO"),
     ("os", "open"), ("os", "read"), ("pathlib", "Path"), ("torch", "load"),
     ("numpy", "load"), ("numpy", "loadtxt"), ("numpy", "fromfile"),
     ("numpy", "genfromtxt"), "a function that reads files"),
)


def outside_state(value: Any) -> Optional[str]:
    """What ``value`` reads when it is ``os.environ``, a function of ``os`` that reads
    it, or a function or class that reads files (``open``, ``pathlib.Path``,
    ``torch.load``): state outside the program and the key, different between
    processes. ``None`` for any other value."""
    for *names, what in _OUTSIDE_STATE:
        for module, attr in names:
            found = sys.modules.get(module)
            if found is not None and value is getattr(found, attr, _MISSING):
                return what
    return None


def _what(value: Any) -> str:
    """How a message names ``value``'s kind."""
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        module = getattr(value, "__module__", None) or "?"
        return f"a function ({module}.{getattr(value, '__qualname__', '?')})"
    if isinstance(value, functools.partial):
        return "a functools.partial"
    if isinstance(value, types.ModuleType):
        return f"a module object ({value.__name__})"
    if isinstance(value, type):
        return f"a class ({value.__module__}.{value.__qualname__})"
    if isinstance(value, torch.nn.Module):
        return (f"a torch.nn.Module ({type(value).__qualname__}) that is not a registered "
                "sub-module")
    cls = type(value)
    name = f"{cls.__module__}.{cls.__qualname__}"
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name} object"


class Describer:
    """Describes values for one cache key.

    Args:
        queue_code: called with each user function or class met (its code goes into
            the code digest) and where it was found.
        is_user_code: whether a function or class is the user's (not a library's).
        is_user_module: whether a module object is the user's.
        weights: ``id(tensor) -> name`` of the model's parameters and buffers.
        submodules: ``id(module) -> path`` of the model's registered sub-modules.
    """

    def __init__(self, queue_code: Callable[[Any, str], None],
                 is_user_code: Callable[[Any], bool],
                 is_user_module: Callable[[types.ModuleType], bool],
                 weights: Optional[Dict[int, str]] = None,
                 submodules: Optional[Dict[int, str]] = None):
        self.queue_code = queue_code
        self.is_user_code = is_user_code
        self.is_user_module = is_user_module
        self.weights = weights or {}
        self.submodules = submodules or {}
        self.count = 0
        self.path: set = set()  # ids of the containers and objects being described

    def value(self, value: Any, where: str, depth: int = 0) -> Any:
        """The description of ``value`` (see the module docstring).

        Raises:
            Unkeyable: ``value`` (or something inside it) cannot be described.
        """
        self.count += 1
        if depth > MAX_DEPTH:
            raise Unkeyable(where, f"values nested deeper than {MAX_DEPTH}")
        if self.count > MAX_VALUES:
            raise Unkeyable(where, f"more than {MAX_VALUES} values, more than the key "
                                   "describes")
        kind = type(value)
        if kind in _SCALARS:
            return [kind.__name__, repr(value)]
        if kind in (range, slice):
            return [kind.__name__, repr(value)]
        if isinstance(value, torch.Size):
            return ["Size", list(value)]
        if kind in _CONTAINERS:
            return self._inside(value, where, self._container, value, where, depth)
        if isinstance(value, _TORCH_NAMED):
            return [kind.__name__, str(value)]
        if isinstance(value, enum.Enum):
            self.value(kind, where, depth + 1)
            return ["enum", f"{kind.__module__}.{kind.__qualname__}", value.name,
                    self.value(value.value, where, depth + 1)]
        if isinstance(value, torch.Tensor):
            return self._tensor(value, where)
        if kind is weakref.ref:
            target = value()
            return ["weakref", None if target is None else
                    self.value(target, where, depth + 1)]
        if isinstance(value, torch.nn.Module) and id(value) in self.submodules:
            return ["submodule", self.submodules[id(value)]]
        if kind is types.MethodType:
            return ["method", self.value(value.__self__, where, depth + 1),
                    self.value(value.__func__, where, depth + 1)]
        if kind is functools.partial:
            return ["partial", self.value(value.func, where, depth + 1),
                    self.value(value.args, where, depth + 1),
                    self.value(value.keywords, where, depth + 1)]
        return self._named(value, where, depth)

    def _inside(self, value: Any, where: str, fn: Callable, *args) -> Any:
        """``fn(*args)`` while ``value`` is being described: a value that contains
        itself is unkeyable."""
        if id(value) in self.path:
            raise Unkeyable(where, f"a {type(value).__name__} that contains itself")
        self.path.add(id(value))
        try:
            return fn(*args)
        finally:
            self.path.discard(id(value))

    def _container(self, value: Any, where: str, depth: int) -> Any:
        if depth >= MAX_DEPTH or len(value) > MAX_ITEMS:
            raise Unkeyable(where, f"a {type(value).__name__} nested deeper than "
                                   f"{MAX_DEPTH} or with more than {MAX_ITEMS} items")
        name = type(value).__name__
        if isinstance(value, dict):
            items = [[self.value(k, where, depth + 1),
                      self.value(v, f"{where}[{k!r}]", depth + 1)]
                     for k, v in value.items()]
            return [name, items]
        items = [self.value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        if isinstance(value, (set, frozenset)):
            items.sort(key=repr)
        return [name, items]

    def _tensor(self, value: torch.Tensor, where: str) -> Any:
        if id(value) in self.weights:
            return ["weight", self.weights[id(value)]]
        if type(value) not in (torch.Tensor, torch.nn.Parameter) or \
                value.layout != torch.strided or value.is_meta or value.is_quantized:
            raise Unkeyable(where, f"a {type(value).__name__} with layout {value.layout} "
                                   f"on device {value.device}")
        data = value.detach().resolve_conj().resolve_neg().cpu().contiguous()
        data = data.reshape(-1).view(torch.uint8)
        return ["tensor", str(value.dtype), list(value.shape), value.device.type,
                bool(value.requires_grad),
                hashlib.sha256(data.numpy().tobytes()).hexdigest()]

    def _named(self, value: Any, where: str, depth: int) -> Any:
        """Functions, classes, modules and plain torch / poptorch objects."""
        reads = outside_state(value)
        if reads is not None:
            raise Unkeyable(where, reads)
        if isinstance(value, types.ModuleType):
            if not self.is_user_module(value) and sys.modules.get(value.__name__) is value:
                return ["module", value.__name__]
            raise Unkeyable(where, _what(value))
        if isinstance(value, (type, types.FunctionType)) and self.is_user_code(value):
            self.queue_code(value, where)
            return ["code", getattr(value, "__module__", None),
                    getattr(value, "__qualname__", None)]
        if callable(value) or isinstance(value, type):
            name = None if self.is_user_code(value) else library_name(value)
            if name is not None:
                return ["library", name]
        if isinstance(value, types.FunctionType):  # a library's, without a name
            self.queue_code(value, where)  # its code, closure and defaults
            return ["code", value.__module__, value.__qualname__]
        if _root_module(type(value).__module__) == "poptorch" and \
                type(value).__name__ == "CPU":
            raise Unkeyable(where, "a poptorch.CPU host op, which a cache entry cannot "
                                   "hold")
        if plain_object_class(value, self.is_user_code):
            cls = type(value)
            state = self._inside(value, where, lambda: [
                [k, self.value(v, f"{where}.{k}", depth + 1)]
                for k, v in sorted(vars(value).items())])
            return ["object", f"{cls.__module__}.{cls.__qualname__}", state]
        raise Unkeyable(where, _what(value))
