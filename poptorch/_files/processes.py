"""Which process of a distributed run a loaded executable runs as (``poptorch.load``).

A file saved by process ``i`` of ``n`` stores ``Options.Distributed`` of that process.
Loaded elsewhere, those values would make this process wait for ``n - 1`` peers that
were never started (the rendezvous blocks until its timeout). The process that loads
the file knows where it runs: its ``torch.distributed`` process group when the script
created one, else the launcher's variables (``OMPI_COMM_WORLD_*`` or ``RANK`` /
``WORLD_SIZE``, as a new ``Options`` reads them; process 0 of 1 without a launcher).
"""
from __future__ import annotations

from typing import Any, Tuple

import torch.distributed as dist

from popart_compiler.errors import backend_error
from poptorch._logging import logger

__all__ = ["PROCESS_KEYS", "adopt_processes"]

#: The options that say which process of a run an executable belongs to.
PROCESS_KEYS = frozenset({"distributed_process_id", "num_distributed_processes"})


def _this_process(options: Any) -> Tuple[int, int, str]:
    """``(process index, process count, where they come from)`` of this process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), "its torch.distributed process group"
    fresh = type(options)().Distributed
    launched = fresh.numProcesses > 1
    return fresh.processId, fresh.numProcesses, \
        "the launcher's RANK / WORLD_SIZE" if launched else "no launcher"


def adopt_processes(filename: str, options: Any, training: bool = True) -> None:
    """Make the stored ``options`` (of a file saved by a distributed run) run as this
    process: a pipeline across processes takes this process's index and count (each
    process holds the whole program, so the pipeline's checks then apply as for a new
    model: e.g. "only 1 process was started"); a replicated training run must be
    loaded by as many processes as saved it (replicated inference never joins the
    other processes: its file loads anywhere, as before).

    Raises:
        Error: a training file saved by process ``i`` of ``n`` (data parallel,
            ``n > 1``) loaded in a process that is not process ``i`` of ``n``.
    """
    d = options.Distributed
    saved = (d.processId, d.numProcesses)
    if saved[1] <= 1:
        return
    rank, size, source = _this_process(options)
    if (rank, size) == saved:
        return
    if d.pipelineProcessesPerReplica > 1:
        logger.info("%s was saved by process %d of %d of a pipeline across processes; "
                    "it runs as process %d of %d here (%s).", filename, *saved, rank,
                    size, source)
        d.configureProcessId(rank, size)
        return
    if not training:
        return
    raise backend_error(
        f"{filename} was saved by process {saved[0]} of {saved[1]} of a distributed run, "
        f"but this is process {rank} of {size} ({source}): load it in process "
        f"{saved[0]} of a run of {saved[1]} processes (torchrun --nproc-per-node "
        f"{saved[1]}), each process loading the file it saved.")
