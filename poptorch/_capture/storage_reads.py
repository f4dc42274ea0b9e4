"""Errors for code that reads a tensor's storage while ``forward`` is captured.

The tensors a captured ``forward`` sees have shapes and dtypes but no storage yet, so
anything that needs their memory (``copy.deepcopy``, ``.numpy()``, a C/C++ extension)
fails inside torch with "Cannot access data pointer of Tensor (e.g. FakeTensor, ...)",
whose advice (an opaque custom op) is about custom kernels. The most common cause in
practice is a Lightning ``self.log(...)`` inside a captured step: Lightning copies the
value into host-side metric objects. :func:`storage_error` names what the user called,
where, and what to change.
"""
from __future__ import annotations

import os
import traceback
from typing import List, Optional

from popart_compiler.errors import Error, py_error
from poptorch._capture import data_dependence

__all__ = ["is_storage_read", "storage_error", "raise_if_storage_read"]

_MARKER = "Cannot access data pointer of Tensor"
#: Lightning's logging methods (``LightningModule.log`` / ``log_dict``).
_LOGGING = ("log", "log_dict")


def is_storage_read(exc: BaseException) -> bool:
    """``exc`` is torch's refusal to hand out the memory of a capture stand-in."""
    return isinstance(exc, RuntimeError) and _MARKER in str(exc)


def _lightning_logging_call(frames: List[traceback.FrameSummary]
                            ) -> Optional[traceback.FrameSummary]:
    """The user's frame that called ``self.log`` / ``self.log_dict`` (the frame just
    outside Lightning's ``core/module.py``), or ``None``."""
    for caller, callee in zip(frames, frames[1:]):
        path = os.path.abspath(callee.filename).replace(os.sep, "/")
        if callee.name in _LOGGING and "lightning" in path and \
                path.endswith("core/module.py"):
            return caller
    return None


#: The standard library's directory (``copy``, ...): never the user's line.
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


def _user_line(frames: List[traceback.FrameSummary]) -> Optional[traceback.FrameSummary]:
    """The innermost frame of the user's own code: not torch or PopTorch, and, where
    there is one, neither the standard library nor an installed package."""
    own = [f for f in frames
           if not os.path.abspath(f.filename).startswith(_STDLIB)
           and "site-packages" not in f.filename]
    return data_dependence.user_frame(own) or data_dependence.user_frame(frames)


def _where(frame: Optional[traceback.FrameSummary]) -> str:
    if frame is None:
        return "the model's forward"
    return f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`"


def storage_error(exc: BaseException) -> Error:
    """The :class:`poptorch.Error` for a storage read ``exc`` raised while capturing."""
    frames = traceback.extract_tb(exc.__traceback__)
    logging_call = _lightning_logging_call(frames)
    if logging_call is not None:
        return py_error(
            f"The captured step calls Lightning's logging ({_where(logging_call)}). "
            "self.log copies the value into Lightning's host-side metric objects, which "
            "needs the tensor's value, and PopTorch captures the step into a graph before "
            "any value exists. Log on the host instead: return the value from the step "
            "and call self.log in a hook that runs outside the graph, e.g. "
            "self.log(\"train_loss\", outputs[\"loss\"]) in on_train_batch_end(self, "
            "outputs, batch, batch_idx) for training_step, or in on_validation_batch_end "
            "for validation_step.")
    return py_error(
        f"The model's forward reads the memory of a tensor at "
        f"{_where(_user_line(frames))} (copy.deepcopy, .numpy(), "
        "a C/C++ extension or a library doing so). PopTorch captures forward into a "
        "graph, and while it does the tensors have shapes and dtypes but no values. Move "
        "this code out of forward (run it on the host before or after the model), or, "
        "for a custom C++ kernel, register it with torch.library.custom_op and a fake "
        "(shape-only) implementation so that it can be captured as one op.")


def raise_if_storage_read(exc: BaseException) -> None:
    """Raise :func:`storage_error` (from ``None``) if ``exc`` is a storage read."""
    if is_storage_read(exc):
        raise storage_error(exc) from None
