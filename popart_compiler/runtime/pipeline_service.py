"""Reads of another stage's state, across the processes of a pipeline
(:mod:`popart_compiler.runtime.pipeline_state`).

Protocol: the reader pushes a request (its rank, the model's number, the kind, the
version, a tag) on the owner's queue in the rendezvous store
(``Store.queue_push``); the owner's :class:`StateService` thread, waiting on that
queue (``queue_pop``), answers from a thread per request: a header (``0``: the flat
buffers follow; ``1``: refused, the reason in the store) and one flat buffer per
dtype, by ``torch.distributed.send`` on the pipeline's state group (gloo, even when
the run uses NCCL), which the reader receives into its copies. Nothing waits for the
owner's script: the owner may be in its next call, or in a barrier.

A failed or killed owner makes the reader's receive fail within moments, naming it
(:meth:`~popart_compiler.runtime.collectives.ProcessGroup.guard`); an owner that will
never reach the version asked for (different calls or host writes, or its script
ended) refuses at once and the reader raises an Error saying so.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import threading
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from popart_compiler.logging import logger
from popart_compiler.runtime.pipeline_state import (Refusal, StateProvider, Version,
                                                    flat_layout, stage_error,
                                                    unflatten_into)

__all__ = ["StateService", "StateStats", "service", "fetch"]

_QUEUE = "poptorch/state/queue"
_ERROR = "poptorch/state/error"
_CLOSED = "poptorch/state/closed"
_STOP = "stop"
#: The service's queue waits this long before it waits again (no wake-up in between).
_IDLE = datetime.timedelta(days=7)


@dataclasses.dataclass
class StateStats:
    """State moved by host reads in this process.

    Attributes:
        reads: fetches this process made (one per owning stage and kind).
        bytes_received: bytes of other stages' state received.
        served: reads this process answered.
        bytes_sent: bytes of its stage's state it sent.
        seconds: wall-clock seconds this process's host reads waited.
    """
    reads: int = 0
    bytes_received: int = 0
    served: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0


class StateService:
    """This process's answers to other processes' reads of its stages' state (a
    daemon thread, started with the first pipelined model).

    Args:
        group: the run's process group.
    """

    def __init__(self, group):
        self.group = group
        self.stats = StateStats()
        self.ending: Optional[str] = None
        self._providers: Dict[int, StateProvider] = {}
        self._state_groups: Dict[int, object] = {}
        self._cond = threading.Condition()
        self._tags = 0
        listen = _store().clone()
        listen.set_timeout(_IDLE)
        self._thread = threading.Thread(target=self._listen, args=(listen,), daemon=True,
                                        name="poptorch-pipeline-state")
        self._thread.start()
        group.exit_hooks.append(self._on_exit)
        # a group the script created is not shut down by us: stop at exit (a thread
        # inside the store's client when the interpreter ends aborts the process)
        atexit.register(lambda: None if group.owned else self._on_exit("leaving"))

    # -- registry -------------------------------------------------------------------------

    def register(self, provider: StateProvider, state_group) -> None:
        """Serve ``provider``'s state (its readers receive on ``state_group``)."""
        self._release_closed()
        with self._cond:
            self._providers[provider.key] = provider
            self._state_groups[provider.key] = state_group
            self._cond.notify_all()

    def close(self, provider: StateProvider) -> None:
        """The model was destroyed here: served until every process destroyed it."""
        provider.close()
        try:
            _store().add(f"{_CLOSED}/{provider.key}", 1)
        except (RuntimeError, ValueError) as e:
            logger.debug("Could not record a closed pipeline model: %s", e)
        self._release_closed()

    def _release_closed(self) -> None:
        with self._cond:
            closed = [p for p in self._providers.values() if p.closed]
        for p in closed:
            try:
                done = _store().add(f"{_CLOSED}/{p.key}", 0) >= self.group.size
            except (RuntimeError, ValueError):
                done = False
            if done:
                with self._cond:
                    self._providers.pop(p.key, None)
                    self._state_groups.pop(p.key, None)

    def _on_exit(self, phase: str) -> None:
        """This process's script ended (``"ending"``): reads it can no longer answer
        are refused; it leaves the run (``"leaving"``): the service stops."""
        self.ending = "ended its script"
        with self._cond:
            providers = list(self._providers.values())
            self._cond.notify_all()
        for p in providers:
            p.wake()
        if phase == "leaving" and self._thread.is_alive():
            try:
                _store().queue_push(f"{_QUEUE}/{self.group.rank}", _STOP)
            except (RuntimeError, ValueError) as e:  # the store has gone: so has the wait
                logger.debug("Stopping the pipeline state service: %s", e)
            self._thread.join(timeout=5.0)

    # -- answering ------------------------------------------------------------------------

    def _listen(self, store) -> None:
        key = f"{_QUEUE}/{self.group.rank}"
        while True:
            try:
                item = store.queue_pop(key, True)
            except (RuntimeError, ValueError) as e:  # the store has gone: the run ended
                logger.debug("Pipeline state service stops: %s", e)
                return
            if item == _STOP.encode():
                return
            threading.Thread(target=self._answer, args=(json.loads(item),), daemon=True,
                             name="poptorch-pipeline-read").start()

    def _provider(self, key: int) -> Optional[StateProvider]:
        with self._cond:
            while key not in self._providers and self.ending is None:
                self._cond.wait(timeout=1.0)
            return self._providers.get(key)

    def _answer(self, request: dict) -> None:
        reader, tag = int(request["reader"]), int(request["tag"])
        who = self.group.name(reader)
        provider = self._provider(int(request["key"]))
        flats: List[torch.Tensor] = []
        status = 0
        try:
            if provider is None:
                raise Refusal(f"{who} reads the state of a pipelined model that "
                              f"{self.group.name()} never created or already released "
                              "(every process must create the same models in order)")
            flats = provider.payload(request["kind"], Version(*request["version"]), who,
                                     lambda: self.ending)
        except Refusal as e:
            status = 1
            try:
                _store().set(f"{_ERROR}/{reader}/{tag}", str(e))
            except (RuntimeError, ValueError) as err:
                logger.debug("Could not record a refused read: %s", err)
        group = self._state_groups.get(int(request["key"]))
        try:
            dist.send(torch.tensor([status], dtype=torch.int64), reader, group=group, tag=tag)
            for flat in flats:
                dist.send(flat, reader, group=group, tag=tag)
            self.stats.served += 1
            self.stats.bytes_sent += sum(f.numel() * f.element_size() for f in flats)
        except (RuntimeError, ValueError) as e:  # the reader failed: it reports it
            logger.debug("Could not answer a read of the pipeline state: %s", e)

    # -- reading --------------------------------------------------------------------------

    def next_tag(self) -> int:
        """A tag of this process's next request (unique per reader)."""
        self._tags = self._tags % (1 << 30) + 1
        return self._tags


