"""The wrapped parameters and buffers of a model, by PopTorch's names (``poptorch._impl``).

A model wrapped by ``trainingModel`` holds instrumented parameters and buffers
(:mod:`poptorch._executor.instrument`): subclasses of ``nn.Parameter`` / ``torch.Tensor``
that pull trained weights from the device before they are read. Code that must see
plain tensors for a while (optimum-graphcore unwraps a model before generation and
rewraps it after) uses these functions, as with PopTorch 3.4.
"""
from __future__ import annotations

import weakref
from typing import Dict, Tuple

import torch

from poptorch._executor import instrument

__all__ = ["isWrapped", "unwrapIfWrapped", "unwrapModelIfNecessary",
           "rewrapModelIfNecessary", "restoreWrapperIfNecessary"]

#: id(tensor) -> (weak reference to the tensor, its wrapper class, its host link):
#: what an unwrapped tensor was, so that it can be rewrapped.
_unwrapped: Dict[int, Tuple[weakref.ref, type, object]] = {}


def isWrapped(obj) -> bool:
    """Whether ``obj`` is a wrapped (instrumented) parameter or buffer."""
    return isinstance(obj, instrument.WRAPPER_TYPES)


def unwrapIfWrapped(obj):
    """Turn a wrapped parameter / buffer into a plain one in place (forgetting its
    wrapper); anything else is returned unchanged. Returns ``obj``."""
    if isWrapped(obj):
        instrument.restore_tensor(obj, isinstance(obj, torch.nn.Parameter))
    return obj


def _unwrap_and_register(obj) -> None:
    if isWrapped(obj):
        _unwrapped[id(obj)] = (weakref.ref(obj, lambda _, key=id(obj): _unwrapped.pop(key, None)),
                               type(obj), obj.__dict__.get("_poptorch_host"))
        unwrapIfWrapped(obj)


def restoreWrapperIfNecessary(obj):
    """Give a tensor unwrapped by :func:`unwrapModelIfNecessary` its wrapper back.
    Returns ``obj``."""
    entry = _unwrapped.get(id(obj))
    if entry is not None and entry[0]() is obj:
        _, cls, host = _unwrapped.pop(id(obj))
        obj.__class__ = cls
        if host is not None:
            obj._poptorch_host = host
    return obj


def unwrapModelIfNecessary(model: torch.nn.Module) -> None:
    """Make every parameter and buffer of ``model`` a plain tensor until
    :func:`rewrapModelIfNecessary`: reads then no longer pull weights from the device
    (PopTorch's behaviour). Unwrapped tensors are remembered weakly."""
    for t in list(model.buffers()) + list(model.parameters()):
        _unwrap_and_register(t)


def rewrapModelIfNecessary(model: torch.nn.Module) -> None:
    """Undo :func:`unwrapModelIfNecessary` on every parameter and buffer of ``model``."""
    for t in list(model.buffers()) + list(model.parameters()):
        restoreWrapperIfNecessary(t)
