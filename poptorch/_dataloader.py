"""Data loading: :class:`DataLoader` and :class:`AsynchronousDataAccessor` (spec api §7).

Both follow PopTorch 3.x. The asynchronous accessor runs the data pipeline in a separate
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

import atexit
import collections.abc
import contextlib
import os
import pickle
import signal
import tempfile
import time
import traceback
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import torch
import torch.multiprocessing as torch_mp  # noqa: F401  registers torch's tensor reductions
import torch.utils.data
from multiprocessing.reduction import ForkingPickler

from popart_compiler.errors import py_error

from . import _custom_parsers
from ._custom_parsers import getCustomArgParser
from ._logging import logger
from .enums import DataLoaderMode, SharingStrategy

__all__ = ["DataLoader", "AsynchronousDataAccessor"]

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
            _custom_parsers.registerCustomArgParser(arg_type, parser)
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


# --------------------------------------------------------------------------------------
# AsynchronousDataAccessor
# --------------------------------------------------------------------------------------
_LIVE_ACCESSORS: "weakref.WeakSet[AsynchronousDataAccessor]" = weakref.WeakSet()


def _terminate_all() -> None:
    for accessor in list(_LIVE_ACCESSORS):
        with contextlib.suppress(Exception):
            accessor.terminate()


atexit.register(_terminate_all)

_START_METHODS = {
    SharingStrategy.Fork: "fork",
    SharingStrategy.ForkServer: "forkserver",
    SharingStrategy.SharedMemory: "spawn",
    SharingStrategy.FileSystem: "spawn",
}


def _prepare_forkserver() -> None:
    """Preload torch and this module in the fork server (once, before it starts), so that
    each worker forked from it does not import them again."""
    with contextlib.suppress(Exception):
        from multiprocessing import forkserver  # pylint: disable=import-outside-toplevel
        server = forkserver._forkserver  # pylint: disable=protected-access
        if getattr(server, "_forkserver_pid", None) is not None:
            return
        modules = list(getattr(server, "_preload_modules", ["__main__"]))
        for name in ("torch", __name__):
            if name not in modules:
                modules.append(name)
        server.set_forkserver_preload(modules)


class AsynchronousDataAccessor:
    """Loads data in a separate worker **process** into a ring buffer in shared memory.

    Follows PopTorch's ``poptorch.AsynchronousDataAccessor`` (spec api §7.2).

    Args:
        dataset: any iterable, usually a :class:`poptorch.DataLoader` (mode ``Sync``) or a
            ``torch.utils.data.DataLoader``; a map-style dataset with ``__len__`` and no
            ``__iter__`` is read at indices ``0 .. len-1``. Each element must be a tensor, a flat
            list/tuple of tensors, a dict of tensors (same keys every time) or an object
            with a registered custom arg parser; every element must keep the shapes and
            dtypes of the first one (the leading dimension may shrink, e.g. a final short
            batch).
        buffer_size (int, default 3): number of ring-buffer slots, i.e. elements prefetched
            ahead of the consumer.
        miss_sleep_time_in_ms (float, default 0.1): how long the worker sleeps when the ring
            is full before checking again.
        load_indefinitely (bool, default True): at the end of the data the worker
            immediately starts a new pass (prefetching the next epoch); if ``False`` it
            waits for the next ``iter()``.
        early_preload (bool, default False): start filling the buffer at construction
            instead of at the first ``iter()``.
        sharing_strategy (SharingStrategy, default ``ForkServer``): how the dataset reaches
            the worker: ``Fork`` (fork, nothing pickled), ``ForkServer`` (forkserver
            context, dataset pickled; tensors travel through shared memory),
            ``SharedMemory`` (spawn, same pickling), ``FileSystem`` (dataset pickled by
            value to a temporary file, then spawn).
        rebatched_size (int, optional): if set (must be > 1) the worker concatenates/splits
            incoming elements so that every yielded element has exactly ``rebatched_size``
            rows; the last one may be shorter if the wrapped loader's ``drop_last`` is
            false (a dataset without a ``drop_last`` attribute keeps the remainder).

    Raises:
        poptorch.Error: the dataset is a :class:`poptorch.DataLoader` that already uses an
            accessor internally; the worker failed to start ("worker thread failed to
            start", e.g. an unpicklable dataset).
        AssertionError: a :class:`poptorch.DataLoader` with ``drop_last=False`` and a
            combined batch size other than ``None``/1 without ``rebatched_size``;
            ``rebatched_size`` <= 1; ``buffer_size`` < 1.

    Errors while iterating: an exception raised by the dataset in the worker is re-raised
    in the training process with its own type and message, its original traceback text
    attached as ``__cause__``; an empty dataset raises ``poptorch.Error`` "The Dataset is
    empty"; a worker that dies without reporting an error raises ``AssertionError`` "An
    error occurred in the data fetcher". After an error (or :meth:`terminate`, or a
    ``KeyboardInterrupt`` received inside ``__next__``) the worker is stopped; the next
    ``iter()`` starts a fresh one.

    **Important:** the tensors returned by ``__next__`` are views of the shared ring
    buffer; they stay valid until the next call to ``__next__`` and are overwritten
    later. Clone them to keep them longer.
    """

    def __init__(self,
                 dataset,
                 buffer_size: int = 3,
                 miss_sleep_time_in_ms: float = 0.1,
                 load_indefinitely: bool = True,
                 early_preload: bool = False,
                 sharing_strategy: SharingStrategy = SharingStrategy.ForkServer,
                 rebatched_size: Optional[int] = None):
        # Set first: __del__ / terminate() may run if the constructor fails.
        self._process = None
        self._owner_pid = os.getpid()
        self._owner_ref = None
        if isinstance(dataset, DataLoader):
            if dataset._accessor is not None:  # pylint: disable=protected-access
                raise py_error(
                    "This poptorch.DataLoader already uses an AsynchronousDataAccessor "
                    "internally (mode=DataLoaderMode.Async): either iterate the DataLoader "
                    "directly or create it with mode=poptorch.DataLoaderMode.Sync.")
            if (not dataset._user_batch_sampler  # pylint: disable=protected-access
                    and not dataset.drop_last and rebatched_size is None):
                assert dataset.combinedBatchSize in (None, 1), (
                    "AsynchronousDataAccessor doesn't support a poptorch.DataLoader with "
                    "drop_last=False and a combined batch size other than 1 (got "
                    f"{dataset.combinedBatchSize}): use drop_last=True, rebatched_size, or "
                    "poptorch.DataLoader(mode=poptorch.DataLoaderMode.AsyncRebatched).")
        assert rebatched_size is None or rebatched_size > 1, (
            f"rebatched_size must be None or greater than 1, got {rebatched_size}")
        assert isinstance(buffer_size, int) and buffer_size >= 1, (
            f"buffer_size must be a positive int, got {buffer_size}")
        self._dataset = dataset
        self._buffer_size = buffer_size
        self._miss_sleep_time_in_ms = miss_sleep_time_in_ms
        self._load_indefinitely = bool(load_indefinitely)
        self._early_preload = bool(early_preload)
        self._sharing_strategy = SharingStrategy(sharing_strategy)
        self._rebatched_size = rebatched_size
        if isinstance(dataset, DataLoader):
            self._rebatch_drop_last = dataset._user_drop_last  # pylint: disable=protected-access
        else:
            self._rebatch_drop_last = bool(getattr(dataset, "drop_last", False))
        self._reset_state()
        _LIVE_ACCESSORS.add(self)
        self._start_worker()
        if self._early_preload:
            self._begin_pass()

    # ------------------------------------------------------------------ state helpers
    def _reset_state(self) -> None:
        self._conn = None
        self._ctrl = self._ctrl_np = None
        self._slots = self._slots_np = None
        self._buffers = None
        self._rows = None
        self._kind = self._keys = self._template = None
        self._temp_file = None
        self._expected_pass = 0
        self._pass_state = "idle"  # idle | active | done
        self._consumed = 0
        self._read = 0
        self._held = None

    def _get_dataset(self):
        if self._owner_ref is not None:
            owner = self._owner_ref()
            if owner is None:
                raise py_error("The DataLoader owning this AsynchronousDataAccessor was "
                               "deleted")
            return owner
        return self._dataset

    def _set_owner(self, loader: "DataLoader") -> None:
        """Used by :class:`DataLoader`: hold the owner weakly (no reference cycle)."""
        self._owner_ref = weakref.ref(loader)
        self._dataset = None

    # ------------------------------------------------------------------ start / stop
    def _start_worker(self) -> None:
        method = _START_METHODS[self._sharing_strategy]
        if method == "forkserver":
            _prepare_forkserver()
        ctx = torch_mp.get_context(method)
        dataset = self._get_dataset()
        self._ctrl = torch.zeros(_CTRL_SIZE, dtype=torch.int64).share_memory_()
        self._slots = torch.zeros((self._buffer_size, 2), dtype=torch.int64).share_memory_()
        self._ctrl_np = self._ctrl.numpy()
        self._slots_np = self._slots.numpy()
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        parsers: Dict[type, Any] = {}
        try:
            if self._sharing_strategy == SharingStrategy.Fork:
                payload = _DatasetPayload(obj=dataset)
            elif self._sharing_strategy == SharingStrategy.FileSystem:
                fd, path = tempfile.mkstemp(prefix="poptorch_dataset_", suffix=".pkl")
                self._temp_file = path
                with os.fdopen(fd, "wb") as f:
                    pickle.dump(dataset, f, protocol=pickle.HIGHEST_PROTOCOL)
                payload = _DatasetPayload(path=path)
            else:
                payload = _DatasetPayload(data=bytes(ForkingPickler.dumps(dataset)))
            if method != "fork":
                # User parsers registered at run time do not exist in a fresh interpreter.
                for arg_type, parser in _custom_parsers._PARSERS.items():  # pylint: disable=protected-access
                    with contextlib.suppress(Exception):
                        pickle.dumps((arg_type, parser))
                        parsers[arg_type] = parser
            settings = dict(buffer_size=self._buffer_size,
                            miss_sleep_time_in_ms=self._miss_sleep_time_in_ms,
                            load_indefinitely=self._load_indefinitely,
                            rebatched_size=self._rebatched_size,
                            rebatch_drop_last=self._rebatch_drop_last,
                            parsers=parsers)
            process = ctx.Process(
                target=_worker_main,
                args=(child_conn, parent_conn if method == "fork" else None, self._ctrl,
                      self._slots, payload, settings),
                name="PopTorchAsyncDataWorker",
                daemon=False)
            process.start()
        except Exception as exc:
            parent_conn.close()
            child_conn.close()
            self._cleanup_resources()
            raise py_error("The AsynchronousDataAccessor worker thread failed to start: "
                           f"{type(exc).__name__}: {exc}") from exc
        finally:
            del dataset
        child_conn.close()
        self._process = process
        self._conn = parent_conn
        try:
            self._wait_started()
        except BaseException:  # includes KeyboardInterrupt: never leave a stray worker
            self._shutdown_worker()
            raise

    def _wait_started(self) -> None:
        while True:
            if self._conn.poll(_LIVENESS_PERIOD_S):
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is not None and msg[0] == "started":
                    return
                if msg is not None and msg[0] == "start_failed":
                    _, data, type_name, message, tb = msg
                    self._shutdown_worker()
                    raise py_error(
                        "The AsynchronousDataAccessor worker thread failed to start: "
                        f"{type_name}: {message}") from _RemoteTraceback(tb)
                if msg is None:
                    self._process.join(1.0)
            if not self._process.is_alive():
                code = self._process.exitcode
                self._shutdown_worker()
                raise py_error("The AsynchronousDataAccessor worker thread failed to start "
                               f"(the worker process exited with code {code}).")

    def _shutdown_worker(self) -> None:
        process = self._process
        self._process = None
        if process is not None:
            with contextlib.suppress(Exception):
                if self._ctrl_np is not None:
                    self._ctrl_np[_STOP] = 1
                process.join(_JOIN_TIMEOUT_S)
                if process.is_alive():
                    process.terminate()
                    process.join(_JOIN_TIMEOUT_S)
                if process.is_alive():
                    process.kill()
                    process.join()
            with contextlib.suppress(Exception):
                process.close()
        self._cleanup_resources()

    def _cleanup_resources(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        if self._temp_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._temp_file)
        self._reset_state()

    def terminate(self) -> None:
        """Stop the worker process and release the shared memory (PopTorch API).

        Asks the worker to exit, then sends it SIGTERM and finally SIGKILL if it has not
        exited after 2 s each. Safe to call several times; also called from ``__del__`` and
        at interpreter exit. A later ``iter()`` starts a new worker. Returned tensors that
        the user still references stay valid (their memory is freed when released).
        """
        if getattr(self, "_process", None) is None:
            return
        if os.getpid() != self._owner_pid:  # a forked copy never owns the worker
            return
        self._shutdown_worker()

    def __del__(self):
        """Stop the worker when the accessor is garbage collected."""
        with contextlib.suppress(Exception):
            self.terminate()

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        """Number of elements per pass: ``len(dataset)``; with rebatching (standalone
        accessor) ``(len(dataset) × dataset.batch_size) // rebatched_size``.
        ``TypeError`` if the dataset has no length. Follows PopTorch."""
        dataset = self._get_dataset()
        if self._owner_ref is not None:
            return len(dataset)
        length = len(dataset)
        if self._rebatched_size is not None:
            batch = getattr(dataset, "batch_size", None) or 1
            return (length * batch) // self._rebatched_size
        return length

    def _begin_pass(self) -> None:
        self._release_held()
        self._expected_pass += 1
        self._ctrl_np[_REQ] = self._expected_pass
        self._pass_state = "active"
        self._consumed = 0

    def __iter__(self) -> "AsynchronousDataAccessor":
        """Start a pass (epoch) and return ``self``.

        If the previous pass was partially consumed, the worker abandons it and starts
        from the beginning of the data. Starts a new worker if it was terminated.
        """
        if self._process is None:
            self._start_worker()
        if self._pass_state == "active" and self._consumed == 0:
            return self  # nothing consumed yet (e.g. early_preload): keep this pass
        self._begin_pass()
        return self

    def __next__(self):
        """Release the previous slot and return the next element (views of the ring
        buffer: a tensor, a list of tensors, a dict or a custom object).

        Busy-waits (with a short back-off) for the worker. Raises ``StopIteration`` at the
        end of the pass and the errors described in the class docstring.
        """
        if self._pass_state == "idle":
            self.__iter__()
        if self._pass_state == "done" or self._process is None:
            raise StopIteration
        try:
            return self._next_element()
        except KeyboardInterrupt:
            self.terminate()
            self._pass_state = "done"
            raise

    def _release_held(self) -> None:
        if self._held is not None:
            self._slots_np[self._held, _STATE] = _FREE
            self._held = None

    def _next_element(self):
        self._release_held()
        slots = self._slots_np
        n = self._buffer_size
        while True:
            r = self._read
            state = self._wait_filled(r)
            tag = slots[r, _TAG]
            if tag < self._expected_pass:  # left over from an abandoned pass
                slots[r, _STATE] = _FREE
                self._read = (r + 1) % n
                continue
            if state == _END:
                slots[r, _STATE] = _FREE
                self._read = (r + 1) % n
                self._pass_state = "done"
                raise StopIteration
            if self._buffers is None:
                self._wait_for_buffers()
            self._held = r
            self._read = (r + 1) % n
            self._consumed += 1
            return self._build(r)

    def _wait_filled(self, r: int) -> int:
        slots = self._slots_np
        state = slots[r, _STATE]
        if state != _FREE:
            return state
        delay = 1e-5
        spins = 0
        last_check = time.monotonic()
        while True:
            state = slots[r, _STATE]
            if state != _FREE:
                return state
            spins += 1
            if spins > 64:
                time.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF_S)
            now = time.monotonic()
            if now - last_check > _LIVENESS_PERIOD_S:
                last_check = now
                self._check_worker()

    def _check_worker(self) -> None:
        """Handle pending messages; raise if the worker reported an error or died."""
        while self._conn.poll():
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            self._handle_message(msg)
        if not self._process.is_alive():
            # It may have written a last message just before exiting.
            while self._conn.poll():
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    break
                self._handle_message(msg)
            code = self._process.exitcode
            self._shutdown_worker()
            self._pass_state = "done"
            raise AssertionError("An error occurred in the data fetcher: the "
                                 "AsynchronousDataAccessor worker process exited "
                                 f"unexpectedly (exit code {code}).")

    def _handle_message(self, msg) -> None:
        if msg[0] == "buffers":
            _, buffers, rows, kind, keys, template = msg
            self._buffers = buffers
            self._rows = rows.numpy()
            self._rows_t = rows
            self._kind, self._keys, self._template = kind, keys, template
        elif msg[0] == "error":
            _, data, type_name, message, tb = msg
            exc = _unpack_exception(data, type_name, message)
            self._shutdown_worker()
            self._pass_state = "done"
            raise exc from _RemoteTraceback(tb)

    def _wait_for_buffers(self) -> None:
        while self._buffers is None:
            if self._conn.poll(_LIVENESS_PERIOD_S):
                with contextlib.suppress(EOFError, OSError):
                    self._handle_message(self._conn.recv())
                    continue
            self._check_worker()

    def _build(self, r: int):
        views = []
        rows = self._rows
        for i, buf in enumerate(self._buffers):
            view = buf[r]
            if view.dim() > 0:
                k = int(rows[r, i])
                if k != view.shape[0]:
                    view = view[:k]
            views.append(view)
        if self._kind == "tensor":
            return views[0]
        if self._kind == "list":
            return views
        if self._kind == "dict":
            return dict(zip(self._keys, views))
        parser = getCustomArgParser(self._template)
        return parser.reconstruct(self._template, iter(views))


# --------------------------------------------------------------------------------------
# DataLoader
# --------------------------------------------------------------------------------------
def _num_processes(options) -> int:
    try:
        return int(options.Distributed.numProcesses)
    except Exception:  # pylint: disable=broad-except
        return 1


class _DistributedSubset(torch.utils.data.Dataset):
    """This process's contiguous slice of a map-style dataset (spec S-28).

    With ``drop_last`` each process gets ``combined × floor(len / (combined × n))``
    elements starting at ``id ×`` that amount; otherwise elements are split as evenly as
    possible (the first ``len % n`` processes get one more). When shuffling, every epoch
    (:meth:`next_epoch`) draws a global permutation from ``seed + epoch`` (identical in
    all processes) and, with ``drop_last``, the slices shift by the number of leftover
    elements on odd epochs so that those elements rotate in.
    """

    def __init__(self, dataset, process_id: int, num_processes: int, combined: int,
                 drop_last: bool, shuffle: bool, seed: Optional[int]):
        num_elts = len(dataset)
        if drop_last:
            per_proc = combined * (num_elts // (combined * num_processes))
            self._base_offset = process_id * per_proc
            self._length = per_proc
            self._leftovers = num_elts - per_proc * num_processes
        else:
            base, rem = divmod(num_elts, num_processes)
            self._base_offset = process_id * base + min(process_id, rem)
            self._length = base + (1 if process_id < rem else 0)
            self._leftovers = 0
        self._offset = self._base_offset
        self._dataset = dataset
        self._shuffle = shuffle
        self._seed = seed
        self._epoch = -1
        self._indices: Optional[torch.Tensor] = None

    @property
    def offset(self) -> int:
        """Global index of this process's first element (before shuffling)."""
        return self._offset

    def next_epoch(self) -> bool:
        """Advance to the next epoch; returns True if the indices changed."""
        if not self._shuffle:
            return False
        self._epoch += 1
        generator = torch.Generator()
        generator.manual_seed(int(self._seed) + self._epoch)
        self._indices = torch.randperm(len(self._dataset), generator=generator)
        self._offset = self._base_offset + (self._leftovers if self._epoch % 2 else 0)
        return True

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int):
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"index {index} out of range for a subset of length "
                             f"{self._length}")
        global_index = self._offset + index
        if self._indices is not None:
            global_index = int(self._indices[global_index])
        return self._dataset[global_index]


