"""The read-only inspection API of :class:`poptorch.PoplarExecutor` (spec api §5.17-§5.19,
§8, §9; S-16, S-60): cycle count and the IPU Model's estimates, compilation time, perf
counters and latencies, tensor names, anchored tensors, the placement summary and the
IR listing. A mixin: these are public ``PoplarExecutor`` methods."""
from __future__ import annotations

import datetime
from typing import Any, Dict, List, Tuple

import torch

from popart_compiler.errors import py_error
from popart_compiler.ir import annotation_text

__all__ = ["InspectionMixin"]


class InspectionMixin:
    """What a compiled ``PoplarExecutor`` tells about its program and its last run.
    Reads ``_options``, ``_executable``, ``_session``, ``_progress``, ``_ran``,
    ``_anchor_values`` and ``_training`` of the executor; changes nothing."""

    def cycleCount(self) -> int:
        """Cycles of the last run on the first replica (api §5.17).

        PopTorch counts them on IPU hardware only and fails to compile on the Poplar
        IPU Model. This IPU Model goes further: it returns its estimate of the run
        (:mod:`popart_compiler.cost.cycle_model`: per-op cost, pipeline schedule, weight
        update), which is deterministic and does not depend on the host.

        Raises:
            poptorch.Error: ``Options.logCycleCount(True)`` was not set, or the model
                has not run since it was compiled.
        """
        if not self._options._Popart.options.get("instrumentWithHardwareCycleCounter"):
            raise py_error("Cycle count logging is disabled. Please set option "
                           "logCycleCount to True to enable.")
        if self._executable is None or not self._ran or self._executable.estimate is None:
            raise py_error("Please run the model at least once before obtaining cycle "
                           "count.")
        return int(self._executable.estimate.cycles.run_cycles)

    def estimatedThroughput(self) -> float:
        """The IPU Model's estimate of the samples per second of all replicas (not a
        PopTorch method): micro-batch × micro-batches per step × replicas over the
        estimated time of a step (pipeline schedule, weight update, host transfers).

        Raises:
            poptorch.Error: not compiled.
        """
        return float(self.ipuModelEstimate()["cycles"]["samples_per_second"])

    def ipuModelEstimate(self) -> Dict[str, Any]:
        """The IPU Model's estimate of the compiled program (not a PopTorch method):
        the figures written to ``profile.json`` — memory per IPU by category (bytes),
        largest tensors, cycles per run, pipeline stages and schedule, samples per
        second (see README "Memory and cycle estimates").

        Raises:
            poptorch.Error: not compiled.
        """
        self._require_executable()
        return self._executable.estimate.summary()

    def compilationTime(self) -> datetime.timedelta:
        """Wall-clock time of the last compilation (api §5.18).

        Raises:
            poptorch.Error: not compiled, or the progress bar was disabled.
        """
        if not self._options._show_compilation_progress_bar:
            raise py_error("Compilation time is only available if you set "
                           "showCompilationProgressBar option to True.")
        if self._executable is None or self._progress is None or \
                self._progress.elapsed is None:
            raise py_error("Please compile the model before obtaining compilation time.")
        return datetime.timedelta(seconds=self._progress.elapsed)

    def getPerfCounters(self) -> Dict[str, List[List[float]]]:
        """Host timestamps of the transfers of the last run (api §5.19)."""
        if self._session is None:
            return {k: [[]] for k in ("input", "input_complete", "output", "output_complete")}
        return {k: [list(v) for v in vals] for k, vals in self._session.perf_counters.items()}

    def _latency(self, start: str, start_red, end: str, end_red) -> Tuple[float, float, float]:
        counters = self.getPerfCounters()
        starts = [start_red(v) for v in zip(*counters[start])] if counters[start][0] else []
        ends = [end_red(v) for v in zip(*counters[end])] if counters[end][0] else []
        if not ends or not starts:
            return (0.0, 0.0, 0.0)
        if len(starts) != len(ends):
            if len(starts) % len(ends):
                raise AssertionError("Mismatched numbers of performance counters")
            step = len(starts) // len(ends)
            starts = [min(starts[i:i + step]) for i in range(0, len(starts), step)]
        lat = [e - s for s, e in zip(starts, ends)]
        return (min(lat), max(lat), sum(lat) / len(lat))

    def getHostIpuLatency(self):
        """``(min, max, mean)`` seconds from input start to input complete."""
        return self._latency("input", min, "input_complete", max)

    def getComputeLatency(self):
        """``(min, max, mean)`` seconds from input complete to output start."""
        return self._latency("input_complete", max, "output", max)

    def getIpuHostLatency(self):
        """``(min, max, mean)`` seconds from output start to output complete."""
        return self._latency("output", min, "output_complete", max)

    def getLatency(self):
        """``(min, max, mean)`` seconds from input start to output complete."""
        return self._latency("input", min, "output_complete", max)

    def getTensorNames(self) -> List[str]:
        """Names of the tensors of the compiled graph (S-16).

        Raises:
            AssertionError: not compiled.
        """
        if self._executable is None:
            raise AssertionError("Model must be compiled before calling getTensorNames")
        names = list(self._executable.tensor_names)
        if self._training and self._session is not None:
            names += list(self._session.optimizer.state)
        return names

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """The value of an anchor (``Options.anchorTensor``) captured by the last run.

        Raises:
            AssertionError: "No tensor with name <n> found." (unknown name or no run).
        """
        if short_name not in self._anchor_values:
            raise AssertionError(f"No tensor with name {short_name} found.")
        return self._anchor_values[short_name]

    def placementSummary(self, backward: bool = True) -> str:
        """Where the compiled program runs, as a readable table (api §9, S-60).

        One row per (IPU, pipeline stage, phase) with the number of forward ops, of
        backward ops (training; counted on the joint forward/backward graph, ``-``
        with ``backward=False``), and the number and bytes of the parameters whose
        weight update runs there. The title gives the execution strategy, the IPUs
        per replica and the number of stages (``2F − 1`` for pipelined training,
        S-63). The same table (without backward counts) is logged at DEBUG when
        the model compiles. Not part of PopTorch's API.

        Raises:
            poptorch.Error: the model is not compiled yet.
        """
        self._require_executable()
        return self._executable.placement_summary(backward=backward)

    def _debugGetPopartIR(self) -> str:
        """A text listing of the compiled graph's operations with their scoped names and
        the annotations the IPU compiler would read (``MultiConv``, ``Attribute``,
        available memory; api §8)."""
        self._require_executable()
        names = self._executable.graph.activation_names()
        return "\n".join(f"{name}: {node.format_node()}{annotation_text(node)}"
                         for name, node in names.items())

