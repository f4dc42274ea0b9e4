"""Communication between the processes of a multi-process run (docs/semantics.md S-28).

Processes are replica groups: each runs ``R`` local replicas, and the global replication
factor is ``R × num_processes``. Everything that crosses process boundaries goes
through ``torch.distributed`` (gloo on the CPU, NCCL when the session runs on CUDA),
launched by ``torchrun`` / ``poprun`` or by the user; nothing here opens sockets itself.

A training session exchanges, at compile, a signature of the program and options
(``all_gather_object``: processes compiled differently fail naming the difference) and
process 0's weights, buffers and optimizer state (``broadcast``); at every weight update,
the sum over processes of the locally summed gradients (one flat ``all_reduce`` per dtype).

Every collective is bounded by the collective timeout (``POPTORCH_DISTRIBUTED_TIMEOUT``
seconds, default :data:`DEFAULT_TIMEOUT_S`, read when this module creates the process
group). A peer that died, raised or stopped participating makes the collective fail, and
the failure is re-raised as a ``poptorch.Error`` that says so.

A process that leaves with an error records how it ended (:mod:`.exit_status`: its
exit status and whether it raised) in the rendezvous store and closes its connections
at once instead of waiting in the exit barrier: "process <i> of <n> ended with
<exception> (uncaught, exit status 1)" (``sys.excepthook``, KeyboardInterrupt
included), "... exited with status 1 (sys.exit(1)) after catching <exception>" (at
exit, for any non-zero status), "... exited with status 3 (os._exit(3))". The others'
pending or next collective fails within moments, naming it. A killed process closes its
connections too; only one that stops participating without ending is detected by the
collective timeout. Hooks (:attr:`ProcessGroup.exit_hooks`) run when a process's
script ends and before it leaves the run.

A process whose script ends normally (status 0) records its exit in the store and
waits (at most the collective timeout, polling the store) until every process recorded its
own; when one waits in a pipeline call this process never made (each pipeline call is
counted in the store), it leaves at once recording "process <i> of <n> ended normally
(its script finished, exit status 0) after <k> pipeline calls while ... waits in
pipeline call <k+1>". Joining is bounded by the join timeout (:mod:`.rendezvous`).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from popart_compiler import config
from popart_compiler.config import TIMEOUT_ENV
from popart_compiler.errors import backend_error
from popart_compiler.logging import logger
from popart_compiler.runtime import exit_status, rendezvous
from popart_compiler.runtime.signature import program_signature, signature_differences

__all__ = ["ProcessGroup", "process_group", "program_signature", "collective_timeout",
           "backend_for", "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S"]

#: Collective timeout (seconds) when :data:`TIMEOUT_ENV` is not set.
DEFAULT_TIMEOUT_S = float(config.VARIABLES[TIMEOUT_ENV].default)


def collective_timeout() -> datetime.timedelta:
    """The collective timeout: ``POPTORCH_DISTRIBUTED_TIMEOUT`` seconds (default 300).

    Raises:
        Error: the variable is not a positive number.
    """
    text = config.collective_timeout_text()
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise backend_error(f"{TIMEOUT_ENV}={text!r} is not a valid timeout: give a "
                            "positive number of seconds.")
    return datetime.timedelta(seconds=seconds)


def backend_for(device: str) -> str:
    """``"nccl"`` when the session runs on CUDA, else ``"gloo"``."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def _check_launcher(rank: int, size: int) -> None:
    """Under torchrun (or poprun, which runs it) the launcher started ``WORLD_SIZE``
    processes: options that say otherwise would wait for processes that never come
    until the rendezvous timeout, so fail at once naming both."""
    env = config.launcher()
    if not env["run_id"]:
        return
    with contextlib.suppress(ValueError):
        launched = (int(env["rank"] or rank), int(env["world_size"] or size))
        if launched != (rank, size):
            raise backend_error(
                f"The launcher (torchrun) started this process as process {launched[0]} "
                f"of {launched[1]} (RANK / WORLD_SIZE) but the options say process {rank} "
                f"of {size}: make Options.Distributed.configureProcessId(id, n) match "
                "the launcher, or leave it to the launcher's RANK / WORLD_SIZE.")


