"""Python warnings raised while ``forward`` is captured.

Capture runs the user's ``forward`` under ``torch.export`` and PopTorch's own
``TorchFunctionMode``s, so a warning raised by a torch function the user called would
name the frame that happened to call it: ``poptorch/_capture/device_mode.py``, torch's
``module.py`` or ``torch/_export/...``. :func:`at_user_code` re-points every warning
whose location is not user code at the innermost frame of the user's code on the stack
(the line in ``forward`` that caused it), and drops the internal notes of torch that
do not concern supported models (:data:`TORCH_NOISE`).
"""
from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from typing import Callable, Iterator

__all__ = ["at_user_code", "TORCH_NOISE"]

#: Messages (regular expressions) of torch warnings about its own internals that say
#: nothing about the user's model: an ``nn.LSTM``/``nn.GRU`` keeps its weights in the
#: plain attribute ``_flat_weights``, which ``torch.export`` flags as "assigned during
#: export".
TORCH_NOISE = (
    r"The tensor attributes (\S+\._flat_weights\[\d+\](, )?)+ were assigned during export",
)


#: The standard library's directory (``warnings``, ``contextlib``, ...): never the
#: user's code.
_STDLIB = os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep


def _is_stdlib(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_STDLIB) and "site-packages" not in path


@contextlib.contextmanager
def at_user_code(user_frame_of: Callable) -> Iterator[None]:
    """Show warnings raised inside at the user's source line.

    Args:
        user_frame_of: ``frames -> FrameSummary | None``, the innermost user frame of a
            stack summary (``None`` if no frame is the user's: a location in torch or
            PopTorch).
    """
    with warnings.catch_warnings():
        for pattern in TORCH_NOISE:
            warnings.filterwarnings("ignore", message=pattern)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if _is_stdlib(filename) or \
                    user_frame_of([traceback.FrameSummary(filename, lineno, None)]) is None:
                frame = user_frame_of([f for f in traceback.extract_stack()
                                       if not _is_stdlib(f.filename)])
                if frame is not None:
                    filename, lineno, line = frame.filename, frame.lineno, frame.line
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield
