"""``AsynchronousDataAccessor`` (docs/api-sections.md api §7): loads data in a worker
process into a
ring buffer in shared memory. Follows PopTorch 3.x. The worker and the protocol it shares with this
class are in ``worker.py`` and ``protocol.py``.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import tempfile
import time
import weakref
from multiprocessing import forkserver
from multiprocessing.reduction import ForkingPickler
from typing import Any, Dict, Optional

import torch
import torch.multiprocessing as torch_mp  # noqa: F401  registers torch's tensor reductions
import torch.utils.data

from popart_compiler.errors import py_error
from poptorch._capture import custom_parsers
from poptorch._capture.custom_parsers import getCustomArgParser
from poptorch._data import protocol, worker
from poptorch._data.protocol import (CTRL_SIZE, END, FREE, JOIN_TIMEOUT_S, LIVENESS_PERIOD_S,
                                     MAX_BACKOFF_S, REQ, STATE, STOP, TAG, DatasetPayload,
                                     RemoteTraceback, unpack_exception)
from poptorch._logging import logger
from poptorch.enums import SharingStrategy


__all__ = ["AsynchronousDataAccessor"]


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
        server = forkserver._forkserver  # pylint: disable=protected-access
        if getattr(server, "_forkserver_pid", None) is not None:
            return
        modules = list(getattr(server, "_preload_modules", ["__main__"]))
        for name in ("torch", worker.__name__):
            if name not in modules:
                modules.append(name)
        server.set_forkserver_preload(modules)


class AsynchronousDataAccessor:
    """Loads data in a separate worker **process** into a ring buffer in shared memory.

    Follows PopTorch's ``poptorch.AsynchronousDataAccessor`` (docs/api-sections.md api §7.2).

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
        loader = dataset if isinstance(dataset, protocol.CombinedBatches) else None
        if loader is not None:
            if loader.uses_async_accessor:
                raise py_error(
                    "This poptorch.DataLoader already uses an AsynchronousDataAccessor "
                    "internally (mode=DataLoaderMode.Async): either iterate the DataLoader "
                    "directly or create it with mode=poptorch.DataLoaderMode.Sync.")
            if (not loader.user_batch_sampler
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
        if loader is not None:
            self._rebatch_drop_last = loader.user_drop_last
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

    def hold_owner_weakly(self, loader: "protocol.CombinedBatches") -> None:
        """The :class:`poptorch.DataLoader` that created this accessor for itself is held
        weakly (no reference cycle)."""
        self._owner_ref = weakref.ref(loader)
        self._dataset = None

    # ------------------------------------------------------------------ start / stop
    def _start_worker(self) -> None:
        method = _START_METHODS[self._sharing_strategy]
        if method == "forkserver":
            _prepare_forkserver()
        ctx = torch_mp.get_context(method)
        dataset = self._get_dataset()
        self._ctrl = torch.zeros(CTRL_SIZE, dtype=torch.int64).share_memory_()
        self._slots = torch.zeros((self._buffer_size, 2), dtype=torch.int64).share_memory_()
        self._ctrl_np = self._ctrl.numpy()
        self._slots_np = self._slots.numpy()
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        parsers: Dict[type, Any] = {}
        try:
            if self._sharing_strategy == SharingStrategy.Fork:
                payload = DatasetPayload(obj=dataset)
            elif self._sharing_strategy == SharingStrategy.FileSystem:
                fd, path = tempfile.mkstemp(prefix="poptorch_dataset_", suffix=".pkl")
                self._temp_file = path
                with os.fdopen(fd, "wb") as f:
                    pickle.dump(dataset, f, protocol=pickle.HIGHEST_PROTOCOL)
                payload = DatasetPayload(path=path)
            else:
                payload = DatasetPayload(data=bytes(ForkingPickler.dumps(dataset)))
            if method != "fork":
                # User parsers registered at run time do not exist in a fresh interpreter.
                for arg_type, parser in custom_parsers.registered_parsers().items():
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
                target=worker.worker_main,
                args=(child_conn, parent_conn if method == "fork" else None, self._ctrl,
                      self._slots, payload, settings),
                name="PopTorchAsyncDataWorker",
                daemon=False)
            logger.debug("AsynchronousDataAccessor parent process: %d", os.getpid())
            process.start()
            # PopTorch's debug line: the PID to signal or inspect the worker by.
            logger.debug("AsynchronousDataAccessor worker process: %d", process.pid)
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
            if self._conn.poll(LIVENESS_PERIOD_S):
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
                        f"{type_name}: {message}") from RemoteTraceback(tb)
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
                    self._ctrl_np[STOP] = 1
                process.join(JOIN_TIMEOUT_S)
                if process.is_alive():
                    process.terminate()
                    process.join(JOIN_TIMEOUT_S)
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
        self._ctrl_np[REQ] = self._expected_pass
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
            self._slots_np[self._held, STATE] = FREE
            self._held = None

    def _next_element(self):
        self._release_held()
        slots = self._slots_np
        n = self._buffer_size
        while True:
            r = self._read
            state = self._wait_filled(r)
            tag = slots[r, TAG]
            if tag < self._expected_pass:  # left over from an abandoned pass
                slots[r, STATE] = FREE
                self._read = (r + 1) % n
                continue
            if state == END:
                slots[r, STATE] = FREE
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
        state = slots[r, STATE]
        if state != FREE:
            return state
        delay = 1e-5
        spins = 0
        last_check = time.monotonic()
        while True:
            state = slots[r, STATE]
            if state != FREE:
                return state
            spins += 1
            if spins > 64:
                time.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)
            now = time.monotonic()
            if now - last_check > LIVENESS_PERIOD_S:
                last_check = now
                self._check_worker()

    def _drain_messages(self) -> None:
        """Handle every message the worker has sent so far."""
        while self._conn.poll():
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            self._handle_message(msg)

    def _check_worker(self) -> None:
        """Handle pending messages; raise if the worker reported an error or died."""
        self._drain_messages()
        if not self._process.is_alive():
            # It may have written a last message just before exiting.
            self._drain_messages()
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
            exc = unpack_exception(data, type_name, message)
            self._shutdown_worker()
            self._pass_state = "done"
            raise exc from RemoteTraceback(tb)

    def _wait_for_buffers(self) -> None:
        while self._buffers is None:
            if self._conn.poll(LIVENESS_PERIOD_S):
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


