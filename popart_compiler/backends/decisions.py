"""The ``auto`` backend's decisions, recorded per machine so that later runs of the same
program reuse them (issue 30): a run's results then do not depend on which backend the
timings of that run happened to favour.

A decision is one small JSON file, ``<store>/<key>.json``, where ``key`` is a hash of
what the choice depends on: the program's signature
(:func:`~popart_compiler.runtime.signature.program_signature`: the captured graph, its
inputs, parameters and batching options), training or inference, the execution device
(and the CUDA device's name), the PyTorch version, its intra-op thread count and the CPU
capability it dispatches to. The file holds the backend kept (``"eager"`` /
``"inductor"``), why, and the signature (for a reader).

The store is ``POPTORCH_AUTO_DECISIONS_DIR`` (default ``$XDG_CACHE_HOME/poptorch/
auto-decisions``, ``~/.cache/poptorch/auto-decisions`` without ``XDG_CACHE_HOME``).
``POPTORCH_AUTO_BACKEND`` says how the ``auto`` backend uses it:

* unset or empty (default): reuse a recorded decision, else decide (the policy of
  :mod:`popart_compiler.backends.auto`) and record it;
* ``eager`` / ``inductor``: pin what ``auto`` runs, for every program, from the first
  call (nothing read or recorded);
* ``redecide``: decide again and overwrite the recorded decision.

The store never fails a compilation: an entry that cannot be read (not JSON, a field
missing, an unknown backend) is one warning and is decided and written again; a store
that cannot be written is one warning per process (decisions then last the process).
Writes go to a temporary file renamed over the entry, so that two processes deciding
the same program at once leave one whole entry.

The store also keeps what compilations took on this machine (``compile-times.json``:
the seconds per program key, and the ratio of measured to estimated seconds of the
latest compilation), from which :func:`compile_estimate` gives the ``auto`` backend its
expected compilation time.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple

import torch

from popart_compiler import config
from popart_compiler.errors import backend_error
from popart_compiler.logging import logger

if TYPE_CHECKING:
    from popart_compiler.stages import Executable

__all__ = ["BACKENDS", "MODES", "mode", "store_dir", "program_key", "DecisionStore",
           "for_program", "COMPILE_MODEL", "estimate_seconds", "compile_estimate"]

#: What a decision can be.
BACKENDS = ("eager", "inductor")
#: Values of ``POPTORCH_AUTO_BACKEND`` (``""``: reuse or decide and record).
MODES = ("", "eager", "inductor", "redecide")
_VERSION = 1
_unwritable_warned = set()  # store directories already warned about
_lock = threading.Lock()


def mode() -> str:
    """``POPTORCH_AUTO_BACKEND``, lowercased: one of :data:`MODES`.

    Raises:
        poptorch.Error: another value (the message lists the accepted ones).
    """
    value = config.text("POPTORCH_AUTO_BACKEND").lower()
    if value not in MODES:
        raise backend_error(f"POPTORCH_AUTO_BACKEND={value!r} is not valid: set it to "
                            "eager or inductor (pin the auto backend's choice), redecide "
                            "(decide again and record), or unset it (reuse the recorded "
                            "choice).")
    return value


def store_dir() -> str:
    """The store's directory (``POPTORCH_AUTO_DECISIONS_DIR`` or the user's cache)."""
    explicit = config.text("POPTORCH_AUTO_DECISIONS_DIR")
    if explicit:
        return os.path.expanduser(explicit)
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or \
        os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "poptorch", "auto-decisions")


def program_key(executable: "Executable", device: str) -> Tuple[str, Dict[str, str]]:
    """``(key, described)``: the store key of ``executable`` run on ``device``
    (``"cpu"`` / ``"cuda"``; 32 hex digits) and the strings it hashes."""
    # pylint: disable-next=import-outside-toplevel
    from popart_compiler.runtime.signature import program_signature
    described = dict(program_signature(executable))
    described["training"] = str(bool(executable.training))
    described["execution device"] = device
    if device == "cuda" and torch.cuda.is_available():
        described["CUDA device"] = torch.cuda.get_device_name()
    described["torch"] = torch.__version__
    described["intra-op threads"] = str(torch.get_num_threads())
    described["CPU capability"] = torch.backends.cpu.get_cpu_capability()
    text = json.dumps(described, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32], described


class DecisionStore:
    """The decisions under ``directory`` (see the module docstring).

    Args:
        directory: the store's directory (created at the first write).
    """

    def __init__(self, directory: str):
        self.directory = directory

    def path(self, key: str) -> str:
        """The entry file of ``key``."""
        return os.path.join(self.directory, f"{key}.json")

    def load(self, key: str) -> Optional[str]:
        """The recorded backend of ``key`` (``None``: none recorded, or an entry that
        cannot be read, which logs a warning)."""
        path = self.path(key)
        try:
            with open(path, encoding="utf-8") as f:
                entry = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self._corrupt(path, f"{type(e).__name__}: {e}")
            return None
        backend = entry.get("backend") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("version") != _VERSION or \
                backend not in BACKENDS:
            self._corrupt(path, "not a decision of this version (fields version, backend)")
            return None
        return backend

    def save(self, key: str, backend: str, why: str, described: Dict[str, str]) -> bool:
        """Record ``backend`` for ``key``; ``False`` (and one warning per directory and
        process) where the store cannot be written.

        Raises:
            ValueError: ``backend`` is not one of :data:`BACKENDS`.
        """
        if backend not in BACKENDS:
            raise ValueError(f"Invalid backend decision {backend!r}: pick one of "
                             f"{', '.join(BACKENDS)}.")
        entry = {"version": _VERSION, "backend": backend, "why": why,
                 "signature": described}
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(entry, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path(key))
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            with _lock:
                first = self.directory not in _unwritable_warned
                _unwritable_warned.add(self.directory)
            if first:
                logger.warning("Backend auto: cannot record decisions in %s (%s); this "
                               "process decides again for each program. Set "
                               "POPTORCH_AUTO_DECISIONS_DIR to a writable directory.",
                               self.directory, e)
            return False
        logger.debug("Backend auto: recorded %s for this program in %s", backend,
                     self.path(key))
        return True

    @staticmethod
    def _corrupt(path: str, reason: str) -> None:
        logger.warning("Backend auto: ignoring the unreadable decision %s (%s); the "
                       "program is decided again (the entry is rewritten once it is).",
                       path, reason)


def for_program(executable: "Executable", device: str) \
        -> Tuple[Optional[str], Optional[Callable[[str, str], None]], str]:
    """How the ``auto`` backend starts a session of ``executable`` on ``device``.

    Returns:
        ``(start, record, source)``: ``start`` is the backend to run from the first call
        (a pinned or recorded one; ``None``: decide by timing), ``record(backend, why)``
        records a decision made in this session (``None`` where nothing is recorded:
        pinned), and ``source`` says where ``start`` came from (for the log).

    Raises:
        poptorch.Error: an invalid ``POPTORCH_AUTO_BACKEND``.
    """
    how = mode()
    if how in BACKENDS:
        return how, None, "pinned by POPTORCH_AUTO_BACKEND"
    store = DecisionStore(store_dir())
    key, described = program_key(executable, device)
    start = store.load(key) if how == "" else None

    def record(backend: str, why: str) -> None:
        store.save(key, backend, why, described)
    return start, record, f"recorded in {store.path(key)}"


#: The compilation-time model of a program not compiled on this machine yet:
#: ``fixed + per_node × graph nodes`` seconds, per kind (training compiles the backward
#: too). Fitted on the 2-core development machine (torch 2.13, an empty Inductor cache):
#: the README's digits CNN (18 nodes) took 29 s to compile for training, 3.2 s for
#: inference; larger graphs add about 50 ms (inference) and 100 ms (training) a node.
COMPILE_MODEL = {"training": (25.0, 0.1), "inference": (3.0, 0.05)}
_TIMES = "compile-times.json"


def estimate_seconds(nodes: int, training: bool, scale: float = 1.0) -> float:
    """The model's compilation seconds of a graph of ``nodes`` FX nodes (``scale``:
    this machine's measured / estimated ratio; default 1.0)."""
    fixed, per_node = COMPILE_MODEL["training" if training else "inference"]
    return scale * (fixed + per_node * nodes)