class ProcessGroup:
    """This process's view of the processes of a distributed run.

    Initialises the default ``torch.distributed`` process group if the user has not
    (the processes meet in the store at ``MASTER_ADDR:MASTER_PORT``, as under
    ``torchrun``, else ``127.0.0.1:29500``, within the join timeout: see
    :mod:`.rendezvous`), or reuses theirs.

    Args:
        process_id: this process's index ``0 ≤ process_id < num_processes``.
        num_processes: number of processes (``> 1``).
        device: where the session runs (``"cpu"`` or ``"cuda"``): picks gloo or NCCL.

    Attributes:
        stats: ``all_reduce_calls``, ``all_reduce_bytes`` and ``all_reduce_seconds``
            spent in gradient reductions by this process so far.

    Raises:
        Error: ``torch.distributed`` is unavailable; an existing process group whose
            rank or size differs from ``process_id`` / ``num_processes``; the
            rendezvous failed, or a process did not join within the join timeout.
    """

    def __init__(self, process_id: int, num_processes: int, device: str = "cpu"):
        if not dist.is_available():
            raise backend_error("Multi-process execution needs torch.distributed, which "
                                "this build of PyTorch does not provide.")
        self.rank = int(process_id)
        self.size = int(num_processes)
        self.owned = False
        self.failed: Optional[str] = None
        #: pipeline calls this process started (:meth:`begin_call`)
        self.calls = 0
        #: called with ``"ending"`` when this process's script ends, before it waits
        #: for the others (:meth:`shutdown`), and with ``"leaving"`` before the group
        #: is destroyed (the pipeline state service stops its threads then)
        self.exit_hooks: List[Callable[[str], None]] = []
        #: what this process does in the run (" (pipeline stage 1 of 2 (IPU 1))"),
        #: part of every error message that names it
        self.role = ""
        #: the collective timeout; also the longest wait for the others at exit
        self.timeout = collective_timeout()
        self.stats: Dict[str, float] = {"all_reduce_calls": 0, "all_reduce_bytes": 0,
                                        "all_reduce_seconds": 0.0}
        if dist.is_initialized():
            rank, size = dist.get_rank(), dist.get_world_size()
            if (rank, size) != (self.rank, self.size):
                raise backend_error(
                    f"The torch.distributed process group has rank {rank} of {size} "
                    f"processes but the options say process {self.rank} of {self.size}: "
                    "make Options.Distributed.configureProcessId(id, n) match the "
                    "process group (or leave it to the launcher's RANK / WORLD_SIZE).")
            self.backend = str(dist.get_backend())
            rendezvous.joined()
            atexit.register(self.shutdown)
            _install_exit_hooks()
            self.set_role("")
            return
        _check_launcher(self.rank, self.size)
        self.backend = backend_for(device)
        timeout = self.timeout
        join = rendezvous.join_timeout(timeout)
        env = config.launcher()
        if self.backend == "nccl" and env["local_rank"]:
            torch.cuda.set_device(int(env["local_rank"]))
        host, port = rendezvous.address()
        logger.info("Initialising the torch.distributed process group: %s, process %d "
                    "of %d, rendezvous %s:%d, join timeout %g s, collective timeout %g s",
                    self.backend, self.rank, self.size, host, port,
                    join.total_seconds(), timeout.total_seconds())
        store = rendezvous.join(self.rank, self.size, join)
        try:
            dist.init_process_group(self.backend, store=store, rank=self.rank,
                                    world_size=self.size, timeout=timeout)
        except (RuntimeError, ValueError) as e:
            raise backend_error(
                f"Process {self.rank} of {self.size} could not join the other processes "
                f"(rendezvous {host}:{port}, timeout {timeout.total_seconds():g} s set by "
                f"{TIMEOUT_ENV}): {e}. Start every process (torchrun or poprun does) with "
                "the same MASTER_ADDR / MASTER_PORT.") from None
        self.owned = True
        atexit.register(self.shutdown)
        _install_exit_hooks()
        self.set_role("")

    def shutdown(self) -> None:
        """Leave the run cleanly (at exit, for a group this process created): record
        in the rendezvous store that this process ended normally after its calls, wait
        (at most the collective timeout) until every process got here, then destroy the
        group, so that no process closes its connections while another still uses
        them (gloo aborts the process then). A process found waiting in a later
        pipeline call than this one's last (mismatched calls) will never get here:
        this process then leaves at once, recording why, and that process's call
        fails naming this one (see :meth:`leave`). A process that ends with an error
        (a non-zero exit status, :mod:`.exit_status`) leaves at once, recording it,
        also from a group the script created, and destroys that group, as one whose
        group failed does (see :meth:`leave`)."""
        if not dist.is_initialized():
            return
        if self.failed is not None:  # a broken group, also the script's: close it now
            _destroy_at_exit()
            return
        end = exit_status.ending()
        if end.failed:  # sys.exit(1) after catching its error: leave as if it raised
            self.leave(f"{self.name()} {end.describe()}", at_exit=True)
            return
        if not self.owned:  # the script's own group: it leaves the run itself
            return
        self._run_hooks("ending")
        mismatch = self._wait_for_exits(end)
        if mismatch is not None:
            self.leave(mismatch)
            return
        self.owned = False
        self._run_hooks("leaving")
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError, AssertionError) as e:
            logger.debug("Leaving the distributed run: %s", e)

    def _run_hooks(self, phase: str) -> None:
        """Call :attr:`exit_hooks` with ``phase`` (``"leaving"``: only once)."""
        hooks = self.exit_hooks
        if phase == "leaving":
            self.exit_hooks = []
        for hook in hooks:
            hook(phase)

    def begin_call(self) -> None:
        """A pipeline call starts: count it, in the store too, so that a process that
        ends its script after fewer calls can tell that this one waits for it."""
        self.calls += 1
        try:
            dist.distributed_c10d._get_default_store().set(
                f"{_CALLS_KEY}/{self.rank}", str(self.calls))
        except (RuntimeError, ValueError) as e:
            logger.debug("Could not record the call in the store: %s", e)

    def _wait_for_exits(self, end: exit_status.Ending) -> Optional[str]:
        """Record this process's exit and wait until every process recorded its own.
        Returns what to record for the others when one of them waits in a call this
        process never makes (or did not get here within the collective timeout), else
        ``None``."""
        calls = f"{self.calls} pipeline call{'s' if self.calls != 1 else ''}"
        ended = f"{self.name()} {end.describe()} after {calls}"
        barrier = self.timeout.total_seconds()
        deadline = time.monotonic() + barrier
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{_EXIT_KEY}/{self.rank}", str(self.calls))
            others = [r for r in range(self.size) if r != self.rank]
            while others:
                if store.check([_FAILURE_KEY]):
                    return None
                others = [r for r in others if not store.check([f"{_EXIT_KEY}/{r}"])]
                for r in others:
                    key = f"{_CALLS_KEY}/{r}"
                    theirs = int(store.get(key)) if store.check([key]) else 0
                    if theirs > self.calls:
                        return (f"{ended} while {self.name(r)} waits in pipeline call "
                                f"{theirs}: every process of the pipeline must make the "
                                "same calls (the same training / inference steps), "
                                "mismatched calls leave the others waiting")
                if others and time.monotonic() > deadline:
                    return (f"{ended} and left after waiting {barrier:g} s for "
                            f"{' and '.join(self.name(r) for r in others)} to end: every "
                            "process must make the same calls")
                if others:
                    time.sleep(0.05)
        except (RuntimeError, ValueError) as e:  # the store's host has gone: it ended
            logger.debug("Waiting for the other processes to end: %s", e)
        return None

    def name(self, rank: Optional[int] = None) -> str:
        """``"process 1 of 2"`` and its role, e.g. ``"process 1 of 2 (pipeline stage 1
        of 2 (IPU 1))"``, for this process or another one."""
        if rank is None or rank == self.rank:
            return f"process {self.rank} of {self.size}{self.role}"
        info = self._process_info(rank)
        role = info[2] if info is not None else ""
        return f"process {rank} of {self.size}{role}"

    def set_role(self, role: str) -> None:
        """Record this process's role, host and pid in the rendezvous store, so that
        the others can name it, and tell whether it died, when it stops (see
        :meth:`_failure_report`)."""
        self.role = f" ({role})" if role else ""
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{_PROCESS_KEY}/{self.rank}",
                      f"{socket.gethostname()}\n{os.getpid()}\n{self.role}")
        except (RuntimeError, ValueError) as e:
            logger.debug("Could not record this process in the store: %s", e)

    def _process_info(self, rank: int) -> Optional[List[str]]:
        """``[host, pid, role]`` that process ``rank`` recorded, or ``None``."""
        try:
            store = dist.distributed_c10d._get_default_store()
            key = f"{_PROCESS_KEY}/{rank}"
            if not store.check([key]):
                return None
            parts = store.get(key).decode(errors="replace").split("\n", 2)
            return parts if len(parts) == 3 else None
        except (RuntimeError, ValueError):
            return None

    def _dead_processes(self) -> List[int]:
        """The other processes on this host that have ended (a killed process
        leaves no record of its own)."""
        host = socket.gethostname()
        dead = []
        for rank in range(self.size):
            info = None if rank == self.rank else self._process_info(rank)
            if info is not None and info[0] == host and info[1].isdigit() and \
                    not _alive(int(info[1])):
                dead.append(rank)
        return dead

    def leave_after_error(self, what: str) -> None:
        """This process ends with an uncaught error: record ``what`` in the rendezvous
        store for the other processes and leave (see :meth:`leave`)."""
        if self.failed is not None or not dist.is_initialized():
            return
        self.leave(f"{self.name()} ended with {what}")

    def leave(self, record: str, at_exit: bool = False) -> None:
        """Record ``record`` ("process 1 of 2 ended with ...") in the rendezvous store
        for the other processes (the first record wins) and close this process's
        connections (for a group it created, and at exit, ``at_exit``, also for the
        script's own group) so that their collectives fail now rather than after the
        collective timeout. A gloo group left to interpreter finalization can abort
        the process ("terminate called without an active exception", PyTorch issue
        190489): the exit status the others are told would then be wrong."""
        if self.failed is not None or not dist.is_initialized():
            return
        self.failed = record
        try:
            store = dist.distributed_c10d._get_default_store()
            store.compare_set(_FAILURE_KEY, "", record)
        except (RuntimeError, ValueError) as e:  # the store's host has gone
            logger.debug("Could not record the failure in the store: %s", e)
        if not (self.owned or at_exit):
            return
        self.owned = False
        self._run_hooks("leaving")
        try:
            store = dist.distributed_c10d._get_default_store()
            dist.destroy_process_group()
            if self.rank == 0 and config.launcher()["agent_store"] != "True":
                # this process hosts the store: let the others read it
                deadline = time.monotonic() + _FAILURE_READ_S
                while store.add(_SEEN_KEY, 0) < self.size - 1 and \
                        time.monotonic() < deadline:
                    time.sleep(0.05)
        except (RuntimeError, ValueError, AssertionError) as e:
            logger.debug("Leaving the distributed run after an error: %s", e)

    def _failure_report(self) -> Optional[str]:
        """What another process recorded about its failure: ``"process 1 of 2 ended
        with ..."``, ``None`` when none did, or a note that the store is gone."""
        try:
            store = dist.distributed_c10d._get_default_store()
            # a killed process closes its connections a moment before it is gone
            deadline = time.monotonic() + _DEATH_S
            dead = []
            while not store.check([_FAILURE_KEY]) and not dead and \
                    time.monotonic() < deadline:
                dead = self._dead_processes()
                time.sleep(0 if dead else 0.05)
            if not store.check([_FAILURE_KEY]):
                if not dead:
                    return None
                # no record: a killed process; name it for every process that asks
                store.compare_set(_FAILURE_KEY, "", " and ".join(
                    self.name(r) for r in dead) + " ended without reporting an error "
                    "(killed, or exited from another thread or with os._exit)")
            report = store.get(_FAILURE_KEY).decode(errors="replace")
            store.add(_SEEN_KEY, 1)
            return report[:1].upper() + report[1:]
        except (RuntimeError, ValueError) as e:
            return ("The rendezvous store is unreachable: the process that hosts it "
                    f"(process 0 unless a launcher hosts it) has ended ({e})")

    # -- collectives ------------------------------------------------------------------

    def guard(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, which communicates with the other processes (on any group of
        the run); a failure becomes an ``Error`` that names the process that failed
        first and what it said (see :meth:`_collective`).

        Args:
            what: the operation, for the message ("pipeline step", ...).
        """
        return self._collective(what, fn)

    def _collective(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; turn a failure into an ``Error`` and shut the group down (if we
        created it) so that the process can exit cleanly."""
        if self.failed is not None:
            raise backend_error(
                f"Distributed {what} impossible: the process group failed earlier "
                f"({self.failed}). Restart all processes.")
        try:
            return fn()
        except (RuntimeError, ValueError) as e:  # DistBackendError is a RuntimeError
            self.failed = what
            report = self._failure_report()
            self._run_hooks("leaving")
            if self.owned:
                try:
                    dist.destroy_process_group()
                except (RuntimeError, ValueError, AssertionError) as shutdown:
                    logger.debug("destroy_process_group after a failure: %s", shutdown)
            cause = report or (
                "another process died, raised an error or did not reach the same point "
                f"within the collective timeout ({self.timeout.total_seconds():g} s, set "
                f"by {TIMEOUT_ENV}, default {DEFAULT_TIMEOUT_S:.0f} s); no process "
                "recorded an error, so one was killed or stopped participating")
            raise backend_error(
                f"Distributed {what} failed in {self.name()}: "
                f"{cause}. Check the other processes' output. torch.distributed said: "
                f"{str(e).strip()[:400]}") from None

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor],
                       group: Optional[Any] = None) -> List[torch.Tensor]:
        """Sum ``tensors`` over all processes, or over the processes of ``group`` (a
        ``torch.distributed`` group; every process of it passes the same list of
        shapes and dtypes, e.g. one summed gradient per parameter).

        The tensors are flattened into one buffer per dtype, so a weight update costs
        one ``all_reduce`` of ``Σ numel × itemsize`` bytes per dtype.

        Returns:
            New tensors with the sums, in the order, shapes and dtypes given.

        Raises:
            Error: a peer failed or timed out.
        """
        out: List[Optional[torch.Tensor]] = [None] * len(tensors)
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        start = time.perf_counter()
        for dtype, indices in by_dtype.items():
            parts = [tensors[i].detach().reshape(-1) for i in indices]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
            device = flat.device
            if self.backend == "gloo" and device.type != "cpu":
                flat = flat.cpu()
            self._collective("all_reduce of gradients",
                             lambda: dist.all_reduce(flat, group=group))
            self.stats["all_reduce_calls"] += 1
            self.stats["all_reduce_bytes"] += flat.numel() * flat.element_size()
            flat = flat.to(device)
            offset = 0
            for i in indices:
                n = tensors[i].numel()
                out[i] = flat[offset:offset + n].view(tensors[i].shape)
                offset += n
        self.stats["all_reduce_seconds"] += time.perf_counter() - start
        return out  # type: ignore[return-value]

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0,
                   group: Optional[Any] = None,
                   what: str = "broadcast of the weights of process 0") -> None:
        """Overwrite ``tensors`` (in place) with process ``src``'s values (``src`` is a
        global rank; ``group``: only its processes take part); one ``broadcast`` per
        dtype.

        Raises:
            Error: a peer failed or timed out.
        """
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same_dtype])
            device = flat.device
            if self.backend == "gloo" and device.type != "cpu":
                flat = flat.cpu()
            self._collective(what, lambda: dist.broadcast(flat, src, group=group))
            flat = flat.to(device)
            offset = 0
            with torch.no_grad():
                for t in same_dtype:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()

    def check_consistent(self, signature: Dict[str, str]) -> None:
        """Raise in every process if the processes' signatures differ.

        Args:
            signature: ``{what: value}`` describing this process's compilation (options,
                micro-batch input shapes, parameters, a hash of the program).

        Raises:
            Error: the signatures differ; the message lists each differing entry with
                its value in process 0 and in the first process that differs.
        """
        gathered: List[Any] = [None] * self.size
        self._collective("comparison of the compiled programs",
                         lambda: dist.all_gather_object(gathered, dict(signature)))
        differences = signature_differences(gathered)
        if differences:
            raise backend_error(
                "The processes of this distributed run compiled different programs: "
                + "; ".join(differences) + ". Every process must run the same model with the "
                "same options (replicationFactor, deviceIterations, gradientAccumulation, "
                "optimizer) and the same micro-batch size.")


