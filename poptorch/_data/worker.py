"""The worker process of :class:`AsynchronousDataAccessor` (docs/api-sections.md api §7): it runs
the data pipeline and publishes elements in the shared-memory ring buffer described in
:mod:`poptorch._data.protocol`."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import List, Optional

import torch
import torch.utils.data

from popart_compiler.errors import py_error
from poptorch._capture import custom_parsers
from poptorch._data import protocol
from poptorch._data.protocol import (END, FREE, FULL, PARENT_CHECK_PERIOD_S, REQ,
                                     STATE, STOP, TAG, Abandon, Stop, flatten_element,
                                     pack_exception)

__all__ = ["worker_main"]


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
        if self.ctrl[STOP]:
            raise Stop()
        if pass_id is not None and self.ctrl[REQ] > pass_id:
            raise Abandon()
        now = time.monotonic()
        if now - self.last_parent_check > PARENT_CHECK_PERIOD_S:
            self.last_parent_check = now
            # The training process never writes to the pipe: readable means EOF.
            if self.conn.poll():
                raise Stop()

    def linger(self) -> None:
        """After reporting an error: stay alive until told to stop, so that the training
        process can still receive the shared buffers and consume the batches loaded
        before the error (they are delivered first, as in Sync mode)."""
        with contextlib.suppress(Stop):
            while True:
                self.check(None)
                time.sleep(0.005)

    def acquire(self, pass_id: int) -> None:
        """Wait until slot ``w`` is free."""
        while self.slots[self.w, STATE] != FREE:
            self.check(pass_id)
            if self.miss_sleep:
                time.sleep(self.miss_sleep)

    def publish(self, state: int, pass_id: int) -> None:
        self.slots[self.w, TAG] = pass_id
        self.slots[self.w, STATE] = state  # written last: publishes the slot
        self.w = (self.w + 1) % self.num_slots

    # -- main loop -----------------------------------------------------------------
    def run(self) -> None:
        current = 0
        while True:
            self.check(None)
            requested = int(self.ctrl[REQ])
            if requested > current:
                current = requested
            elif self.load_indefinitely and current > 0:
                current += 1
            else:
                time.sleep(max(self.miss_sleep, 0.0005))
                continue
            with contextlib.suppress(Abandon):
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
                    self.publish(FULL, pass_id)
        finally:
            self.iterator = None
        if self.buffers is None:
            raise py_error("The Dataset is empty")
        if fill > 0 and not self.rebatch_drop_last:
            self.rows[self.w, :] = fill
            self.publish(FULL, pass_id)
        self.acquire(pass_id)
        self.publish(END, pass_id)

    # -- data ----------------------------------------------------------------------
    def leaves_of(self, element) -> List[torch.Tensor]:
        kind, leaves, keys = flatten_element(element)
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
                    self.publish(FULL, pass_id)
                    fill = 0
        return fill


def _iterate_source(dataset):
    """One pass over what the accessor wraps: a poptorch DataLoader's synchronous
    pipeline, a map-style dataset with a length but no ``__iter__`` (indices
    ``0..len-1``), or any other iterable."""
    if isinstance(dataset, protocol.CombinedBatches):
        return dataset.sync_iter()
    if (not hasattr(type(dataset), "__iter__") and hasattr(dataset, "__getitem__")
            and hasattr(dataset, "__len__")):
        return (dataset[i] for i in range(len(dataset)))
    return iter(dataset)


def _safe_send(conn, msg) -> None:
    with contextlib.suppress(Exception):
        conn.send(msg)


def _on_sigterm(signum, frame):  # pragma: no cover - runs in the worker
    raise Stop()


def worker_main(conn, inherited_parent_conn, ctrl, slots, payload, settings) -> None:
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
        _safe_send(conn, ("start_failed", ) + pack_exception(exc))
        return
    _safe_send(conn, ("started", os.getpid()))
    try:
        fetcher.run()
    except Stop:
        return  # told to stop, or the training process is gone: a normal exit
    except BaseException as exc:  # pylint: disable=broad-except
        _safe_send(conn, ("error", ) + pack_exception(exc))
        fetcher.linger()
    finally:
        fetcher.iterator = None