def _concat(items: List[Any]):
    """Concatenate consecutive collated batches along dim 0, keeping their structure."""
    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([t.reshape(1) if t.dim() == 0 else t for t in items])
    parser = getCustomArgParser(first)
    if parser is not None:
        columns = list(zip(*[list(parser.yieldTensors(it)) for it in items]))
        return parser.reconstruct(first, iter([_concat(list(c)) for c in columns]))
    if isinstance(first, collections.abc.Mapping):
        out = {k: _concat([it[k] for it in items]) for k in first}
        try:
            return type(first)(out)
        except TypeError:
            return out
    if isinstance(first, (list, tuple)):
        if any(isinstance(x, (torch.Tensor, collections.abc.Mapping, list, tuple))
               for x in first):
            columns = [_concat(list(c)) for c in zip(*items)]
            if hasattr(first, "_fields"):  # namedtuple
                return type(first)(*columns)
            return type(first)(columns)
        merged = [x for it in items for x in it]
        return type(first)(merged) if isinstance(first, tuple) else merged
    return items


class _OwnedIterator:
    """An epoch iterator that keeps its :class:`DataLoader` alive, so that
    ``for batch in poptorch.DataLoader(...)`` works in the asynchronous modes too (the
    loader stops its worker when it is garbage collected)."""

    def __init__(self, owner: "DataLoader", iterator):
        self._owner = owner
        self._iterator = iterator

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._iterator)


