"""Instrumentation of a model wrapped by ``trainingModel`` (docs/api-sections.md api §6,
docs/semantics.md S-31).

The model's class becomes a generated subclass ``Poptorch<Name>``; parameters and
buffers become subclasses whose ``__torch_function__`` first pulls trained weights from
the device when the host copy is stale. Anything that reads them (attribute access,
``state_dict()``, ``torch.equal``, running the module on the CPU, printing, pickling)
therefore sees the device's latest values.
"""
from __future__ import annotations

import collections
import contextlib
import copyreg
import threading
import weakref
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from popart_compiler.errors import py_error

__all__ = ["HostWeights", "instrument", "uninstrument", "is_instrumented", "suspended",
           "syncing", "original_class", "executor_of", "host_weights_of", "forget",
           "WRAPPER_TYPES", "restore_tensor"]


class HostWeights:
    """The host's view of the weights a training executor holds on the device
    (docs/semantics.md S-31): shared by the executor and the instrumentation of its model.

    Attributes:
        stale: a run moved the device ahead of the host copy.
        version: bumped at each device → host copy.
        uploaded: which executor's host copy, and which version of it, was last
            uploaded by the owner (inference wrappers pick up a trainer's weights).

    Args:
        owner: the executor (held weakly: dropping it frees it).
        pull: the owner's implicit device → host copy (called while ``stale``).
    """

    def __init__(self, owner: Any, pull: Callable[[], None]):
        self._owner = weakref.ref(owner)
        self._pull = weakref.WeakMethod(pull)
        self.stale = False
        self.version = 0
        self.uploaded: Optional[Tuple[Any, int]] = None

    @property
    def owner(self) -> Any:
        """The executor, or ``None`` once it is gone."""
        return self._owner()

    def pull_if_stale(self) -> None:
        """Copy the device's weights to the host if the host copy is stale."""
        pull = self._pull()
        if self.stale and pull is not None:
            with syncing():
                pull()

#: Per thread: how many :func:`syncing` blocks the thread is inside. Another
#: thread's reads still sync while one thread copies weights.
_guard = threading.local()


def _syncing_now() -> bool:
    return getattr(_guard, "depth", 0) > 0


@contextlib.contextmanager
def syncing() -> Iterator[None]:
    """Reads and writes of instrumented tensors inside (in this thread) do not trigger
    a sync."""
    _guard.depth = getattr(_guard, "depth", 0) + 1
    try:
        yield
    finally:
        _guard.depth -= 1


def _sync(args) -> None:
    if _syncing_now():
        return
    for a in args:
        ref = getattr(a, "_poptorch_host", None) if isinstance(a, torch.Tensor) else None
        if ref is not None:
            host = ref()
            if host is not None:
                host.pull_if_stale()
            return


