"""Joining a run and ending without joining, under torchrun (see
:mod:`.collectives`): the processes meet in the store that torchrun's agent hosts for
the whole run, polled here, before ``init_process_group`` waits for them in C++.

A process that ends its script without ever joining the run (it made none of the
pipeline or distributed training calls the others make) records it in the agent's
store at exit; a process that comes to join then fails at once naming it, instead of
waiting in the rendezvous until its timeout.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import time

import torch.distributed as dist

from popart_compiler import config
from popart_compiler.errors import backend_error
from popart_compiler.logging import logger

__all__ = ["wait_for_peers", "joined"]


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


def wait_for_peers(rank: int, size: int, timeout: datetime.timedelta) -> None:
    """Under torchrun, wait in the agent's store (polling) until every process comes
    to join the run, instead of inside ``init_process_group``: a process that ended
    its script without ever joining (it made none of the calls this one makes)
    recorded it at exit (:func:`_record_exit_without_joining`), and this process
    fails at once naming it, not at the rendezvous timeout.

    Raises:
        Error: another process ended without joining.
    """
    try:
        store = _agent_store(datetime.timedelta(seconds=10))
        if store is None:
            return
        store.set(_run_key("joining", rank), "1")
        deadline = time.monotonic() + timeout.total_seconds()
        waiting = [r for r in range(size) if r != rank]
        while waiting and time.monotonic() < deadline:
            ended = [r for r in waiting if store.check([_run_key("ended", r)])]
            if ended:
                names = " and ".join(f"process {r} of {size}" for r in ended)
                raise backend_error(
                    f"Process {rank} of {size} could not join the other processes: "
                    f"{names} ended normally (its script finished) without joining the "
                    "run, i.e. without making the pipeline (or distributed training) "
                    "calls this process makes: every process must make the same calls "
                    "(mismatched calls leave the others waiting).")
            waiting = [r for r in waiting if not store.check([_run_key("joining", r)])]
            if waiting:
                time.sleep(0.05)
    except (RuntimeError, ValueError) as e:  # no store to poll: init_process_group waits
        logger.debug("Waiting for the other processes in the agent's store: %s", e)


def _record_exit_without_joining() -> None:
    """At exit, a process that never joined the run records it in torchrun's agent
    store, so that a process waiting for it to join fails at once
    (:func:`_wait_for_peers`)."""
    env = config.launcher()
    if _JOINING[0] or env["agent_store"] != "True" or not env["rank"]:
        return
    try:
        with contextlib.suppress(ValueError):
            if int(env["world_size"] or 1) < 2:
                return
        store = _agent_store(datetime.timedelta(seconds=2))
        if store is not None:
            store.set(_run_key("ended", int(env["rank"])), "1")
    except (RuntimeError, ValueError) as e:
        logger.debug("Could not record this process's exit in the agent's store: %s", e)


def joined() -> None:
    """This process joins (or joined) the run: it records no exit without joining."""
    _JOINING[0] = True


#: Whether this process started joining a run (see :func:`_record_exit_without_joining`).
_JOINING = [False]
atexit.register(_record_exit_without_joining)
