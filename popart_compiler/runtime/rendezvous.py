"""Joining a run (see :mod:`.collectives`): the processes meet in a rendezvous store,
polled here, before ``init_process_group`` connects them, so that the whole join is
bounded by the join timeout (``POPTORCH_DISTRIBUTED_JOIN_TIMEOUT`` seconds, by default
the collective timeout ``POPTORCH_DISTRIBUTED_TIMEOUT``) and a process that does not
come is named.

The store is the one torchrun's agent hosts for the whole run (alive whichever worker
ends) under torchrun, else one that process 0 hosts at ``MASTER_ADDR:MASTER_PORT``
(``127.0.0.1:29500`` when unset), as ``env://`` does.

Under torchrun, a process that ends its script without ever joining the run (it made
none of the pipeline or distributed training calls the others make) records how it
ended (:mod:`.exit_status`) in the agent's store at exit; a process that comes to join
then fails at once naming it and its exit status, instead of waiting until the join
timeout.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import time
from typing import List, Optional, Tuple

import torch.distributed as dist

from popart_compiler import config
from popart_compiler.config import JOIN_TIMEOUT_ENV, TIMEOUT_ENV
from popart_compiler.errors import backend_error
from popart_compiler.logging import logger
from popart_compiler.runtime import exit_status

__all__ = ["join", "join_timeout", "joined", "address", "wait_for_peers"]

_DEFAULT_ADDR = "127.0.0.1"
_DEFAULT_PORT = "29500"


def join_timeout(collective: datetime.timedelta) -> datetime.timedelta:
    """The join timeout: ``POPTORCH_DISTRIBUTED_JOIN_TIMEOUT`` seconds, or
    ``collective`` (the collective timeout) when it is unset.

    Raises:
        Error: the variable is not a positive number.
    """
    text = config.text(JOIN_TIMEOUT_ENV)
    if not text:
        return collective
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise backend_error(f"{JOIN_TIMEOUT_ENV}={text!r} is not a valid timeout: give a "
                            "positive number of seconds, or unset it to use "
                            f"{TIMEOUT_ENV}.")
    return datetime.timedelta(seconds=seconds)


def address() -> Tuple[str, int]:
    """The rendezvous store's host and port: ``MASTER_ADDR`` / ``MASTER_PORT``, else
    ``127.0.0.1:29500``."""
    env = config.launcher()
    if env["master_addr"] and env["master_port"]:
        return env["master_addr"], int(env["master_port"])
    return _DEFAULT_ADDR, int(_DEFAULT_PORT)


def _agent_store(timeout: datetime.timedelta):
    """A client of the store that torchrun's agent hosts for the whole run (alive
    whichever worker ends), or ``None`` when there is none."""
    env = config.launcher()
    if env["agent_store"] != "True" or not (env["master_addr"] and env["master_port"]):
        return None
    return dist.TCPStore(env["master_addr"], int(env["master_port"]), is_master=False,
                         timeout=timeout)


def _run_key(what: str, rank: int) -> str:
    """A key of this run's attempt (torchrun restarts keep the agent's store)."""
    return f"poptorch/{config.text('TORCHELASTIC_RESTART_COUNT') or 0}/{what}/{rank}"


def _seconds(timeout: datetime.timedelta) -> str:
    return f"{timeout.total_seconds():g} s (the join timeout: {JOIN_TIMEOUT_ENV}, else " \
           f"{TIMEOUT_ENV})"


def _connect(rank: int, size: int, timeout: datetime.timedelta):
    """The rendezvous store (see the module's text), reached within ``timeout``."""
    host, port = address()
    try:
        store = _agent_store(timeout)
        if store is None:
            store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout,
                                  wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, ValueError) as e:
        raise backend_error(
            f"Process {rank} of {size} could not join the other processes: the "
            f"rendezvous store at {host}:{port} "
            f"{'was not reachable' if rank else 'could not be opened'} within "
            f"{_seconds(timeout)}: {str(e).strip()[:300]}. Start every process (torchrun "
            "or poprun does) with the same MASTER_ADDR / MASTER_PORT, a port no other "
            "run uses.") from None
    return store


