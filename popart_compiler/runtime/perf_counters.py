"""Host timestamps of each device iteration of a run (``getPerfCounters``,
docs/api-sections.md api §5.19).

The session measures, for every device iteration ``i`` of a run, when its inputs were
handed over (``input``: the host call, all inputs are streamed from the host buffers
given to it), when its computation started (``input_complete``) and ended
(``output``), and when the outputs of the run were back on the host
(``output_complete``). Iterations that run together (a vectorized or compiled batch of
micro-batches, the stages of a pipeline) share the measured start and end of that
batch. Outputs have one timestamp per returned result: every iteration for
``OutputMode.All``, every ``N``-th for ``EveryN``, the last one for ``Final`` / ``Sum``.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

from popart_compiler.enums import OutputMode

__all__ = ["IterationClock", "returned_iterations"]


def returned_iterations(mode: OutputMode, period: int, iterations: int) -> List[int]:
    """Indices of the device iterations whose results a run returns for the output
    mode ``mode`` with ``EveryN`` period ``period``."""
    if mode is OutputMode.All:
        return list(range(iterations))
    if mode is OutputMode.EveryN:
        return list(range(period - 1, iterations, period))
    return [iterations - 1]


class IterationClock:
    """Measures the device iterations of one run.

    Args:
        iterations: device iterations of the run.
    """

    def __init__(self, iterations: int):
        self.started = time.perf_counter()
        self.marks: List[Optional[Tuple[float, float]]] = [None] * iterations

    def mark(self, first: int, count: int, since: float) -> None:
        """Record that iterations ``first … first + count − 1`` computed from ``since``
        (a ``time.perf_counter()`` value) until now."""
        now = time.perf_counter()
        for i in range(first, min(first + count, len(self.marks))):
            self.marks[i] = (since, now)

    def counters(self, num_inputs: int, num_outputs: int, returned: List[int],
                 done: Optional[float] = None) -> Dict[str, List[List[float]]]:
        """The four counter lists of docs/api-sections.md api §5.19 (``[[]]`` where there are no
        tensors), for a run that ended at ``done`` (a ``time.perf_counter()`` value;
        default: now).

        Iterations that were never marked take the whole run as their span."""
        done = time.perf_counter() if done is None else done
        spans = [m if m is not None else (self.started, done) for m in self.marks]

        def per(count: int, values: List[float]) -> List[List[float]]:
            return [list(values) for _ in range(count)] or [[]]
        return {"input": per(num_inputs, [self.started] * len(spans)),
                "input_complete": per(num_inputs, [s for s, _ in spans]),
                "output": per(num_outputs, [spans[i][1] for i in returned]),
                "output_complete": per(num_outputs, [done] * len(returned))}
