"""What a failed capture raises: a ``poptorch.Error`` for what cannot be captured, or
the exception as it is when the user's own code (or a PopTorch op's argument check)
raised it."""
from __future__ import annotations

import os
import traceback
from typing import Optional

from popart_compiler.errors import Error, backend_error
from poptorch._capture import data_dependence, storage_reads

__all__ = ["raise_capture_error"]

#: poptorch's own source directory (a PopTorch op's argument checks raise from here).
_POPTORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_frame(exc: BaseException) -> Optional[traceback.FrameSummary]:
    """The innermost traceback frame in user code (not torch / poptorch)."""
    return data_dependence.user_frame(traceback.extract_tb(exc.__traceback__))


def raise_capture_error(exc: Exception) -> None:
    """Raise the ``poptorch.Error`` that stands for the capture failure ``exc``, or
    return when ``exc`` is to propagate unchanged (the caller re-raises it): a
    ``poptorch.Error``, an exception raised by the user's own code, a PopTorch op's
    ``ValueError`` / ``AssertionError`` argument check (docs/api-sections.md api §8), or
    a common exception type raised with no user frame on the stack.

    Raises:
        poptorch.Error: a storage read (e.g. Lightning's ``self.log`` in a step), a
            data dependence (with the user's source line), otherwise "Failed to capture
            the model's forward: <type>: <message>" (from ``exc``).
    """
    if isinstance(exc, Error):
        return
    storage_reads.raise_if_storage_read(exc)  # e.g. Lightning's self.log in a step
    if data_dependence.is_data_dependent(exc):
        raise data_dependence.data_dependent_error(exc) from None
    frame = _user_frame(exc)
    origin = traceback.extract_tb(exc.__traceback__)
    if frame is not None and origin and origin[-1].filename == frame.filename:
        return  # raised by the user's own code
    if (frame is not None and isinstance(exc, (ValueError, AssertionError)) and origin
            and os.path.abspath(origin[-1].filename).startswith(_POPTORCH_DIR)):
        # a PopTorch op's argument check: docs/api-sections.md api §8 names these exception
        # types
        return
    if isinstance(exc, (AssertionError, ValueError, TypeError, RuntimeError,
                        NotImplementedError, KeyError, IndexError)) and frame is None:
        return
    raise backend_error(f"Failed to capture the model's forward: "
                        f"{type(exc).__name__}: {exc}") from exc
