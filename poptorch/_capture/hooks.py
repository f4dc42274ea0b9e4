"""The compile hooks: ``poptorch.registerPreCompileHook`` / ``registerPostCompileHook``
(docs/api-sections.md api §2.8, §2.9), run by every capture."""
from __future__ import annotations

import collections
from typing import Callable, Dict

from torch.utils.hooks import RemovableHandle

__all__ = ["registerPreCompileHook", "registerPostCompileHook", "run_pre_compile_hooks",
           "run_post_compile_hooks"]

# OrderedDicts: RemovableHandle keeps a weak reference to its registry.
_PRE_HOOKS: Dict[int, Callable[[], None]] = collections.OrderedDict()
_POST_HOOKS: Dict[int, Callable[[], None]] = collections.OrderedDict()


def _register(registry: Dict[int, Callable[[], None]], hook) -> RemovableHandle:
    if not callable(hook):
        raise RuntimeError("The compile hook must be callable")
    handle = RemovableHandle(registry)
    registry[handle.id] = hook
    return handle


def registerPreCompileHook(hook: Callable[[], None]) -> RemovableHandle:
    """Run ``hook()`` right before every model's ``forward`` is captured
    (docs/api-sections.md api §2.8).

    Returns:
        A handle whose ``remove()`` unregisters the hook.

    Raises:
        RuntimeError: ``hook`` is not callable.
    """
    return _register(_PRE_HOOKS, hook)


def registerPostCompileHook(hook: Callable[[], None]) -> RemovableHandle:
    """Run ``hook()`` when every capture ends, also when it fails
    (docs/api-sections.md api §2.9)."""
    return _register(_POST_HOOKS, hook)


def run_pre_compile_hooks() -> None:
    """Call the registered pre-compile hooks, in registration order (a hook may
    remove itself while they run)."""
    for hook in list(_PRE_HOOKS.values()):
        hook()


def run_post_compile_hooks() -> None:
    """Call the registered post-compile hooks, in registration order."""
    for hook in list(_POST_HOOKS.values()):
        hook()
