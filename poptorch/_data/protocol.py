"""The shared-memory protocol between :class:`AsynchronousDataAccessor` and its worker
process, and what a :class:`poptorch.DataLoader` offers the accessor that wraps it
(docs/api-sections.md api §7).

The asynchronous accessor (``accessor.py``) runs the data pipeline in a separate worker
**process** (``worker.py``) that writes elements into a ring buffer of ``buffer_size``
slots living in shared memory (torch shared storages):

* ``ctrl`` (shared ``int64[4]``, written by the training process): ``REQ`` = id of the
  pass (epoch) the training process wants, ``STOP`` = 1 asks the worker to exit.
* ``slots`` (shared ``int64[buffer_size, 2]``): per slot ``STATE`` (0 free, 1 full,
  2 end-of-pass marker, written by the worker to publish and by the training process to
  release) and ``TAG`` (the pass id the slot belongs to).
* ``buffers`` (one shared tensor ``[buffer_size, *shape]`` per tensor of an element) and
  ``rows`` (``int64[buffer_size, n_tensors]``, valid rows of each slot), allocated by the
  worker when it sees the first element and sent once through a ``multiprocessing`` pipe.
* The pipe also carries ``started`` / ``start_failed`` / ``error`` messages (the latter
  with the pickled exception and its formatted traceback) from the worker. The training
  process checks the pipe and the liveness of the worker while it waits, so a failure is
  re-raised instead of hanging. The worker exits when ``STOP`` is set or when the pipe
  reports that the training process went away.

The worker fills slots in ring order (single producer, single consumer); the training
process reads them in the same order, releases the previous slot on each ``__next__`` and
skips slots whose ``TAG`` belongs to an abandoned pass. Each ``iter()`` requests the next
pass id (unless nothing of the current pass was consumed yet); the worker abandons an
older pass as soon as it sees the request, and with ``load_indefinitely`` it starts the
following pass on its own. Slots are published by writing the data, then ``TAG``, then
``STATE`` (stores are not reordered on x86-64's TSO memory model, which the IPU Model
hosts use).

With torch's default ``file_descriptor`` sharing strategy the shared segments are
unlinked from ``/dev/shm`` at creation and freed when the last process releases them, so
neither a crash nor ``KeyboardInterrupt`` can leave a segment behind.
"""
from __future__ import annotations

import collections.abc
import contextlib
import os
import pickle
import traceback
from typing import Iterator, Optional, Protocol, runtime_checkable

import torch

from poptorch._capture.custom_parsers import getCustomArgParser

__all__ = ["CombinedBatches", "REQ", "STOP", "CTRL_SIZE", "STATE", "TAG", "FREE", "FULL",
           "END", "LIVENESS_PERIOD_S", "PARENT_CHECK_PERIOD_S", "MAX_BACKOFF_S",
           "JOIN_TIMEOUT_S", "Stop", "Abandon", "RemoteTraceback", "pack_exception",
           "unpack_exception", "flatten_element", "DatasetPayload"]


@runtime_checkable
class CombinedBatches(Protocol):
    """What a :class:`poptorch.DataLoader` offers the accessor that wraps it (the
    accessor and its worker never import the DataLoader class)."""

    @property
    def uses_async_accessor(self) -> bool:
        """It already runs its own accessor (``DataLoaderMode.Async``)."""

    @property
    def user_batch_sampler(self) -> bool:
        """The user passed a ``batch_sampler``."""

    @property
    def user_drop_last(self) -> bool:
        """The ``drop_last`` the user asked for."""

    def sync_iter(self) -> Iterator:
        """One pass of its synchronous pipeline (combined batches)."""


# --------------------------------------------------------------------------------------
# Shared-memory protocol constants
# --------------------------------------------------------------------------------------
REQ = 0  # ctrl: pass requested by the training process
STOP = 1  # ctrl: 1 = the worker must exit
CTRL_SIZE = 4

STATE = 0  # slots[:, STATE]
TAG = 1  # slots[:, TAG]
FREE = 0
FULL = 1
END = 2

#: How often (seconds) the training process checks the worker while it waits.
LIVENESS_PERIOD_S = 0.02
#: How often (seconds) the worker checks that the training process is still there.
PARENT_CHECK_PERIOD_S = 0.05
#: Longest sleep (seconds) of the training process while it waits for a slot.
MAX_BACKOFF_S = 0.0005
#: How long terminate() waits for a clean exit before SIGTERM, then SIGKILL.
JOIN_TIMEOUT_S = 2.0

FLAT_ERROR = ("AsynchronousDataAccessor expects data to be organised as a flat 1D "
               "container of tensors (a tensor, a list/tuple of tensors, a dict of "
               "tensors or an object with a registered custom arg parser)")


class Stop(Exception):
    """Raised inside the worker to exit its loop."""


class Abandon(Exception):
    """Raised inside the worker when the training process requested a newer pass."""


class RemoteTraceback(Exception):
    """Carries the formatted traceback of an exception raised in the worker process.

    It is attached as ``__cause__`` of the re-raised exception, so the original traceback
    text is printed above the training process's own traceback.
    """

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\nTraceback in the AsynchronousDataAccessor worker process:\n" + self.tb


def pack_exception(exc: BaseException):
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:  # pylint: disable=broad-except
        data = None
    return data, type(exc).__qualname__, str(exc), tb


def unpack_exception(data, type_name, message) -> BaseException:
    if data is not None:
        with contextlib.suppress(Exception):
            exc = pickle.loads(data)
            if isinstance(exc, BaseException):
                return exc
    return RuntimeError(f"{type_name}: {message}")


# --------------------------------------------------------------------------------------
# Element structure helpers (shared by the worker and the training process)
# --------------------------------------------------------------------------------------
def flatten_element(element) -> tuple:
    """``(kind, leaves, keys)`` of an element; ``AssertionError`` if not flat tensors."""
    if isinstance(element, torch.Tensor):
        return "tensor", [element], None
    parser = getCustomArgParser(element)
    if parser is not None:
        leaves = list(parser.yieldTensors(element))
        kind, keys = "custom", None
    elif isinstance(element, (list, tuple)):
        leaves, kind, keys = list(element), "list", None
    elif isinstance(element, collections.abc.Mapping):
        keys = list(element.keys())
        leaves, kind = [element[k] for k in keys], "dict"
    else:
        raise AssertionError(f"{FLAT_ERROR}: got {type(element).__name__}")
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise AssertionError(f"{FLAT_ERROR}: found an element of type "
                                 f"{type(leaf).__name__} inside a {type(element).__name__}")
    return kind, leaves, keys


class DatasetPayload:
    """Carries the dataset to the worker according to the sharing strategy.

    ``obj``: the object itself (fork: inherited, never pickled). ``data``: bytes produced
    by ``ForkingPickler`` in the training process *before* the worker starts (tensors move
    to shared memory; their file descriptors are duplicated by multiprocessing's resource
    sharer, so tensors created only while pickling stay valid), unpickled by the worker
    inside a ``try`` so failures are reported. ``path``: a temporary file holding the
    dataset pickled by value, loaded and deleted by the worker.
    """

    def __init__(self, obj=None, data: Optional[bytes] = None, path: Optional[str] = None):
        self.obj = obj
        self.data = data
        self.path = path

    def __reduce__(self):
        assert self.obj is None, "only a 'data' or 'path' payload can be pickled"
        return (DatasetPayload, (None, self.data, self.path))

    def load(self):
        if self.path is not None:
            try:
                with open(self.path, "rb") as f:
                    return pickle.load(f)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
        if self.data is not None:
            return pickle.loads(self.data)
        return self.obj
