"""``poprun``: PopRun's command line on top of ``torch.distributed.run`` (torchrun).

``poprun --num-instances N --num-replicas R [--ipus-per-replica K] [--host h1,h2]
python script.py args`` execs::

    python -m torch.distributed.run --nproc-per-node N/H <rendezvous> script.py args

with ``POPDIST_NUM_TOTAL_REPLICAS=R`` and ``POPDIST_NUM_IPUS_PER_REPLICA=K`` in the
environment, so that :mod:`popdist` and ``popdist.poptorch.Options`` give each of the
``N`` processes ``R / N`` replicas. ``H`` is the number of hosts (1 without
``--host``): one host uses torchrun's ``--standalone`` rendezvous on a free port; with
several hosts, run the same ``poprun`` command on every host (PopRun started the remote
processes over ssh; torchrun does not), which joins a c10d rendezvous on the first host
(``--rdzv-port``, default 29400); the host's position in ``--host`` is its node rank,
found from its host name or addresses, or given with ``--node-rank``.

PopRun options that configure IPU-over-Fabric partitions (``--vipu-*``,
``--update-partition``, ``--reset-partition``, ``--mpi-*``, ``--numa-aware``, ...) are
accepted and ignored with a warning. ``--executable-cache-path`` sets
``POPTORCH_CACHE_DIR``.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["build_command", "main"]

#: PopRun options with a value that only matter for IPU-over-Fabric hardware.
_IGNORED = ("--vipu-server-host", "--vipu-server-port", "--vipu-server-timeout",
            "--vipu-partition", "--vipu-cluster", "--vipu-allocation",
            "--update-partition", "--reset-partition", "--remove-partition",
            "--mpi-global-args", "--mpi-local-args", "--numa-aware",
            "--ipus-per-host", "--process-placement", "--print-topology")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="poprun", description="Launch a PopDist program on torch.distributed.run.")
    p.add_argument("--num-instances", type=int, default=1,
                   help="processes in all (default 1)")
    p.add_argument("--num-replicas", type=int, default=None,
                   help="replicas of all processes (default: one per instance)")
    p.add_argument("--ipus-per-replica", type=int, default=1)
    p.add_argument("--host", "-H", default="",
                   help="comma-separated hosts; run the same command on each")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this host's index in --host (default: found from its name)")
    p.add_argument("--rdzv-port", type=int, default=29400,
                   help="rendezvous port on the first host (several hosts only)")
    p.add_argument("--executable-cache-path", default=None)
    for name in _IGNORED:
        p.add_argument(name, nargs="?", const="yes", default=None,
                       help=argparse.SUPPRESS)
    p.add_argument("program", nargs=argparse.REMAINDER,
                   help="the program and its arguments, e.g. python train.py --epochs 3")
    return p


def _local_names() -> set:
    names = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        names.discard("")
    return names


def build_command(argv: Sequence[str], python: Optional[str] = None
                  ) -> Tuple[List[str], Dict[str, str]]:
    """The ``torch.distributed.run`` command line and the environment additions for
    PopRun arguments ``argv``.

    Raises:
        SystemExit: bad arguments (argparse's usage error, exit status 2), e.g. a
            replica count that is not a multiple of the instance count, or instances
            that do not divide evenly over the hosts.
    """
    parser = _parser()
    args = parser.parse_args(list(argv))
    python = python or sys.executable
    program = list(args.program)
    if program and program[0] == "--":
        program = program[1:]
    if not program:
        parser.error("give the program to run, e.g. `poprun --num-instances 2 python "
                     "train.py`")
    n = args.num_instances
    replicas = args.num_replicas if args.num_replicas is not None else n
    if n < 1 or replicas < 1 or replicas % n:
        parser.error(f"--num-replicas ({replicas}) must be a positive multiple of "
                     f"--num-instances ({n})")
    hosts = [h.strip() for h in args.host.split(",") if h.strip()]
    for name in _IGNORED:
        if getattr(args, name[2:].replace("-", "_")) is not None:
            print(f"poprun: {name} has no effect on the IPU Model; ignored",
                  file=sys.stderr)
    cmd = [python, "-m", "torch.distributed.run"]
    if len(hosts) > 1:
        if n % len(hosts):
            parser.error(f"--num-instances ({n}) must be a multiple of the number of "
                         f"hosts ({len(hosts)})")
        rank = args.node_rank
        if rank is None:
            local = _local_names()
            matches = [i for i, h in enumerate(hosts) if h in local]
            if len(matches) != 1:
                parser.error("cannot tell which of --host this machine is: pass "
                             "--node-rank")
            rank = matches[0]
        cmd += ["--nnodes", str(len(hosts)), "--node-rank", str(rank),
                "--nproc-per-node", str(n // len(hosts)), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{hosts[0]}:{args.rdzv_port}", "--rdzv-id", "poprun"]
    else:
        cmd += ["--standalone", "--nproc-per-node", str(n)]
    if os.path.basename(program[0]).startswith("python"):
        program = program[1:]
        if program[:1] == ["-m"]:
            cmd.append("-m")
            program = program[1:]
    else:
        cmd.append("--no-python")
    env = {"POPDIST_NUM_TOTAL_REPLICAS": str(replicas),
           "POPDIST_NUM_IPUS_PER_REPLICA": str(args.ipus_per_replica)}
    if args.executable_cache_path:
        env["POPTORCH_CACHE_DIR"] = args.executable_cache_path
    return cmd + program, env


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of the ``poprun`` console script: exec torchrun."""
    cmd, env = build_command(sys.argv[1:] if argv is None else argv)
    os.execvpe(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    main()