def _read_times(directory: str) -> dict:
    try:
        with open(os.path.join(directory, _TIMES), encoding="utf-8") as f:
            times = json.load(f)
    except (OSError, ValueError):
        return {}
    return times if isinstance(times, dict) and times.get("version") == _VERSION else {}


def _write_times(directory: str, times: dict) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".times.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(times, f, indent=1, sort_keys=True)
            os.replace(tmp, os.path.join(directory, _TIMES))
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:  # the store's own warning covers unwritable directories
        logger.debug("Backend auto: compilation time not recorded (%s)", e)


def compile_estimate(executable: "Executable", device: str) \
        -> Tuple[float, Callable[[float], None]]:
    """``(seconds, record)``: the expected compilation time of ``executable`` on
    ``device`` (recorded for this program, else :func:`estimate_seconds` of its graph
    scaled by this machine's latest measured / estimated ratio, kept within 0.5 to 4:
    a compilation served by Inductor's warm cache says little of a new graph's), and
    ``record(seconds)``, which records a measured compilation (CPU seconds; nothing is
    read or recorded while ``POPTORCH_AUTO_BACKEND`` pins a backend).

    Raises:
        poptorch.Error: an invalid ``POPTORCH_AUTO_BACKEND``."""
    nodes = len(executable.module.graph.nodes)
    training = bool(executable.training)
    if mode() in BACKENDS:  # pinned: the store is neither read nor written
        return estimate_seconds(nodes, training), lambda seconds: None
    directory = store_dir()
    key, _ = program_key(executable, device)
    times = _read_times(directory)
    recorded = times.get("programs", {}).get(key)
    scale = times.get("scale", 1.0)
    if isinstance(recorded, (int, float)):
        expected = float(recorded)
    else:
        expected = estimate_seconds(nodes, training,
                                    scale if isinstance(scale, (int, float)) else 1.0)

    def record(seconds: float) -> None:
        with _lock:
            now = _read_times(directory)
            programs = now.get("programs") if isinstance(now.get("programs"), dict) else {}
            programs[key] = round(seconds, 3)
            _write_times(directory, {
                "version": _VERSION, "programs": programs,
                "scale": round(min(4.0, max(0.5, seconds / estimate_seconds(
                    nodes, training))), 4)})
    return expected, record