def _plain(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach()


def _synced_torch_function(cls, func, types, args=(), kwargs=None):
    """``__torch_function__`` of instrumented tensors: sync, then run ``func`` on plain
    tensors."""
    _sync(args)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


class _InstrumentedParameter(torch.nn.Parameter):
    """A parameter of a model wrapped for training on the device."""

    __torch_function__ = classmethod(_synced_torch_function)

    def __reduce_ex__(self, protocol):
        _sync((self,))
        data = _plain(self)
        return (torch._utils._rebuild_parameter,
                (data, self.requires_grad, collections.OrderedDict()))

    def __deepcopy__(self, memo):
        _sync((self,))
        result = torch.nn.Parameter(_plain(self).clone(), self.requires_grad)
        memo[id(self)] = result
        return result

    def __repr__(self, **kwargs):
        _sync((self,))
        return torch.nn.Parameter.__repr__(torch.nn.Parameter(_plain(self),
                                                              self.requires_grad))


class _InstrumentedBuffer(torch.Tensor):
    """A buffer of a model wrapped for training on the device."""

    __torch_function__ = classmethod(_synced_torch_function)

    def __reduce_ex__(self, protocol):
        _sync((self,))
        return _plain(self).clone().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        _sync((self,))
        result = _plain(self).clone()
        memo[id(self)] = result
        return result

    def __repr__(self, **kwargs):
        _sync((self,))
        return repr(_plain(self))


_CLASSES: dict = {}


def original_class(model: torch.nn.Module) -> type:
    """The user's class of a possibly instrumented model."""
    return getattr(type(model), "_poptorch_original_class", type(model))


def is_instrumented(model: torch.nn.Module) -> bool:
    return "_poptorch_original_class" in vars(type(model))


def _make_class(cls: type) -> type:
    if cls in _CLASSES:
        return _CLASSES[cls]

    def pull_if_stale(self) -> None:
        host = _host_of(self)
        if host is not None:
            host.pull_if_stale()

    def __getattribute__(self, name: str):
        if name in ("_parameters", "_buffers", "forward") and not _syncing_now():
            pull_if_stale(self)
        return cls.__getattribute__(self, name)

    def state_dict(self, *args, **kwargs):
        pull_if_stale(self)
        with syncing():
            result = cls.state_dict(self, *args, **kwargs)
        copies: dict = {}
        for key, value in list(result.items()):
            if isinstance(value, torch.Tensor):
                if id(value) not in copies:
                    copies[id(value)] = _plain(value) if not isinstance(
                        value, torch.nn.Parameter) else torch.nn.Parameter(
                            _plain(value), value.requires_grad)
                result[key] = copies[id(value)]
        return result

    def copyWeightsToHostIfNeeded(self) -> bool:
        """Pull trained weights from the device if the host copy is stale."""
        executor = executor_of(self)
        return executor.copyWeightsToHostIfNeeded() if executor is not None else False

    def destroy(self) -> None:
        """Destroy the training executor wrapping this model (if still alive)."""
        executor = executor_of(self)
        if executor is not None:
            executor.destroy()

    def _host_weights_version_get(self) -> int:
        host = _host_of(self)
        return host.version if host is not None else 0

    def __reduce_ex__(self, protocol):
        pull_if_stale(self)
        state = {k: v for k, v in self.__dict__.items() if k != _MODEL_KEY}
        return (copyreg._reconstructor, (cls, object, None), state)

    namespace = {
        "__getattribute__": __getattribute__,
        "state_dict": state_dict,
        "copyWeightsToHostIfNeeded": copyWeightsToHostIfNeeded,
        "destroy": destroy,
        "_host_weights_version": property(_host_weights_version_get),
        "__reduce_ex__": __reduce_ex__,
        "_poptorch_original_class": cls,
        "__module__": cls.__module__,
        "__qualname__": f"Poptorch{cls.__qualname__}",
    }
    new_cls = type(f"Poptorch{cls.__name__}", (cls,), namespace)
    _CLASSES[cls] = new_cls
    return new_cls


def _tensors(model: torch.nn.Module) -> List[Tuple[torch.Tensor, bool]]:
    seen, out = set(), []
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for t in table.values():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append((t, is_param))
    return out


#: Key of the model's ``__dict__`` holding a weak reference to its :class:`HostWeights`.
_MODEL_KEY = "_poptorch_host_ref"


def _host_of(model: torch.nn.Module) -> Optional[HostWeights]:
    ref = model.__dict__.get(_MODEL_KEY)
    return ref() if ref is not None else None


def host_weights_of(model: torch.nn.Module) -> Optional[HostWeights]:
    """The :class:`HostWeights` of an instrumented model's executor, or ``None``."""
    return _host_of(model)


def executor_of(model: torch.nn.Module) -> Any:
    """The live training executor that instrumented ``model``, or ``None``."""
    host = _host_of(model)
    return host.owner if host is not None else None


def forget(model: torch.nn.Module) -> None:
    """Drop the link to an executor from a model's ``__dict__`` (a shallow copy of an
    instrumented model shares it)."""
    model.__dict__.pop(_MODEL_KEY, None)


def instrument(model: torch.nn.Module, host: HostWeights) -> None:
    """Instrument ``model`` for lazy device → host weight copies through ``host``
    (held weakly).

    Raises:
        poptorch.Error: a buffer is not an exact ``torch.Tensor``.
    """
    with syncing():
        for t, is_param in _tensors(model):
            if not is_param and type(t) not in (torch.Tensor, _InstrumentedBuffer):
                raise py_error("All buffers must be an instance of torch.Tensor "
                               f"(Got {type(t)})")
        ref = weakref.ref(host)
        for t, is_param in _tensors(model):
            t.__class__ = _InstrumentedParameter if is_param else _InstrumentedBuffer
            t._poptorch_host = ref
        if not is_instrumented(model):
            model.__class__ = _make_class(type(model))
        model.__dict__[_MODEL_KEY] = ref


def uninstrument(model: torch.nn.Module) -> None:
    """Restore the model's original class and plain parameters / buffers.

    Raises:
        poptorch.Error: "model was never wrapped" if it is not instrumented.
    """
    if not is_instrumented(model):
        raise py_error("model was never wrapped")
    with syncing():
        model.__class__ = original_class(model)
        forget(model)
        for t, is_param in _tensors(model):
            restore_tensor(t, is_param)


#: The classes of instrumented (PopTorch: "wrapped") parameters and buffers.
WRAPPER_TYPES = (_InstrumentedParameter, _InstrumentedBuffer)


def restore_tensor(t: torch.Tensor, is_param: bool) -> None:
    """Make an instrumented parameter / buffer plain again (in place)."""
    if type(t) in WRAPPER_TYPES:
        t.__class__ = torch.nn.Parameter if is_param else torch.Tensor
    t.__dict__.pop("_poptorch_host", None)


@contextlib.contextmanager
def suspended(model: torch.nn.Module) -> Iterator[None]:
    """Plain classes for the parameters and buffers while inside (used by capture)."""
    swapped = []
    with syncing():
        for t, is_param in _tensors(model):
            if type(t) in (_InstrumentedParameter, _InstrumentedBuffer):
                swapped.append((t, type(t), t.__dict__.get("_poptorch_host")))
                restore_tensor(t, is_param)
    try:
        yield
    finally:
        with syncing():
            for t, cls, ref in swapped:
                t.__class__ = cls
                if ref is not None:
                    t._poptorch_host = ref
