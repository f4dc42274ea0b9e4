"""Host memory that stays with the process between calls, as a device's memory stays
with its program (issue 30).

glibc's allocator serves large blocks (above 128 KiB at first) with fresh ``mmap``
pages and returns them to the system when they are freed; a model whose activations
are tens of MB then takes a page fault for every 4 KiB of every activation at every
call, and the kernel zeroes each page. On one thread of an AMD EPYC, a ResNet-50 1×1
convolution (64 → 256 channels, 56×56, batch 16, oneDNN, with ReLU) took 35.7 ms of
CPU time so, and 14.3 ms with the freed blocks kept; ONNX Runtime, which keeps its
own arena, 20.4 ms. So when the first program for the CPU is lowered, the allocator
is told (``mallopt``) to serve blocks up to 256 MiB from its heap
(``M_MMAP_THRESHOLD``) and to keep up to 1 GiB of freed memory at the top of it
(``M_TRIM_THRESHOLD``): the next call reuses the same pages. The process then holds
its peak host memory (plus at most 1 GiB) until it exits, as a device holds its
program's memory. ``POPTORCH_RETAIN_HOST_MEMORY=0`` keeps the allocator's defaults;
nothing is done where the C library is not glibc.

The setting is process-wide: every allocation of the process benefits (plain PyTorch
code beside the model too).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Optional

from popart_compiler import config
from popart_compiler.logging import logger

__all__ = ["retain_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "ENV"]

ENV = "POPTORCH_RETAIN_HOST_MEMORY"
#: Bytes: blocks up to this size come from the heap, not from fresh ``mmap`` pages.
MMAP_THRESHOLD = 256 * 1024 * 1024
#: Bytes of freed memory at the top of the heap that the allocator keeps.
TRIM_THRESHOLD = 1024 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h

_lock = threading.Lock()
#: ``None`` until the first call, then ``"set"``, ``"off"`` or ``"unavailable"``
_state: Optional[str] = None


def _glibc_mallopt():
    """glibc's ``mallopt``, or ``None`` where the C library is another one."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        gnu_get_libc_version = libc.gnu_get_libc_version
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    del gnu_get_libc_version  # present: this is glibc
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def retain_freed_memory() -> bool:
    """Set the allocator as the module docstring says, once per process; returns
    whether this process's allocator is so set (``False``: turned off with
    ``POPTORCH_RETAIN_HOST_MEMORY=0``, not glibc, or glibc refused a value)."""
    global _state  # pylint: disable=global-statement
    with _lock:
        if _state is not None:
            return _state == "set"
        if not config.flag(ENV):
            _state = "off"
            return False
        mallopt = _glibc_mallopt()
        ok = mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) \
            and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        _state = "set" if ok else "unavailable"
        logger.debug("Host memory: freed blocks %s (%s)",
                     "kept for the next call" if ok else "returned to the system",
                     ENV)
        return ok
