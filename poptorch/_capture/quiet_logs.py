"""torch's own diagnostics silenced while a model is captured (PopTorch reports
capture errors itself)."""
from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from typing import Iterator

from poptorch._capture.guard import thread_stderr

__all__ = ["quiet_torch_logs"]


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """Silence torch's own diagnostics while capturing: its loggers, its warnings and
    the partial graph ``torch.export`` prints to stderr when it fails (PopTorch reports
    capture errors itself). Anything else written to stderr is passed through."""
    names = ["torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export",
             "torch._export", "torch.fx.experimental.recording", "torch._functorch"]
    saved = []
    for name in names:
        lg = logging.getLogger(name)
        saved.append((lg, lg.level))
        lg.setLevel(logging.CRITICAL)
    real_stderr = sys.stderr
    buffer = io.StringIO()
    try:
        with warnings.catch_warnings(), thread_stderr(buffer):
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*TorchScript.*")
            yield
    except BaseException as exc:
        text = buffer.getvalue()
        partial = getattr(exc, "partial_fx_graph", None)
        if partial is not None:
            text = text.replace(f"{partial}\n", "").replace(str(partial), "")
        real_stderr.write(text)
        raise
    else:
        real_stderr.write(buffer.getvalue())
    finally:
        for lg, level in saved:
            lg.setLevel(level)
