"""Starting the processes of the multi-process tests (``test_distributed.py``,
``test_pipeline_processes.py``): each on 127.0.0.1 with gloo, in its own session
(process group) so that whatever is left can be killed, and waited for a bounded
time."""
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import torch

from popart_compiler.config import JOIN_TIMEOUT_ENV
from popart_compiler.runtime import collectives

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
#: Upper bound for one multi-process scenario on an idle machine; :func:`run` scales it
#: (:func:`time_scale`).
WAIT_S = 240
#: Environment variable multiplying every timeout of the multi-process tests (a float
#: >= 1; for slow or shared machines).
TIME_SCALE_ENV = "POPTORCH_TEST_TIME_SCALE"


def load_factor():
    """How much slower than idle the machine may run now: the load average per core
    (at least 1, at most 8): timeouts of multi-process tests are multiplied by it."""
    return min(8.0, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def time_scale():
    """The factor every timeout of the multi-process tests is multiplied by: the
    larger of :data:`TIME_SCALE_ENV` (default 1) and :func:`load_factor`."""
    try:
        scale = float(os.environ.get(TIME_SCALE_ENV, "") or 1)
    except ValueError:
        scale = 1.0
    return max(1.0, scale, load_factor())


def load_worker(path):
    """Import a worker script as a module (for the single-process reference runs)."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra):
    """This environment without any launcher's variables, with the repository on the
    path, a collective timeout and a join timeout of 120 s times :func:`time_scale`
    (unless given) and ``extra``. A test of a short collective timeout keeps the long
    join timeout: processes that start slowly on a loaded machine still join."""
    out = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "POPDIST_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out["PYTHONPATH"] = ROOT + os.pathsep + out.get("PYTHONPATH", "")
    out.setdefault(collectives.TIMEOUT_ENV, str(int(120 * time_scale())))
    out.setdefault(JOIN_TIMEOUT_ENV, str(int(120 * time_scale())))
    out.update(extra)
    return out


def run(commands, envs, wait_s=WAIT_S, wait_for=None):
    """Start each command in its own session; wait (bounded) for those in
    ``wait_for`` (default all); kill every process group that is left. Returns the
    exit codes (``None`` for a process killed without being waited for) and the
    combined outputs of the processes waited for."""
    procs = []
    try:
        for cmd, environment in zip(commands, envs):
            procs.append(subprocess.Popen(cmd, env=environment, cwd=ROOT,
                                          start_new_session=True, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + wait_s * time_scale()
        waited = range(len(procs)) if wait_for is None else wait_for
        outputs = []
        for i in waited:
            out, _ = procs[i].communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
        return [p.returncode for p in procs], outputs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def launch(worker, scenario, out_dir, world=2, wait_for=None, wait_s=WAIT_S, **extra_env):
    """Run ``python <worker> <scenario> <out_dir>`` as processes ``0 … world − 1`` of
    one run (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` as
    torchrun sets them)."""
    port = str(free_port())
    envs = [env(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port, **extra_env) for r in range(world)]
    return run([[sys.executable, worker, scenario, str(out_dir)]] * world, envs,
               wait_s=wait_s, wait_for=wait_for)


def read(out_dir, rank):
    with open(os.path.join(out_dir, f"rank{rank}.txt")) as f:
        return f.read()


def write_result(out_dir, rank, result):
    """A worker's result: ``<out_dir>/rank<i>.txt`` for a message (str), else
    ``<out_dir>/rank<i>.pt``; nothing for ``None``."""
    if result is None:
        return
    if isinstance(result, str):
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(result)
    else:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
