"""Block annotations and the block state of a capture (docs/api-sections.md api §9.1–§9.4,
docs/semantics.md S-60).

Public names: :class:`Block`, :func:`BeginBlock`, :func:`BlockFunction`,
:func:`removeBlocks`. Behaviour follows PopTorch 3.x.

Block annotations only matter while a model is being captured. The capture code
drives the module-level block state:

* :func:`_reset_block_state` (called before capturing) clears the state and turns
  tracking on; :func:`_stop_block_tracking` turns it off again (annotations are
  no-ops while tracking is off, e.g. when the model runs on the CPU).
  :func:`block_capture` is a context manager doing both.
* :func:`current_block` returns ``None`` (no block started yet: ops go to IPU 0 /
  stage 0), a ``(user_id, ipu_id)`` tuple (the active block), or the sentinel
  :data:`NO_ACTIVE_BLOCK` (a ``with Block`` scope ended and no block is active:
  creating an op now is the compile ``Error`` "No active Block, all the ops must
  belong to a Block").
* :func:`block_history` lists every ``(user_id, ipu_id)`` started since the reset.
* ``_state.on_change`` (set by the capture) is called after every block change.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

from popart_compiler.errors import py_error

__all__ = ["Block", "BeginBlock", "BlockFunction", "removeBlocks"]

# ---------------------------------------------------------------------------
# Module-level block state
# ---------------------------------------------------------------------------


class _NoActiveBlock:
    """Type of :data:`NO_ACTIVE_BLOCK` (a ``with Block`` scope ended, none active)."""

    _instance: Optional["_NoActiveBlock"] = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NO_ACTIVE_BLOCK"

    def __reduce__(self):
        return (_NoActiveBlock, ())


#: Returned by :func:`current_block` after a ``with Block(...)`` scope has ended
#: and no other block has started.
NO_ACTIVE_BLOCK = _NoActiveBlock()

BlockInfo = Tuple[Any, Optional[int]]


class _BlockState:
    """The block bookkeeping of the model being captured."""

    def __init__(self) -> None:
        self.tracking = False
        self.current: Union[None, BlockInfo, _NoActiveBlock] = None
        self.next_auto_id = 0
        self.history: List[BlockInfo] = []
        #: Called after every block change while tracking (the capture tags ops).
        self.on_change: Optional[Callable[[], None]] = None


_state = _BlockState()


def _reset_block_state(tracking: bool = True) -> None:
    """Clear the block state (no block started, auto-id counter at 0) and turn
    tracking on (or off with ``tracking=False``). Called before each capture."""
    _state.tracking = tracking
    _state.current = None
    _state.next_auto_id = 0
    _state.history = []


def _stop_block_tracking() -> None:
    """Turn tracking off: block annotations become no-ops again (state kept)."""
    _state.tracking = False


class block_capture:  # noqa: N801 - used like a function
    """Context manager: ``_reset_block_state()`` on entry, ``_stop_block_tracking()``
    on exit (the previous tracking flag is restored).

    Args:
        on_change: called after every block change while inside (the capture tags the
            ops created since the last change); the previous callback is restored on
            exit.
    """

    def __init__(self, on_change: Optional[Callable[[], None]] = None):
        self._on_change = on_change

    def __enter__(self) -> "block_capture":
        self._previous = _state.tracking
        self._previous_callback = _state.on_change
        _reset_block_state(True)
        _state.on_change = self._on_change
        return self

    def __exit__(self, *exc) -> bool:
        _state.tracking = self._previous
        _state.on_change = self._previous_callback
        return False


def is_tracking_blocks() -> bool:
    """``True`` while block annotations are being recorded (during a capture)."""
    return _state.tracking


def current_block() -> Union[None, BlockInfo, _NoActiveBlock]:
    """The active block as ``(user_id, ipu_id)``; ``None`` if no block has started
    since the reset (or tracking is off); :data:`NO_ACTIVE_BLOCK` if a ``with Block``
    scope ended and no block is active."""
    if not _state.tracking:
        return None
    return _state.current


def no_active_block() -> bool:
    """``True`` iff :func:`current_block` is :data:`NO_ACTIVE_BLOCK`."""
    return current_block() is NO_ACTIVE_BLOCK


def block_history() -> List[BlockInfo]:
    """Every ``(user_id, ipu_id)`` started since the last reset, in order."""
    return list(_state.history)


def block_key(info: BlockInfo, history: List[BlockInfo]) -> str:
    """The key a block start tags its ops with: its user id, or ``<id>@ipu<N>`` when
    that id was first started on another IPU (a phase's block spread over IPUs with
    ``poptorch.Block(phase, ipu_id=...)``, as PopTorch's phased examples do)."""
    user_id, ipu_id = info
    first = next((ipu for uid, ipu in history if uid == user_id), ipu_id)
    return str(user_id) if first == ipu_id else f"{user_id}@ipu{ipu_id}"


def _next_auto_id() -> str:
    user_id = str(_state.next_auto_id)
    _state.next_auto_id += 1
    return user_id


def _start_block(user_id, ipu_id) -> None:
    if not _state.tracking:
        return
    if user_id is None:
        user_id = _next_auto_id()
    _state.current = (user_id, ipu_id)
    _state.history.append((user_id, ipu_id))
    if _state.on_change is not None:
        _state.on_change()


def _end_block() -> None:
    if _state.tracking:
        _state.current = NO_ACTIVE_BLOCK
        if _state.on_change is not None:
            _state.on_change()


# ---------------------------------------------------------------------------
# Annotations
# ---------------------------------------------------------------------------


class Block(torch.nn.Module):
    """Context manager assigning the operations created inside it to a block.

    ``with poptorch.Block(user_id=None, ipu_id=None): ...`` — ops created inside
    belong to block ``user_id`` (``str``; blocks with the same id are the same
    block; ``None`` takes the next automatic id ``"0"``, ``"1"``, ...) placed on IPU
    ``ipu_id`` (``int`` or ``None``). After the scope exits no block is active:
    creating an op before the next block starts is the compile ``Error`` "No
    active Block, all the ops must belong to a Block". A no-op outside a capture
    (running on the CPU). Behaviour follows PopTorch.
    """

    def __init__(self, user_id: Optional[str] = None, ipu_id: Optional[int] = None):
        super().__init__()
        self._user_id = user_id
        self._ipu_id = ipu_id

    @staticmethod
    def useAutoId() -> None:
        """Reset the automatic id counter: blocks without ``user_id`` get ``"0"``,
        ``"1"``, ... in order of appearance. Call at the start of ``forward``."""
        _state.next_auto_id = 0

    @staticmethod
    def start(user_id: Optional[str] = None, ipu_id: Optional[int] = None) -> None:
        """Start block ``user_id`` on IPU ``ipu_id`` without a scope: it stays
        active until the next block starts."""
        _start_block(user_id, ipu_id)

    def __enter__(self) -> "Block":
        Block.start(self._user_id, self._ipu_id)
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> bool:
        _end_block()
        return False

    def extra_repr(self) -> str:
        """``user_id=..., ipu_id=...``."""
        return f"user_id={self._user_id!r}, ipu_id={self._ipu_id!r}"


class _BeginBlockHook:
    """Forward pre-hook installed by :func:`BeginBlock` (starts the block each time
    the module runs during a capture). A missing ``user_id`` is taken from the
    auto-id counter the first time it runs and then kept."""

    def __init__(self, user_id, ipu_id):
        self._user_id = user_id
        self._ipu_id = ipu_id
        self._auto = user_id is None

    @property
    def user_id(self):
        """The block id (``None`` until assigned from the auto-id counter)."""
        return self._user_id

    @property
    def ipu_id(self):
        """The IPU of the block (``None`` if unspecified)."""
        return self._ipu_id

    def _begin(self) -> None:
        if not _state.tracking:
            return
        if self._user_id is None:
            self._user_id = _next_auto_id()
        elif self._auto:  # kept from an earlier capture: later blocks take the next ids
            _state.next_auto_id = max(_state.next_auto_id, int(self._user_id) + 1)
        _start_block(self._user_id, self._ipu_id)

    def __call__(self, module, inputs):
        self._begin()

    def __repr__(self) -> str:
        return f"BeginBlock(user_id={self._user_id}, ipu_id={self._ipu_id})"


class _BeginBlockFn(_BeginBlockHook):
    """Callable returned by :func:`BeginBlock` for a non-module callable: starts the
    block, then calls the wrapped function."""

    def __init__(self, fn: Callable, user_id, ipu_id):
        super().__init__(user_id, ipu_id)
        self._fn = fn
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        self._begin()
        return self._fn(*args, **kwargs)


def BeginBlock(layer_to_call, user_id: Optional[str] = None,
               ipu_id: Optional[int] = None):
    """Annotate a module so that a new block starts every time it runs.

    Args:
        layer_to_call: a ``torch.nn.Module`` (a forward pre-hook is registered and
            the module itself is returned) or a callable (a wrapper that starts the
            block before calling it is returned).
        user_id (str, optional): block id; ``None`` takes the next automatic id the
            first time the hook runs, then keeps it.
        ipu_id (int, optional): IPU of the block.

    Everything executed after the block starts (the module, its children and later
    code) stays in it until another block starts. The hook's ``repr`` is
    ``BeginBlock(user_id=..., ipu_id=...)``.

    Raises:
        poptorch.Error: "module is not an instance of torch.nn.Module or function."
            for any other argument; "module has already been assigned to a block."
            when the module is already annotated. Same as PopTorch.
    """
    if not isinstance(layer_to_call, torch.nn.Module):
        if callable(layer_to_call):
            return _BeginBlockFn(layer_to_call, user_id, ipu_id)
        raise py_error("module is not an instance of torch.nn.Module or function.")
    if any(isinstance(h, _BeginBlockHook) for h in layer_to_call._forward_pre_hooks.values()):
        raise py_error("module has already been assigned to a block.")
    layer_to_call.register_forward_pre_hook(_BeginBlockHook(user_id, ipu_id))
    return layer_to_call


def BlockFunction(user_id: Optional[str] = None, ipu_id: Optional[int] = None):
    """Decorator: the decorated function's body runs inside
    ``Block(user_id, ipu_id)``. Behaviour follows PopTorch."""

    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            with Block(user_id, ipu_id):
                return func(*args, **kwargs)

        return wrapper

    return decorator


def removeBlocks(module) -> None:
    """Remove every :func:`BeginBlock` pre-hook from ``module`` and its sub-modules.

    Raises:
        AssertionError: if ``module`` is not a ``torch.nn.Module``.
    """
    if not isinstance(module, torch.nn.Module):
        raise AssertionError("removeBlocks: module must be an instance of torch.nn.Module")
    for m in module.modules():
        for key in [k for k, h in m._forward_pre_hooks.items()
                    if isinstance(h, _BeginBlockHook)]:
            del m._forward_pre_hooks[key]
            m._forward_pre_hooks_with_kwargs.pop(key, None)


def _begin_block_hooks(module: torch.nn.Module) -> List[_BeginBlockHook]:
    """The :func:`BeginBlock` hooks registered on ``module`` itself."""
    return [h for h in module._forward_pre_hooks.values() if isinstance(h, _BeginBlockHook)]
