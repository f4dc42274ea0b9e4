"""The compilation progress bar (a tqdm bar on stderr) that also times compilation."""
from __future__ import annotations

import sys
import time
from typing import Optional

from tqdm import tqdm

__all__ = ["ProgressBar"]

_TITLE = "Graph compilation"
_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}<{remaining}]"


class ProgressBar:
    """The ``compilation_progress_bar_fn`` of :meth:`Options.toDict`: a callable
    ``(progress, total)`` drawing a tqdm bar titled "Graph compilation" on stderr, which
    also times the compilation (``elapsed``, seconds, set when it reaches ``total`` or
    is closed).

    Args:
        show: draw the bar (``False``: only time the compilation).
    """

    def __init__(self, show: bool = True):
        self.show = show
        self._bar = None
        self._total = self._n = 0
        self.start = time.perf_counter()
        self.elapsed: Optional[float] = None

    def __call__(self, progress: int, total: int) -> None:
        self._total, self._n = total, progress
        if self.show and self._bar is None and self.elapsed is None and _interactive():
            self._bar = tqdm(desc=_TITLE, total=total, file=sys.stderr,
                             bar_format=_FORMAT)
        if self._bar is not None and progress != self._bar.n:
            self._bar.n = progress
            self._bar.refresh()
        if progress >= total:
            self.close()

    def close(self) -> None:
        """Stop the timer and close the bar. When stderr is not a terminal (a log
        file, CI), the bar is not animated: closing writes its final state (the step
        reached) as one line instead."""
        if self.elapsed is None:
            self.elapsed = time.perf_counter() - self.start
            if self.show and self._bar is None and self._total:
                line = tqdm.format_meter(self._n, self._total, self.elapsed,
                                         prefix=_TITLE, bar_format=_FORMAT, ncols=80)
                sys.stderr.write(line + "\n")
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _interactive() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed stream
        return False