class _ProgressIterator:
    """Wraps an epoch iterator with a tqdm progress bar (closed at the end of the epoch)."""

    def __init__(self, iterator, total: Optional[int], tqdm_kwargs: Dict[str, Any]):
        from tqdm import tqdm  # pylint: disable=import-outside-toplevel
        self._iterator = iterator
        self._bar = tqdm(total=total, **tqdm_kwargs)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            element = next(self._iterator)
        except BaseException:
            self.close()
            raise
        self._bar.update(1)
        return element

    def close(self) -> None:
        """Close the progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


class DataLoader(torch.utils.data.DataLoader):
    """A ``torch.utils.data.DataLoader`` yielding **combined batches**: one element per
    call of a model wrapped with the same options. Follows PopTorch (spec api §7.1).

    ``combinedBatchSize = batch_size × deviceIterations × (replicationFactor //
    input_group_size) × gradientAccumulation`` (S-11); every yielded tensor has that many
    rows in dim 0 (except a possible final short batch when ``drop_last=False``), laid
    out as described in S-13.

    Args:
        options (poptorch.Options): the options of the model the data is for; frozen by
            this call.
        dataset: a map-style or iterable ``torch.utils.data.Dataset``.
        batch_size (int or None, default 1): micro-batch size (what the model sees per
            step); ``None`` disables automatic batching (combined size ``None``).
        shuffle (bool, default None = False): reshuffle every epoch. When the options have
            a random seed (``Options.randomSeed``) and no ``generator`` is passed, the
            permutations come from a generator seeded with it, so the epochs are
            reproducible for a seed and identical in Sync and Async modes. Without a seed,
            Sync mode uses torch's global RNG at each epoch (as torch does) and Async mode
            a generator seeded from the global RNG at construction.
        num_workers (int, default 0): torch worker processes.
        drop_last (bool, default True): drop the final incomplete combined batch.
        persistent_workers (bool, default None = ``num_workers > 0``).
        auto_distributed_partitioning (bool, default True): with
            ``Distributed.numProcesses > 1``, give each process its own slice (S-28).
        mode (DataLoaderMode, default Sync): ``Sync``; ``Async`` (an internal
            :class:`AsynchronousDataAccessor` loads data in a worker process);
            ``AsyncRebatched`` (same, the worker loads batches of ``rebatched_worker_size``
            and the accessor assembles combined batches).
        async_options (dict, optional): keyword arguments for the internal
            :class:`AsynchronousDataAccessor` (not ``rebatched_size``).
        rebatched_worker_size (int, optional): worker-side batch size when rebatching
            (default: the combined batch size); must be <= the combined batch size.
        batch_sampler (optional): a sampler of index batches; mutually exclusive with
            ``batch_size`` and ``shuffle``. Its ``batch_size`` attribute, if any, is the
            micro-batch size; consecutive batches are concatenated into combined batches.
        progress_bar (bool or dict, keyword-only, default False): extension of this
            implementation: show a tqdm progress bar for each epoch (a dict is passed to
            ``tqdm`` as keyword arguments, e.g. ``{"desc": "train"}``).
        **kwargs: passed to ``torch.utils.data.DataLoader`` (``collate_fn``,
            ``worker_init_fn``, ``generator``, ``pin_memory``, ...).

    Raises:
        poptorch.Error: ``batch_sampler`` with ``batch_size != 1`` or ``shuffle``
            ("`batch_sampler` option is mutually exclusive with batch_size, shuffle."), or
            with distributed execution and ``auto_distributed_partitioning``.
        AssertionError: ``options`` is not a ``poptorch.Options``; an ``IterableDataset``
            with distributed execution and ``auto_distributed_partitioning``; distributed
            ``shuffle`` without a random seed; distributed ``batch_size=None``;
            ``rebatched_worker_size`` > combined batch size; ``rebatched_size`` in
            ``async_options``.
        ValueError: from torch for invalid torch arguments.
    """

    def __init__(self,
                 options,
                 dataset: torch.utils.data.Dataset,
                 batch_size: Optional[int] = 1,
                 shuffle: Optional[bool] = None,
                 num_workers: int = 0,
                 drop_last: bool = True,
                 persistent_workers: Optional[bool] = None,
                 auto_distributed_partitioning: bool = True,
                 mode: DataLoaderMode = DataLoaderMode.Sync,
                 async_options: Optional[Dict[str, Any]] = None,
                 rebatched_worker_size: Optional[int] = None,
                 batch_sampler: Optional[Union[torch.utils.data.Sampler, Iterator[Sequence]]] = None,
                 *,
                 progress_bar: Union[bool, Dict[str, Any]] = False,
                 **kwargs):
        self._accessor: Optional[AsynchronousDataAccessor] = None
        self._epoch_count = 0
        num_processes = _num_processes(options)
        # Rule 1: user batch sampler.
        self._user_batch_sampler = batch_sampler is not None
        self._user_drop_last = bool(drop_last)
        if self._user_batch_sampler:
            if batch_size != 1 or shuffle:
                raise py_error("`batch_sampler` option is mutually exclusive with "
                               "batch_size, shuffle.")
            if auto_distributed_partitioning and num_processes > 1:
                raise py_error("`batch_sampler` option is mutually exclusive with "
                               "auto_distributed_partitioning=True.")
            if getattr(batch_sampler, "batch_size", None) is not None:
                batch_size = batch_sampler.batch_size
            drop_last = None  # kept in _user_drop_last for the recombination
        if shuffle is None:
            shuffle = False
        # Rule 2.
        from .options import Options  # pylint: disable=import-outside-toplevel
        assert isinstance(options, Options), (
            f"Invalid type for 'options': expected poptorch.Options, got {type(options)}")
        options._freeze()  # pylint: disable=protected-access
        # Rule 3.
        if persistent_workers is None:
            persistent_workers = num_workers > 0

        steps = (options.device_iterations *
                 (options.replication_factor // options.input_group_size) *
                 options.Training.gradient_accumulation)
        self._combined_batch_size: Optional[int] = None
        if batch_size is not None:
            self._combined_batch_size = batch_size * steps
            # Reference quirk: `options` only exists when batch_size is not None.
            self._options = options
        self._batches_to_combine = steps if self._user_batch_sampler else 1

        self._is_iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if self._is_iterable:
            # Rule 4.
            if auto_distributed_partitioning:
                assert num_processes == 1, (
                    "auto_distributed_partitioning=True is not supported for "
                    "IterableDataset: partition the data yourself (using "
                    "Options.Distributed.processId / numProcesses) and pass "
                    "auto_distributed_partitioning=False")
            if num_workers > 1 and "worker_init_fn" not in kwargs:
                logger.warning(
                    "IterableDataset used with num_workers=%d but no worker_init_fn "
                    "specified: as a result the DataLoader will return every element of "
                    "the dataset %d times (once per worker).", num_workers, num_workers)
        else:
            # Rule 5.
            if not self._user_drop_last:
                self._warn_final_batch(dataset, batch_sampler, num_processes,
                                       options.Distributed.processId,
                                       auto_distributed_partitioning)
            # Rule 6.
            if num_processes > 1 and auto_distributed_partitioning:
                if shuffle:
                    assert options.exists("random_seed"), (
                        "When using distributed execution with shuffle=True you must set "
                        "a random seed with Options.randomSeed() so that all the processes "
                        "shuffle the dataset identically")
                assert self._combined_batch_size is not None, (
                    "batch_size=None is not allowed when using distributed execution "
                    "with auto_distributed_partitioning=True")
                dataset = _DistributedSubset(
                    dataset, options.Distributed.processId, num_processes,
                    self._combined_batch_size, self._user_drop_last, bool(shuffle),
                    options.random_seed if options.exists("random_seed") else None)
                shuffle = False  # the subset shuffles globally, per epoch

        # Rule 7: mode resolution.
        mode = DataLoaderMode(mode)
        self._rebatched_size: Optional[int] = None
        torch_batch_size = 1 if self._user_batch_sampler else self._combined_batch_size
        torch_drop_last = drop_last
        if mode != DataLoaderMode.Sync:
            wants_rebatch = (mode == DataLoaderMode.AsyncRebatched
                             or (not self._user_drop_last and self._combined_batch_size
                                 is not None and self._combined_batch_size > 1))
            if wants_rebatch and self._user_batch_sampler:
                logger.warning("Rebatching is not supported with a batch_sampler: "
                               "using DataLoaderMode.Async without rebatching.")
            elif (wants_rebatch and self._combined_batch_size is not None
                  and self._combined_batch_size > 1):
                worker_size = rebatched_worker_size or self._combined_batch_size
                assert worker_size <= self._combined_batch_size, (
                    f"rebatched_worker_size ({worker_size}) must be <= the combined batch "
                    f"size ({self._combined_batch_size})")
                torch_batch_size = worker_size
                self._rebatched_size = self._combined_batch_size
                torch_drop_last = False
            mode = DataLoaderMode.Async
        self._mode = mode

        # Reproducible shuffling: with a seed, the permutations come from a generator
        # seeded with it (identical in every mode; the generator travels with the sampler
        # to the asynchronous worker). Without a seed, Sync mode keeps torch's behaviour
        # (global RNG at each epoch) and Async mode seeds a generator from the global RNG
        # now (a spawned worker would otherwise always start from torch's default seed).
        if shuffle and not self._is_iterable and kwargs.get("generator") is None:
            seed = None
            if options.exists("random_seed"):
                seed = int(options.random_seed)
            elif mode == DataLoaderMode.Async:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
            if seed is not None:
                generator = torch.Generator()
                generator.manual_seed(seed)
                kwargs["generator"] = generator

        # Rule 8.
        super().__init__(dataset,
                         batch_size=torch_batch_size,
                         shuffle=shuffle,
                         batch_sampler=batch_sampler,
                         num_workers=num_workers,
                         # torch rejects drop_last without automatic batching
                         drop_last=bool(torch_drop_last) and torch_batch_size is not None,
                         persistent_workers=persistent_workers,
                         **kwargs)

        self._progress_bar: Optional[Dict[str, Any]] = (
            None if progress_bar in (False, None)
            else {} if progress_bar is True else dict(progress_bar))

        # Rule 9.
        if mode == DataLoaderMode.Async:
            async_options = dict(async_options or {})
            assert "rebatched_size" not in async_options, (
                "You can't provide a rebatched_size to async_options: use "
                "mode=DataLoaderMode.AsyncRebatched (and rebatched_worker_size) instead")
            accessor = AsynchronousDataAccessor(self, **async_options,
                                                rebatched_size=self._rebatched_size)
            accessor._set_owner(self)  # pylint: disable=protected-access
            self._accessor = accessor

    # ------------------------------------------------------------------ construction
    def _warn_final_batch(self, dataset, batch_sampler, num_processes: int, process_id: int,
                          auto_distributed_partitioning: bool) -> None:
        if self._user_batch_sampler:
            if not hasattr(batch_sampler, "__len__"):
                logger.warning(
                    "The batch_sampler has no __len__: unable to check whether its number "
                    "of batches is divisible by the number of batches combined per step "
                    "(%d) with drop_last=False.", self._batches_to_combine)
                return
            num_batches = len(batch_sampler)
            remainder = num_batches % self._batches_to_combine
            if remainder:
                logger.warning(
                    "The number of batches in the batch_sampler (%d) is not divisible by "
                    "the number of batches combined per step (%d) and drop_last=False: "
                    "the final, smaller batch will combine %d batch(es).", num_batches,
                    self._batches_to_combine, remainder)
            return
        if self._combined_batch_size is None:
            return
        try:
            num_elts = len(dataset)
        except TypeError:
            return
        processes = num_processes if auto_distributed_partitioning else 1
        per_step = self._combined_batch_size * processes
        if num_elts % per_step:
            local = num_elts
            if processes > 1:
                base, rem = divmod(num_elts, processes)
                local = base + (1 if process_id < rem else 0)
            logger.warning(
                "The number of elements in the dataset (%d) is not divisible by the number "
                "of elements processed per step (%d) and drop_last=False: the final, "
                "smaller batch will have a batch size of %d.", num_elts, per_step,
                local % self._combined_batch_size)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self):
        """Pickled state (sent to a spawned asynchronous worker): without the internal
        accessor and torch's persistent worker iterator."""
        state = self.__dict__.copy()
        state["_accessor"] = None
        state["_iterator"] = None
        return state

    # ------------------------------------------------------------------ properties
    @property
    def combinedBatchSize(self) -> Optional[int]:
        """``batch_size × deviceIterations × (replicationFactor // input_group_size) ×
        gradientAccumulation`` (rows of each yielded element), ``None`` if
        ``batch_size`` was ``None``."""
        return self._combined_batch_size

    @property
    def options(self):
        """The (frozen) ``poptorch.Options`` given at construction.

        Raises ``AttributeError`` if the loader was created with ``batch_size=None``
        (a quirk of the reference implementation, reproduced).
        """
        return self._options

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        """Number of elements per epoch.

        With rebatching: ``len(dataset) // combinedBatchSize`` (+1 when ``drop_last`` is
        false and there is a remainder); otherwise torch's length (with a user batch
        sampler that is the sampler's number of batches, as in PopTorch).
        """
        if self._rebatched_size is not None:
            num_elts = len(self.dataset)
            length = num_elts // self._rebatched_size
            if not self._user_drop_last and num_elts % self._rebatched_size:
                length += 1
            return length
        return super().__len__()

    def _sync_iter(self):
        """One epoch of the synchronous pipeline (runs in the asynchronous worker in
        Async mode)."""
        if isinstance(self.dataset, _DistributedSubset):
            if self.dataset.next_epoch() and self.persistent_workers:
                self._iterator = None  # torch workers must see the new permutation
        iterator = super().__iter__()
        if self._user_batch_sampler and self._batches_to_combine > 1:
            return self._recombine(iterator)
        return iterator

    def _recombine(self, iterator):
        group = []
        for batch in iterator:
            group.append(batch)
            if len(group) == self._batches_to_combine:
                yield _concat(group)
                group = []
        if group and not self._user_drop_last:
            yield _concat(group)

    def __iter__(self):
        """Iterate over one epoch of combined batches.

        Reshuffles the distributed partition when applicable; in Async mode returns the
        internal accessor's iterator (elements are views of shared memory, valid until the
        next step); with a user batch sampler concatenates consecutive batches.
        """
        self._epoch_count += 1
        if self._accessor is not None:
            iterator = _OwnedIterator(self, iter(self._accessor))
        else:
            iterator = self._sync_iter()
        if self._progress_bar is not None:
            try:
                total = len(self)
            except TypeError:
                total = None
            kwargs = {"desc": f"Epoch {self._epoch_count}", **self._progress_bar}
            iterator = _ProgressIterator(iterator, total, kwargs)
        return iterator

    def terminate(self) -> None:
        """Stop the asynchronous worker process (no-op in Sync mode). Also called when the
        loader is garbage collected. Follows PopTorch."""
        accessor = getattr(self, "_accessor", None)
        if accessor is not None:
            accessor.terminate()

    def __del__(self):
        """Stop the asynchronous worker when the loader is garbage collected."""
        with contextlib.suppress(Exception):
            self.terminate()