_SERVICE: List[Optional[StateService]] = [None]


def _store():
    """The run's rendezvous store (never kept: it must go with the process group)."""
    return dist.distributed_c10d._get_default_store()


def service(group) -> StateService:
    """This process's :class:`StateService` (created for the run's group at first use)."""
    current = _SERVICE[0]
    if current is None or current.group is not group:
        current = StateService(group)
        _SERVICE[0] = current
    return current


def fetch(provider: StateProvider, mesh, state_group, wanted: Iterable[Tuple[int, str]],
          fetched: Dict[tuple, Version]) -> None:
    """Bring the ``(stage, kind)`` state in ``wanted`` that the other stages of this
    process's pipeline own into this process's copies (as of this process's
    version), asking every owner at once. ``fetched`` records what was fetched at
    which version (not asked again until the version changes).

    Raises:
        Error: an owner refused (different calls or host writes, or it ended), or
            failed.
    """
    group = mesh.group
    svc = service(group)
    pending = []
    for stage, kind in sorted(wanted):
        version = provider.version(kind)
        if stage == provider.stage or not provider.owned[stage][kind] or \
                fetched.get((stage, kind)) == version:
            continue
        tag = svc.next_tag()
        owner = mesh.rank_of(stage)
        request = {"reader": group.rank, "key": provider.key, "kind": kind,
                   "version": [version.runs, version.writes], "tag": tag}
        _store().queue_push(f"{_QUEUE}/{owner}", json.dumps(request))
        pending.append((stage, kind, owner, tag, version))
    refused = None
    for stage, kind, owner, tag, version in pending:  # every answer, even after a refusal
        tensors = provider.owned[stage][kind]
        what = f"read of the {kind} of {provider.describe(stage)}"
        header = torch.zeros(1, dtype=torch.int64)
        group.guard(what, lambda: dist.recv(header, owner, group=state_group, tag=tag))
        if int(header[0]) != 0:
            refused = refused or _store().get(f"{_ERROR}/{group.rank}/{tag}").decode(
                errors="replace")
            continue
        flats = [torch.empty(sum(tensors[k].numel() for k in indices), dtype=dtype)
                 for dtype, indices in flat_layout(tensors)]
        for flat in flats:
            group.guard(what, lambda flat=flat: dist.recv(flat, owner, group=state_group,
                                                          tag=tag))
        if refused is None:
            unflatten_into(flats, tensors)
            fetched[(stage, kind)] = version
        svc.stats.reads += 1
        svc.stats.bytes_received += sum(f.numel() * f.element_size() for f in flats)
    if refused is not None:
        raise stage_error(refused)
