"""The state of a pipeline across processes, read on demand
(:mod:`popart_compiler.runtime.pipeline`).

A stage updates only what it *owns*: the trainable parameters it reads (a parameter
read by several stages is owned by the first: the others compute the same update),
the buffers it writes and the optimizer state of its parameters. That state stays in
its process: a call moves only activations and gradients. A host read in any process
(``copyWeightsToHost``, an implicit read of the model's weights, ``state_dict()``,
``save``, a checkpoint, the optimizer's state) *fetches* what the other stages of its
pipeline own (:meth:`StateProvider.fetch`): it asks each owner's
:class:`~popart_compiler.runtime.pipeline_service.StateService` (a thread of the owning
process, so the owner's script need not be at the same point: a checkpoint saved by
process 0 alone works) and receives the owner's tensors on a gloo group of its own.

Versions make the copies exact: each process counts the calls it completed and the
host writes of each kind it made (:class:`Version`); a read in a process after call
``N`` and ``w`` writes receives the owner's state after its call ``N`` and ``w``
writes. An owner serves a read from its live tensors, or from a copy it took before
it changed them: before each host write (every kind written), and at the start of each
call the buffers it owns (a forward changes them before the other stages take part).
Weights and optimizer state need no copy at a call's start: a weight update needs
every stage of the pipeline in that call, and a process waiting for a read is in no
call. Copies are dropped when the next call completes (every process of the pipeline
then took part in it, so had finished its reads of the older version).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from popart_compiler.errors import backend_error

__all__ = ["KINDS", "Version", "owned_state", "StateProvider", "Refusal"]

#: What a stage owns, by kind: parameters, buffers it writes, optimizer state.
KINDS = ("weights", "buffers", "optimizer")


@dataclasses.dataclass(frozen=True)
class Version:
    """A point of a process's use of a pipelined model.

    Attributes:
        runs: calls completed.
        writes: host writes of one kind made so far.
    """
    runs: int
    writes: int


class Refusal(Exception):
    """An owner cannot serve a read (the processes made different calls or writes,
    or the owner ended); the text goes to the reader, raised there as an Error."""


def owned_state(program, graph, weights, optimizer=None
                ) -> List[Dict[str, List[torch.Tensor]]]:
    """For each stage, the tensors it owns by kind (:data:`KINDS`), in the same order
    in every process: its trainable parameters (those whose first reader it is), the
    buffers it writes (every replica's copy) and the optimizer state of its
    parameters, less the gradient accumulators (``Accum___``: zero after every weight
    update, so after every call, in every process)."""
    owned: List[Dict[str, List[torch.Tensor]]] = [
        {k: [] for k in KINDS} for _ in range(program.num_units)]
    owner: Dict[str, int] = {}
    for i, name in enumerate(graph.parameters):
        readers = program.units_reading(i)
        if readers:
            owner[name] = readers[0]
            if weights.params[i].requires_grad:
                owned[readers[0]]["weights"].append(weights.params[i])
    for j, name in enumerate(graph.buffers):
        readers = program.units_reading(len(graph.parameters) + j)
        if readers and name in graph.mutated_buffers:
            owned[readers[0]]["buffers"].extend(bufs[j] for bufs in weights.buffers)
    if optimizer is not None:
        for key in sorted(optimizer.state):
            kind, _, name = key.partition("___")
            if name in owner and kind != "Accum":
                owned[owner[name]]["optimizer"].append(optimizer.state[key])
    return owned


def flat_layout(tensors: Sequence[torch.Tensor]) -> List[Tuple[torch.dtype, List[int]]]:
    """How ``tensors`` travel: one flat buffer per dtype (in order of first
    appearance), each the concatenation of the tensors (their indices) of that dtype."""
    groups: Dict[torch.dtype, List[int]] = {}
    for k, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(k)
    return list(groups.items())


def flatten(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """New CPU buffers with the values of ``tensors`` (:func:`flat_layout`)."""
    return [torch.cat([tensors[k].detach().reshape(-1).cpu() for k in indices])
            for _, indices in flat_layout(tensors)]


def unflatten_into(flats: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
    """Write buffers made by :func:`flatten` into ``tensors`` (in place)."""
    with torch.no_grad():
        for flat, (_, indices) in zip(flats, flat_layout(tensors)):
            offset = 0
            for k in indices:
                t = tensors[k]
                t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()


class StateProvider:
    """This process's stage of one pipelined model: what it owns, its version, and
    the copies it keeps for reads of older versions.

    Args:
        key: the model's number, the same in every process (models are created in
            the same order everywhere).
        owned: :func:`owned_state` (every stage's, as held in this process).
        stage: this process's stage.
        describe: ``describe(stage)`` names a stage in messages.

    Attributes:
        runs: calls completed; ``running``: inside a call.
        writes: host writes made, by kind.
        closed: the model was destroyed in this process (its state is still served
            until every process destroyed it).
    """

    def __init__(self, key: int, owned: List[Dict[str, List[torch.Tensor]]], stage: int,
                 describe: Callable[[int], str]):
        self.key = key
        self.owned = owned
        self.stage = stage
        self.describe = describe
        self.runs = 0
        self.running = False
        self.writes: Dict[str, int] = {k: 0 for k in KINDS}
        self.closed = False
        self._copies: Dict[Tuple[int, str, int], List[torch.Tensor]] = {}
        self._cond = threading.Condition()

    def version(self, kind: str) -> Version:
        """This process's version for reads of ``kind``."""
        return Version(self.runs, self.writes[kind])

    def _keep(self, kind: str) -> None:
        """Copy the owned tensors of ``kind`` as they are now (for late readers)."""
        tensors = self.owned[self.stage][kind]
        if tensors:
            self._copies[(self.runs, kind, self.writes[kind])] = flatten(tensors)

    # -- the main thread ----------------------------------------------------------------

    def begin_run(self) -> None:
        """A call starts: keep the owned buffers (its forwards change them first)."""
        with self._cond:
            self._keep("buffers")
            self.running = True
            self._cond.notify_all()

    def end_run(self, completed: bool) -> None:
        """A call ended (``completed``: else rolled back); copies of older versions
        are dropped."""
        with self._cond:
            self.running = False
            if completed:
                self.runs += 1
                self._copies = {k: v for k, v in self._copies.items() if k[0] >= self.runs}
            self._cond.notify_all()

    @contextlib.contextmanager
    def writing(self, kinds: Sequence[str]) -> Iterator[None]:
        """A host write of ``kinds``: the owned tensors are kept first, reads are held
        until it is done."""
        with self._cond:
            for kind in kinds:
                self._keep(kind)
                self.writes[kind] += 1
            try:
                yield
            finally:
                self._cond.notify_all()

    def close(self) -> None:
        """The model was destroyed in this process."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Re-check waiting reads (this process is ending)."""
        with self._cond:
            self._cond.notify_all()

    # -- the service thread -------------------------------------------------------------

    def payload(self, kind: str, wanted: Version, reader: str,
                ending: Callable[[], Optional[str]]) -> List[torch.Tensor]:
        """The owned tensors of ``kind`` at version ``wanted`` (flat CPU buffers);
        waits until this process gets there.

        Args:
            reader: the reading process, for messages.
            ending: ``None``, or how this process is ending (its script finished).

        Raises:
            Refusal: this process will never get there (different calls or host
                writes, or it ended).
        """
        mine = self.describe(self.stage)
        with self._cond:
            while True:
                copy = self._copies.get((wanted.runs, kind, wanted.writes))
                if copy is not None:
                    return copy
                now = self.version(kind)
                if now == wanted and not (self.running and kind == "buffers"):
                    return flatten(self.owned[self.stage][kind])
                ahead = (now.runs, now.writes) > (wanted.runs, wanted.writes)
                behind_in_call = self.running and now.runs == wanted.runs and \
                    now.writes < wanted.writes
                if ahead or behind_in_call:
                    where = "is in call" if self.running else "completed call"
                    raise Refusal(
                        f"{reader} reads the {kind} of {mine} after call {wanted.runs} "
                        f"and {wanted.writes} host writes of them, but the process of that "
                        f"stage {where} {now.runs + self.running} after {now.writes}: "
                        "every process of the pipeline must make the same calls and the "
                        "same host writes (copyWeightsToDevice, loading weights or "
                        "optimizer state) at the same points of the script")
                why = ending() or ("destroyed the model" if self.closed else None)
                if why is not None:
                    raise Refusal(
                        f"{reader} reads the {kind} of {mine} after call {wanted.runs}, "
                        f"but the process of that stage {why} after call {now.runs}: every "
                        "process must make the same calls (and read before it ends)")
                self._cond.wait(timeout=1.0)


def stage_error(text: str):
    """The Error a reader raises for an owner's :class:`Refusal`."""
    return backend_error(f"Reading the state of a pipeline across processes failed: {text}.")
