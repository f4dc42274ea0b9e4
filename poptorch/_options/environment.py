"""Every environment variable the ``poptorch`` layer reads, in one place
(docs/api-sections.md options §8). The compiler's own (``POPTORCH_LOG_LEVEL``,
``POPTORCH_IPU_MODEL*``, ``POPLAR_ENGINE_OPTIONS``, ``POPTORCH_VERIFY``, the distributed timeout,
torchrun's variables) are declared in :mod:`popart_compiler.config` and read through it.

Variables are read when they are needed (an ``Options()`` reads the defaults when it is
created), so a program may set them before wrapping a model.
"""
from __future__ import annotations

import os
from typing import Dict

from popart_compiler import config as compiler_config
from popart_compiler.config import Variable

__all__ = ["VARIABLES", "set_process_defaults", "text", "flag", "raw", "cache_dir",
           "default_options", "execution_device", "compiler", "ipu_model_as_hardware",
           "ipu_model_version", "pipeline_across_processes", "proto_export",
           "engine_options_text", "log_level"]

VARIABLES: Dict[str, Variable] = {v.name: v for v in (
    Variable("POPTORCH_CACHE_DIR", "", "executable cache directory of every Options()"),
    Variable("POPTORCH_CACHE_LOCK_TIMEOUT", "300",
             "seconds to wait for another process's executable-cache entry lock"),
    Variable("POPTORCH_DEFAULT_OPTIONS", "{}",
             "JSON object of option values applied to every Options()"),
    Variable("POPTORCH_EXECUTION_DEVICE", "cpu", "cpu or cuda: where kernels run"),
    Variable("POPTORCH_COMPILER", "auto", "eager, inductor or auto: the backend of "
             "every Options() (auto: the faster of the two, recorded per program)"),
    Variable("POPTORCH_IPU_MODEL_AS_HARDWARE", "0",
             "1: ipuHardwareIsAvailable() reports the IPU Model's IPUs"),
    Variable("POPTORCH_EXPORT_PROTO_FILE", "",
             "write the captured program as an ONNX model proto to this file"),
    Variable("POPTORCH_EXPORT_PROTO_AS_BINARY", "0", "1: the proto file is binary"),
    Variable("POPTORCH_PIPELINE_ACROSS_PROCESSES", "0",
             "1: each pipeline stage of a multi-IPU model runs in its own process "
             "(the default of Options.Distributed.pipelineAcrossProcesses)"),
    Variable("OMPI_COMM_WORLD_SIZE", "", "OpenMPI's process count (PopRun)"),
    Variable("OMPI_COMM_WORLD_RANK", "", "OpenMPI's process index (PopRun)"),
    Variable("RDMAV_FORK_SAFE", "1", "set to 1 at import unless set (fork-safe RDMA)"),
)}


def set_process_defaults() -> None:
    """What PopTorch sets for the process at import: ``RDMAV_FORK_SAFE=1`` (unless set)
    so that forked data-loader workers are safe with the IPU's RDMA driver."""
    os.environ.setdefault("RDMAV_FORK_SAFE", "1")


def text(name: str) -> str:
    """The stripped value of the declared variable ``name`` (this layer's or the
    compiler's), or its default when unset or empty."""
    if name not in VARIABLES:
        return compiler_config.text(name)
    return os.environ.get(name, "").strip() or VARIABLES[name].default


def raw(name: str) -> str:
    """The value of ``name`` as set (``""`` when unset), for the variables whose names
    the user chooses (``Options.Distributed.setEnvVarNames``)."""
    return os.environ.get(name, "")


def flag(name: str) -> bool:
    """Whether the flag variable ``name`` (this layer's or the compiler's) is on:
    ``1``, ``true``, ``yes``, ``on``; off: ``0``, ``false``, ``no``, ``off``, unset
    (:func:`popart_compiler.config.parse_flag`).

    Raises:
        poptorch.Error: another value.
    """
    return compiler_config.parse_flag(name, text(name))


def cache_dir() -> str:
    return text("POPTORCH_CACHE_DIR")


def default_options() -> str:
    return text("POPTORCH_DEFAULT_OPTIONS")


def execution_device() -> str:
    return text("POPTORCH_EXECUTION_DEVICE")


def pipeline_across_processes() -> bool:
    """``POPTORCH_PIPELINE_ACROSS_PROCESSES``: the default of
    ``Options.Distributed.pipelineAcrossProcesses``."""
    return flag("POPTORCH_PIPELINE_ACROSS_PROCESSES")


def compiler() -> str:
    return text("POPTORCH_COMPILER")


def ipu_model_as_hardware() -> bool:
    return flag("POPTORCH_IPU_MODEL_AS_HARDWARE")


def ipu_model_version() -> str:
    return compiler_config.ipu_model_version()


def proto_export() -> tuple:
    """``(path, binary)`` of ``POPTORCH_EXPORT_PROTO_FILE`` (``path`` empty: off)."""
    return (os.environ.get("POPTORCH_EXPORT_PROTO_FILE", ""),
            flag("POPTORCH_EXPORT_PROTO_AS_BINARY"))


def engine_options_text() -> str:
    return compiler_config.engine_options_text()


def log_level() -> str:
    return compiler_config.log_level()