def join(rank: int, size: int, timeout: datetime.timedelta):
    """Meet the other processes in the rendezvous store, polling it, within
    ``timeout``; returns the store for ``init_process_group`` (keys under
    ``default_pg/``, as ``env://`` gives them).

    Raises:
        Error: the store is unreachable; another process ended without joining
            (under torchrun), naming it and how it ended; or did not come within
            ``timeout``, naming it.
    """
    joined()
    deadline = time.monotonic() + timeout.total_seconds()
    store = _connect(rank, size, timeout)
    wait_for_peers(rank, size, timeout, store=store, deadline=deadline)
    return dist.PrefixStore("default_pg", store)


def wait_for_peers(rank: int, size: int, timeout: datetime.timedelta, store=None,
                   deadline: Optional[float] = None) -> None:
    """Say in ``store`` (default: torchrun's agent store; without one, return at
    once) that this process joins, and poll it until every process said so.

    Args:
        timeout: the join timeout, for the message.
        deadline: ``time.monotonic()`` when to give up (default: ``timeout`` from now).

    Raises:
        Error: another process ended without joining (recorded under torchrun),
            naming it and how it ended; or did not come before ``deadline``.
    """
    if deadline is None:
        deadline = time.monotonic() + timeout.total_seconds()
    if store is None:
        try:
            store = _agent_store(datetime.timedelta(seconds=10))
        except (RuntimeError, ValueError) as e:
            raise backend_error(f"Process {rank} of {size} could not reach torchrun's "
                                f"store: {str(e).strip()[:300]}") from None
        if store is None:
            return
    store.set(_run_key("joining", rank), "1")
    waiting = [r for r in range(size) if r != rank]
    while waiting:
        ended = [r for r in waiting if store.check([_run_key("ended", r)])]
        if ended:
            raise backend_error(
                f"Process {rank} of {size} could not join the other processes: "
                + " and ".join(_ended(store, r, size) for r in ended) + " without joining "
                "the run, i.e. without making the pipeline (or distributed training) "
                "calls this process makes: every process must make the same calls "
                "(mismatched calls leave the others waiting).")
        waiting = [r for r in waiting if not store.check([_run_key("joining", r)])]
        if waiting and time.monotonic() >= deadline:
            names = " and ".join(f"process {r} of {size}" for r in waiting)
            raise backend_error(
                f"Process {rank} of {size} could not join the other processes: {names} "
                f"did not come to join the run within {_seconds(timeout)}. Start every "
                "process of the run (torchrun or poprun does), each making the same "
                "pipeline or distributed training calls, or set a longer "
                f"{JOIN_TIMEOUT_ENV}.")
        if waiting:
            time.sleep(0.05)


def _ended(store, rank: int, size: int) -> str:
    """``"process 1 of 2 exited with status 1 (sys.exit(1))"``: how ``rank`` ended,
    as it recorded (``"1"``: an older record, without its exit status)."""
    text = store.get(_run_key("ended", rank)).decode(errors="replace")
    if text == "1":
        text = "ended (its exit status was not recorded)"
    return f"process {rank} of {size} {text}"


def _record_exit_without_joining() -> None:
    """At exit, a process that never joined the run records how it ended in torchrun's
    agent store, so that a process waiting for it to join fails at once
    (:func:`join`)."""
    env = config.launcher()
    if _JOINING[0] or env["agent_store"] != "True" or not env["rank"]:
        return
    try:
        with contextlib.suppress(ValueError):
            if int(env["world_size"] or 1) < 2:
                return
        store = _agent_store(datetime.timedelta(seconds=2))
        if store is not None:
            store.set(_run_key("ended", int(env["rank"])), exit_status.ending().describe())
    except (RuntimeError, ValueError) as e:
        logger.debug("Could not record this process's exit in the agent's store: %s", e)


def joined() -> None:
    """This process joins (or joined) the run: it records no exit without joining."""
    _JOINING[0] = True


def _under_launcher() -> bool:
    """Whether torchrun started this process as one of several."""
    env = config.launcher()
    try:
        return env["agent_store"] == "True" and int(env["world_size"] or 1) > 1
    except ValueError:
        return False


#: Whether this process started joining a run (see :func:`_record_exit_without_joining`).
_JOINING: List[bool] = [False]
atexit.register(_record_exit_without_joining)
if _under_launcher():  # how this process ends, should it end without joining
    exit_status.install()
