"""What a compiled executor tells about its program and its last run (docs/api-sections.md api
§5.17-§5.19, §8, §9; docs/semantics.md S-16, S-60): cycle count and the IPU Model's estimates,
compilation time, perf counters and latencies, tensor names, anchored tensors, the
placement summary and the IR listing. Functions of the executor's state; none changes
it."""
from __future__ import annotations

import datetime
from typing import Any, Callable, Dict, List, Tuple

import torch

from popart_compiler.errors import py_error
from popart_compiler.ir import annotation_text
from poptorch._executor.state import ExecutorState

__all__ = ["cycle_count", "ipu_model_estimate", "compilation_time", "perf_counters",
           "latency", "tensor_names", "anchored_tensor", "placement_summary",
           "program_text"]

_COUNTERS = ("input", "input_complete", "output", "output_complete")


def cycle_count(state: ExecutorState) -> int:
    """The IPU Model's estimate of the cycles of the last run (first replica).

    Raises:
        poptorch.Error: cycle counting is off, or the model has not run since it was
            compiled.
    """
    if not state.options._Popart.options.get("instrumentWithHardwareCycleCounter"):
        raise py_error("Cycle count logging is disabled. Please set option "
                       "logCycleCount to True to enable.")
    exe = state.executable
    if exe is None or not state.ran or exe.estimate is None:
        raise py_error("Please run the model at least once before obtaining cycle "
                       "count.")
    return int(exe.estimate.cycles.run_cycles)


def ipu_model_estimate(state: ExecutorState) -> Dict[str, Any]:
    """The figures of ``profile.json`` (memory per IPU, cycles, schedule, samples/s).

    Raises:
        poptorch.Error: not compiled.
    """
    return state.require_compiled().executable.estimate.summary()


def compilation_time(state: ExecutorState) -> datetime.timedelta:
    """Wall-clock time of the last compilation.

    Raises:
        poptorch.Error: not compiled, or the progress bar was disabled.
    """
    # PopTorch's order and words: not compiled first, then the progress bar.
    if state.compiled is None:
        raise py_error("Please compile the model before obtaining compilation time.")
    if not state.options._show_compilation_progress_bar or state.progress is None or \
            state.progress.elapsed is None:
        raise py_error("Please set showCompilationProgressBar option to obtain compilation "
                       "time.")
    return datetime.timedelta(seconds=state.progress.elapsed)


def perf_counters(state: ExecutorState) -> Dict[str, List[List[float]]]:
    """Host timestamps of the transfers of the last run (empty before any run)."""
    session = state.session
    if session is None:
        return {k: [[]] for k in _COUNTERS}
    return {k: [list(v) for v in vals] for k, vals in session.perf_counters.items()}


def latency(state: ExecutorState, start: str, start_reduce: Callable, end: str,
            end_reduce: Callable) -> Tuple[float, float, float]:
    """``(min, max, mean)`` seconds from the ``start`` counter to the ``end`` counter
    of each device iteration (replicas reduced with ``start_reduce`` / ``end_reduce``).

    Raises:
        AssertionError: counters of different lengths that are not multiples.
    """
    counters = perf_counters(state)
    starts = [start_reduce(v) for v in zip(*counters[start])] if counters[start][0] else []
    ends = [end_reduce(v) for v in zip(*counters[end])] if counters[end][0] else []
    if not ends or not starts:
        return (0.0, 0.0, 0.0)
    if len(starts) != len(ends):
        if len(starts) % len(ends):
            raise AssertionError("Mismatched numbers of performance counters")
        step = len(starts) // len(ends)
        starts = [min(starts[i:i + step]) for i in range(0, len(starts), step)]
    lat = [e - s for s, e in zip(starts, ends)]
    return (min(lat), max(lat), sum(lat) / len(lat))


def tensor_names(state: ExecutorState) -> List[str]:
    """Names of the tensors of the compiled graph (docs/semantics.md S-16), optimizer state
    included.

    Raises:
        AssertionError: not compiled.
    """
    if state.compiled is None:
        raise AssertionError("Model must be compiled before calling getTensorNames")
    names = list(state.compiled.executable.tensor_names)
    if state.training and state.session is not None:
        names += list(state.session.optimizer.state)
    return names


def anchored_tensor(state: ExecutorState, short_name: str) -> torch.Tensor:
    """The value of an anchor captured by the last run.

    Raises:
        AssertionError: "No tensor with name <n> found." (unknown name or no run).
    """
    if short_name not in state.anchor_values:
        raise AssertionError(f"No tensor with name {short_name} found.")
    return state.anchor_values[short_name]


def placement_summary(state: ExecutorState, backward: bool) -> str:
    """The placement table of the compiled program (docs/api-sections.md api §9).

    Raises:
        poptorch.Error: not compiled.
    """
    return state.require_compiled().executable.placement_summary(backward=backward)


def program_text(state: ExecutorState) -> str:
    """The compiled graph's ops with their scoped names (docs/semantics.md S-16) and the annotations
    the IPU compiler reads (docs/api-sections.md api §8).

    Raises:
        poptorch.Error: not compiled.
    """
    graph = state.require_compiled().executable.graph
    return "\n".join(f"{name}: {node.format_node()}{annotation_text(node)}"
                     for name, node in graph.activation_names().items())