_GROUP: Optional[ProcessGroup] = None
#: Rendezvous-store key of the first failure a process recorded, and the counter of
#: processes that read it.
_FAILURE_KEY = "poptorch/failure"
_SEEN_KEY = "poptorch/failure_seen"
#: Rendezvous-store key prefixes of each process's pipeline calls started so far and
#: of its normal exit (:meth:`ProcessGroup.shutdown`).
_CALLS_KEY = "poptorch/calls"
_EXIT_KEY = "poptorch/exited"
#: Longest wait (seconds) for a peer whose connections closed to be gone or say why.
_DEATH_S = 2.0
#: Longest time (seconds) a failed process hosting the store keeps it for the others
#: (it leaves as soon as every other process has read the failure; 5 s was too short
#: for a peer on a loaded machine, which then only saw the store gone).
_FAILURE_READ_S = 15.0
#: Rendezvous-store key prefix of each process's host, pid and role.
_PROCESS_KEY = "poptorch/process"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host is running (a zombie is not)."""
    with contextlib.suppress(OSError):  # without /proc, ask the kernel below
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _destroy_at_exit() -> None:
    """Destroy the default process group while the interpreter is whole (see
    :meth:`ProcessGroup.leave`); errors are only logged: the process is ending."""
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError) as e:
        logger.debug("Destroying the process group at exit: %s", e)


def _install_exit_hooks() -> None:
    """Follow how this process ends (:mod:`.exit_status`): an uncaught exception makes
    it leave the run at once, after the traceback is printed, and ``os._exit`` records
    how it ended for the others before the process goes."""
    exit_status.install()
    exit_status.listen(_on_end)


def _on_end(end: exit_status.Ending) -> None:
    """This process ends now (an uncaught exception, or ``os._exit``): tell the
    others how (see :meth:`ProcessGroup.leave_after_error`)."""
    group = _GROUP
    if group is None or group.failed is not None or not dist.is_initialized():
        return
    record = f"{group.name()} {end.describe()}"
    if end.via == "exception":
        group.leave(record, at_exit=True)
    else:  # os._exit, any status: the connections close with the process
        group.failed = record
        with contextlib.suppress(RuntimeError, ValueError):
            dist.distributed_c10d._get_default_store().compare_set(_FAILURE_KEY, "", record)


def process_group(process_id: int, num_processes: int, device: str = "cpu"
                  ) -> ProcessGroup:
    """The process group of this process, created on first use (see
    :class:`ProcessGroup`); later sessions reuse it.

    Raises:
        Error: see :class:`ProcessGroup`; also when a later session asks for a
            different process id or count.
    """
    global _GROUP
    group = _GROUP
    if group is not None and group.failed is None and dist.is_initialized():
        if (group.rank, group.size) != (process_id, num_processes):
            raise backend_error(
                f"This process already joined a distributed run as process {group.rank} "
                f"of {group.size}; a session asked for process {process_id} of "
                f"{num_processes}. Use the same Options.Distributed in every model.")
        return group
    _GROUP = ProcessGroup(process_id, num_processes, device)
    return _GROUP
