"""One process-wide lock for torch's tracers.

``torch.export`` (the capture), ``make_fx`` (vectorizing the micro-batches) and the
inductor backend's compilation (AOTAutograd's tracing; before, also Dynamo's) patch
process-wide state of torch while they trace Python code: FX's patcher, the
frame-evaluation callback. Two of them at once in
different threads break each other ("found no compiled frames", "symbolically trace a
dynamo-optimized function", "CURRENT_PATCHER is None"). Each of them holds
:data:`TRACE_LOCK`; running already compiled code does not.
"""
from __future__ import annotations

import threading

__all__ = ["TRACE_LOCK"]

#: Held by each capture, vectorization and inductor compilation (re-entrant: a
#: pre-compile hook may itself compile a model).
TRACE_LOCK = threading.RLock()
