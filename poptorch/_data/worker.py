"""The worker process of :class:`AsynchronousDataAccessor` and its shared-memory protocol
(spec api §7).

The asynchronous accessor (``_async_accessor.py``) runs the data pipeline in a separate
worker **process** that writes elements into a ring buffer of ``buffer_size`` slots living
in shared memory (torch shared storages).

Worker / shared-memory protocol (see :class:`AsynchronousDataAccessor`):

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
import signal
import time
import traceback
from typing import List, Optional

import torch
import torch.utils.data

from popart_compiler.errors import py_error
from poptorch._capture import custom_parsers
from poptorch._capture.custom_parsers import getCustomArgParser

# --------------------------------------------------------------------------------------
# Shared-memory protocol constants
# --------------------------------------------------------------------------------------
_REQ = 0  # ctrl: pass requested by the training process
_STOP = 1  # ctrl: 1 = the worker must exit
_CTRL_SIZE = 4

_STATE = 0  # slots[:, _STATE]
_TAG = 1  # slots[:, _TAG]
_FREE = 0
_FULL = 1
_END = 2

#: How often (seconds) the training process checks the worker while it waits.
_LIVENESS_PERIOD_S = 0.02
#: How often (seconds) the worker checks that the training process is still there.
_PARENT_CHECK_PERIOD_S = 0.05
#: Longest sleep (seconds) of the training process while it waits for a slot.
_MAX_BACKOFF_S = 0.0005
#: How long terminate() waits for a clean exit before SIGTERM, then SIGKILL.
_JOIN_TIMEOUT_S = 2.0

_FLAT_ERROR = ("AsynchronousDataAccessor expects data to be organised as a flat 1D "
               "container of tensors (a tensor, a list/tuple of tensors, a dict of "
               "tensors or an object with a registered custom arg parser)")


class _Stop(Exception):
    """Raised inside the worker to exit its loop."""


class _Abandon(Exception):
    """Raised inside the worker when the training process requested a newer pass."""


class _RemoteTraceback(Exception):
    """Carries the formatted traceback of an exception raised in the worker process.

    It is attached as ``__cause__`` of the re-raised exception, so the original traceback
    text is printed above the training process's own traceback.
    """

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\nTraceback in the AsynchronousDataAccessor worker process:\n" + self.tb


def _pack_exception(exc: BaseException):
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:  # pylint: disable=broad-except
        data = None
    return data, type(exc).__qualname__, str(exc), tb


def _unpack_exception(data, type_name, message) -> BaseException:
    if data is not None:
        with contextlib.suppress(Exception):
            exc = pickle.loads(data)
            if isinstance(exc, BaseException):
                return exc
    return RuntimeError(f"{type_name}: {message}")


# --------------------------------------------------------------------------------------
# Element structure helpers (shared by the worker and the training process)
# --------------------------------------------------------------------------------------
def _flatten(element) -> tuple:
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
        raise AssertionError(f"{_FLAT_ERROR}: got {type(element).__name__}")
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise AssertionError(f"{_FLAT_ERROR}: found an element of type "
                                 f"{type(leaf).__name__} inside a {type(element).__name__}")
    return kind, leaves, keys


class _DatasetPayload:
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
        return (_DatasetPayload, (None, self.data, self.path))

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


# --------------------------------------------------------------------------------------
# Worker process
# --------------------------------------------------------------------------------------
class _Fetcher:
    """The loop run by the worker process (see the module docstring)."""

    def __init__(self, conn, ctrl: torch.Tensor, slots: torch.Tensor, dataset, settings):
        self.conn = conn
        self.ctrl_t, self.slots_t = ctrl, slots
        self.ctrl = ctrl.numpy()
        self.slots = slots.numpy()
        self.dataset = dataset
        self.num_slots = settings["buffer_size"]
        self.miss_sleep = max(0.0, float(settings["miss_sleep_time_in_ms"])) / 1000.0
        self.load_indefinitely = settings["load_indefinitely"]
        self.rebatched_size = settings["rebatched_size"]
        self.rebatch_drop_last = settings["rebatch_drop_last"]
        self.w = 0
        self.buffers: Optional[List[torch.Tensor]] = None
        self.rows_t: Optional[torch.Tensor] = None
        self.rows = None
        self.kind = None
        self.keys = None
        self.num_leaves = 0
        self.last_parent_check = time.monotonic()
        self.iterator = None

    # -- control -------------------------------------------------------------------
    def check(self, pass_id: Optional[int]) -> None:
        if self.ctrl[_STOP]:
            raise _Stop()
        if pass_id is not None and self.ctrl[_REQ] > pass_id:
            raise _Abandon()
        now = time.monotonic()
        if now - self.last_parent_check > _PARENT_CHECK_PERIOD_S:
            self.last_parent_check = now
            # The training process never writes to the pipe: readable means EOF.
            if self.conn.poll():
                raise _Stop()

    def linger(self) -> None:
        """After reporting an error: stay alive until told to stop, so that the training
        process can still receive the shared buffers and consume the batches loaded
        before the error (they are delivered first, as in Sync mode)."""
        with contextlib.suppress(_Stop):
            while True:
                self.check(None)
                time.sleep(0.005)

    def acquire(self, pass_id: int) -> None:
        """Wait until slot ``w`` is free."""
        while self.slots[self.w, _STATE] != _FREE:
            self.check(pass_id)
            if self.miss_sleep:
                time.sleep(self.miss_sleep)

    def publish(self, state: int, pass_id: int) -> None:
        self.slots[self.w, _TAG] = pass_id
        self.slots[self.w, _STATE] = state  # written last: publishes the slot
        self.w = (self.w + 1) % self.num_slots

    # -- main loop -----------------------------------------------------------------
    def run(self) -> None:
        current = 0
        while True:
            self.check(None)
            requested = int(self.ctrl[_REQ])
            if requested > current:
                current = requested
            elif self.load_indefinitely and current > 0:
                current += 1
            else:
                time.sleep(max(self.miss_sleep, 0.0005))
                continue
            with contextlib.suppress(_Abandon):
                self.run_pass(current)

    def source(self):
        return _iterate_source(self.dataset)

    def run_pass(self, pass_id: int) -> None:
        fill = 0
        self.iterator = self.source()
        try:
            while True:
                self.check(pass_id)
                try:
                    element = next(self.iterator)
                except StopIteration:
                    break
                leaves = self.leaves_of(element)
                if self.rebatched_size is not None:
                    fill = self.write_rebatched(leaves, fill, pass_id)
                else:
                    self.acquire(pass_id)
                    self.write(leaves)
                    self.publish(_FULL, pass_id)
        finally:
            self.iterator = None
        if self.buffers is None:
            raise py_error("The Dataset is empty")
        if fill > 0 and not self.rebatch_drop_last:
            self.rows[self.w, :] = fill
            self.publish(_FULL, pass_id)
        self.acquire(pass_id)
        self.publish(_END, pass_id)

    # -- data ----------------------------------------------------------------------
    def leaves_of(self, element) -> List[torch.Tensor]:
        kind, leaves, keys = _flatten(element)
        if self.buffers is None:
            self.allocate(element, kind, leaves, keys)
            return leaves
        if kind != self.kind or len(leaves) != self.num_leaves:
            raise AssertionError(
                "AsynchronousDataAccessor: every element must have the same structure; "
                f"the first was a {self.kind} of {self.num_leaves} tensor(s), got a {kind} "
                f"of {len(leaves)} tensor(s)")
        if kind == "dict":
            if set(keys) != set(self.keys):
                raise AssertionError("AsynchronousDataAccessor: every dict element must have "
                                     f"the same keys: expected {self.keys}, got {keys}")
            leaves = [element[k] for k in self.keys]
        for i, (leaf, buf) in enumerate(zip(leaves, self.buffers)):
            slot_shape = buf.shape[1:]
            if self.rebatched_size is not None:
                ok = leaf.dim() >= 1 and leaf.shape[1:] == slot_shape[1:]
            elif len(slot_shape) == 0:
                ok = leaf.dim() == 0
            else:
                ok = (leaf.dim() == len(slot_shape) and leaf.shape[1:] == slot_shape[1:]
                      and leaf.shape[0] <= slot_shape[0])
            if not ok or leaf.dtype != buf.dtype:
                raise AssertionError(
                    "AsynchronousDataAccessor: the tensors of every element must keep the "
                    f"shape and dtype of the first element: tensor {i} has shape "
                    f"{list(leaf.shape)} and dtype {leaf.dtype}, expected {list(slot_shape)} "
                    f"(leading dimension at most {slot_shape[0] if len(slot_shape) else 0}) "
                    f"and {buf.dtype}")
        if self.rebatched_size is not None:
            self.check_same_rows(leaves)
        return leaves

    def check_same_rows(self, leaves) -> None:
        if any(leaf.dim() == 0 for leaf in leaves):
            raise AssertionError("AsynchronousDataAccessor: rebatching needs tensors with a "
                                 "batch dimension (got a 0-d tensor)")
        rows = {leaf.shape[0] for leaf in leaves}
        if len(rows) != 1:
            raise AssertionError("AsynchronousDataAccessor: rebatching needs all the tensors "
                                 f"of an element to have the same batch size, got {rows}")

    def allocate(self, element, kind, leaves, keys) -> None:
        if self.rebatched_size is not None:
            self.check_same_rows(leaves)
            shapes = [(self.rebatched_size, ) + tuple(t.shape[1:]) for t in leaves]
        else:
            shapes = [tuple(t.shape) for t in leaves]
        self.buffers = [
            torch.empty((self.num_slots, ) + s, dtype=t.dtype).share_memory_()
            for s, t in zip(shapes, leaves)
        ]
        self.rows_t = torch.zeros((self.num_slots, max(1, len(leaves))),
                                  dtype=torch.int64).share_memory_()
        self.rows = self.rows_t.numpy()
        self.kind, self.keys, self.num_leaves = kind, keys, len(leaves)
        template = element if kind == "custom" else None
        self.conn.send(("buffers", self.buffers, self.rows_t, kind, keys, template))

    def write(self, leaves) -> None:
        w = self.w
        with torch.no_grad():
            for i, (leaf, buf) in enumerate(zip(leaves, self.buffers)):
                if leaf.dim() == 0:
                    buf[w].copy_(leaf)
                    self.rows[w, i] = 0
                else:
                    n = leaf.shape[0]
                    buf[w, :n].copy_(leaf)
                    self.rows[w, i] = n

    def write_rebatched(self, leaves, fill: int, pass_id: int) -> int:
        size = self.rebatched_size
        n = leaves[0].shape[0]
        pos = 0
        with torch.no_grad():
            while pos < n:
                if fill == 0:
                    self.acquire(pass_id)
                k = min(size - fill, n - pos)
                for leaf, buf in zip(leaves, self.buffers):
                    buf[self.w, fill:fill + k].copy_(leaf[pos:pos + k])
                fill += k
                pos += k
                if fill == size:
                    self.rows[self.w, :] = size
                    self.publish(_FULL, pass_id)
                    fill = 0
        return fill


def _iterate_source(dataset):
    """One pass over what the accessor wraps: a poptorch DataLoader's synchronous
    pipeline, a map-style dataset with a length but no ``__iter__`` (indices
    ``0..len-1``), or any other iterable."""
    from poptorch._data.dataloader import \
        DataLoader  # pylint: disable=import-outside-toplevel
    if isinstance(dataset, DataLoader):
        return dataset._sync_iter()  # pylint: disable=protected-access
    if (not hasattr(type(dataset), "__iter__") and hasattr(dataset, "__getitem__")
            and hasattr(dataset, "__len__")):
        return (dataset[i] for i in range(len(dataset)))
    return iter(dataset)


def _safe_send(conn, msg) -> None:
    with contextlib.suppress(Exception):
        conn.send(msg)


def _on_sigterm(signum, frame):  # pragma: no cover - runs in the worker
    raise _Stop()


def _worker_main(conn, inherited_parent_conn, ctrl, slots, payload, settings) -> None:
    """Entry point of the worker process (module-level so that it can be pickled)."""
    # Ctrl-C goes to the whole process group: the training process handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if inherited_parent_conn is not None:  # fork: drop our copy of the parent's end
        inherited_parent_conn.close()
    try:
        torch.set_num_threads(1)
        parsers = settings.get("parsers") or {}
        for arg_type, parser in parsers.items():
            custom_parsers.registerCustomArgParser(arg_type, parser)
        dataset = payload.load()
        fetcher = _Fetcher(conn, ctrl, slots, dataset, settings)
    except BaseException as exc:  # pylint: disable=broad-except
        _safe_send(conn, ("start_failed", ) + _pack_exception(exc))
        return
    _safe_send(conn, ("started", os.getpid()))
    try:
        fetcher.run()
    except _Stop:
        return  # told to stop, or the training process is gone: a normal exit
    except BaseException as exc:  # pylint: disable=broad-except
        _safe_send(conn, ("error", ) + _pack_exception(exc))
        fetcher.linger()
    finally:
        fetcher.iterator = None


