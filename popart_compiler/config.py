"""Every environment variable the compiler and runtime read, in one place.

Each variable is declared once (:data:`VARIABLES`, with its default and meaning) and
read through the functions below, at the moment it is needed (not at import), so a
program or a test may set it before wrapping a model. ``poptorch`` reads its own
variables through :mod:`poptorch._options.environment`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional, Tuple

from popart_compiler.errors import backend_error

__all__ = ["Variable", "VARIABLES", "text", "flag", "parse_flag", "FLAG_ON", "FLAG_OFF",
           "log_level", "log_dest",
           "ipu_model_version", "engine_options_text", "ipu_model_flags", "verify_graphs",
           "strict_memory",
           "collective_timeout_text", "launcher", "TIMEOUT_ENV", "JOIN_TIMEOUT_ENV"]


@dataclasses.dataclass(frozen=True)
class Variable:
    """An environment variable: its name, the value used when unset and its meaning."""
    name: str
    default: str
    doc: str


#: Environment variable holding the collective timeout in seconds.
TIMEOUT_ENV = "POPTORCH_DISTRIBUTED_TIMEOUT"
#: Environment variable holding the join (rendezvous) timeout in seconds.
JOIN_TIMEOUT_ENV = "POPTORCH_DISTRIBUTED_JOIN_TIMEOUT"

VARIABLES: Dict[str, Variable] = {v.name: v for v in (
    Variable("POPTORCH_LOG_LEVEL", "WARN",
             "TRACE, DEBUG, INFO, WARN, ERR or OFF: level of PopTorch's loggers"),
    Variable("POPTORCH_LOG_DEST", "stderr",
             "stderr, stdout or a file name: where the compiler's log goes"),
    Variable("POPTORCH_IPU_MODEL_VERSION", "ipu2", "ipu1, ipu2 or ipu21: the IPU Model"),
    Variable("POPTORCH_IPU_MODEL", "0", "1: the IPU Model was asked for explicitly"),
    Variable("POPTORCH_SMALL_IPU_MODEL", "0", "1: the 4-tile IPU Model"),
    Variable("POPTORCH_IPU_MODEL_STRICT_MEMORY", "0",
             "1: a program that does not fit in the IPU Model's memory fails to compile"),
    Variable("POPLAR_ENGINE_OPTIONS", "",
             "a JSON object of Poplar engine options (autoReport.*, debug.*)"),
    Variable("POPTORCH_VERIFY", "0", "1: verify the graph after every compiler pass"),
    Variable("POPTORCH_AUTO_BACKEND", "",
             "eager or inductor: pin what the auto backend runs; redecide: decide again "
             "and record; unset: reuse the recorded decision"),
    Variable("POPTORCH_AUTO_DECISIONS_DIR", "",
             "where the auto backend records its decisions (default: "
             "~/.cache/poptorch/auto-decisions)"),
    Variable(TIMEOUT_ENV, "300", "seconds a collective of a multi-process run may wait"),
    Variable(JOIN_TIMEOUT_ENV, "",
             "seconds the processes of a run may take to join it (default: the "
             "collective timeout)"),
    Variable("POPTORCH_RETAIN_HOST_MEMORY", "1",
             "1: freed host memory is kept by the allocator for the next call (glibc's "
             "mallopt), 0: the allocator's own defaults"),
    Variable("POPTORCH_PIPELINE_PIN_CORES", "0",
             "1: pin each process of a pipeline across processes to cores of its own"),
    Variable("TORCHELASTIC_RUN_ID", "", "set by torchrun: the process was launched"),
    Variable("TORCHELASTIC_USE_AGENT_STORE", "",
             "set by torchrun: its agent, not process 0, hosts the rendezvous store"),
    Variable("TORCHELASTIC_RESTART_COUNT", "0",
             "set by torchrun: how many times the workers were restarted"),
    Variable("RANK", "", "torchrun's process index"),
    Variable("WORLD_SIZE", "", "torchrun's process count"),
    Variable("LOCAL_RANK", "", "torchrun's process index on this host (CUDA device)"),
    Variable("LOCAL_WORLD_SIZE", "", "torchrun's process count on this host"),
    Variable("MASTER_ADDR", "", "rendezvous host of torch.distributed's env://"),
    Variable("MASTER_PORT", "", "rendezvous port of torch.distributed's env://"),
)}


def text(name: str) -> str:
    """The stripped value of the declared variable ``name``, or its default when unset
    or empty."""
    return os.environ.get(name, "").strip() or VARIABLES[name].default


#: Spellings of an on / off flag variable (case-insensitive); an integer is on when it
#: is not 0.
FLAG_ON = ("true", "yes", "on")
FLAG_OFF = ("false", "no", "off")


def parse_flag(name: str, value: str) -> bool:
    """The on / off value of flag variable ``name`` set to ``value``: ``1`` (any
    non-zero integer), ``true``, ``yes``, ``on`` are on; ``0``, ``false``, ``no``,
    ``off`` and the empty string are off (case-insensitive, surrounding spaces
    ignored).

    Raises:
        poptorch.Error: any other value (it names the variable and the spellings).
    """
    word = value.strip().lower()
    if word in FLAG_ON or word in FLAG_OFF or word == "":
        return word in FLAG_ON
    try:
        return int(word) != 0
    except ValueError:
        raise backend_error(f"{name}={value!r} is not an on / off value: set it to 1, "
                            f"{', '.join(FLAG_ON)} (on; so is any non-zero integer) or 0, "
                            f"{', '.join(FLAG_OFF)} (off), "
                            "or unset it.") from None


def flag(name: str) -> bool:
    """Whether the flag variable ``name`` is on (see :func:`parse_flag`; unset: its
    default).

    Raises:
        poptorch.Error: a value that is not an on / off spelling.
    """
    return parse_flag(name, text(name))


def log_level() -> str:
    return text("POPTORCH_LOG_LEVEL")


def log_dest() -> str:
    return text("POPTORCH_LOG_DEST")


def ipu_model_version() -> str:
    """``POPTORCH_IPU_MODEL_VERSION`` (not validated here)."""
    return text("POPTORCH_IPU_MODEL_VERSION")


def engine_options_text() -> str:
    """The raw JSON text of ``POPLAR_ENGINE_OPTIONS`` (``""`` when unset)."""
    return text("POPLAR_ENGINE_OPTIONS")


def ipu_model_flags() -> Tuple[bool, bool]:
    """``(POPTORCH_IPU_MODEL != 0, POPTORCH_SMALL_IPU_MODEL != 0)``."""
    return flag("POPTORCH_IPU_MODEL"), flag("POPTORCH_SMALL_IPU_MODEL")


def strict_memory() -> bool:
    """``POPTORCH_IPU_MODEL_STRICT_MEMORY=1``: out of memory on the IPU Model is an error
    at compile time (``Options.ipuModelStrictMemory`` wins over it)."""
    return flag("POPTORCH_IPU_MODEL_STRICT_MEMORY")


def verify_graphs() -> bool:
    """``POPTORCH_VERIFY=1``: run :func:`popart_compiler.verify.verify` after every pass."""
    return flag("POPTORCH_VERIFY")


def collective_timeout_text() -> str:
    return text(TIMEOUT_ENV)


def launcher() -> Dict[str, Optional[str]]:
    """torchrun's variables: ``run_id``, ``agent_store``, ``rank``, ``world_size``,
    ``local_rank``, ``master_addr``, ``master_port`` (``None`` when unset)."""
    names = {"run_id": "TORCHELASTIC_RUN_ID", "agent_store": "TORCHELASTIC_USE_AGENT_STORE",
             "rank": "RANK", "world_size": "WORLD_SIZE",
             "local_rank": "LOCAL_RANK", "master_addr": "MASTER_ADDR",
             "master_port": "MASTER_PORT"}
    return {key: (text(name) or None) for key, name in names.items()}
