"""The read-only inspection methods of ``PoplarExecutor`` (cycles, the IPU Model's
estimate, latencies, tensor names, anchors, placement): a base class of
:class:`~poptorch._executor.executor.PoplarExecutor`, each method handing the executor's
state to :mod:`poptorch._executor.inspection`."""
from __future__ import annotations

import datetime
from typing import Any, Dict, List

import torch

from poptorch._executor import inspection

__all__ = ["InspectionMethods"]


class InspectionMethods:
    """PopTorch's inspection API of a wrapped model (and the IPU Model's estimate);
    the subclass provides ``_state`` (an ``ExecutorState``)."""

    def cycleCount(self) -> int:
        """Cycles of the last run on the first replica (docs/api-sections.md api §5.17).

        PopTorch counts them on IPU hardware only and fails to compile on the Poplar
        IPU Model. This IPU Model goes further: it returns its estimate of the run
        (:mod:`popart_compiler.cost.cycle_model`: per-op cost, pipeline schedule, weight
        update), which is deterministic and does not depend on the host.

        Raises:
            poptorch.Error: ``Options.logCycleCount(True)`` was not set, or the model
                has not run since it was compiled.
        """
        return inspection.cycle_count(self._state)

    def estimatedThroughput(self, host_loop: bool = False) -> float:
        """The IPU Model's estimate of the samples per second of all replicas (not a
        PopTorch method): micro-batch × micro-batches per step × replicas over the
        estimated time of a step (pipeline schedule, weight update, stream copies), as
        the device sees it; with ``host_loop=True`` as a Python loop of calls sees it
        (the call's host time added: host link, outputs, PopTorch's per-call work;
        ``docs/ipu-model-estimates.md``).

        Raises:
            poptorch.Error: not compiled.
        """
        summary = self.ipuModelEstimate()
        if host_loop and summary.get("host"):
            return float(summary["host"]["samples_per_second"])
        return float(summary["cycles"]["samples_per_second"])

    def ipuModelEstimate(self) -> Dict[str, Any]:
        """The IPU Model's estimate of the compiled program (not a PopTorch method):
        the figures written to ``profile.json`` — memory per IPU by category (bytes),
        largest tensors, cycles per run, pipeline stages and schedule, samples per
        second (see ``docs/ipu-model-estimates.md``).

        Raises:
            poptorch.Error: not compiled.
        """
        return inspection.ipu_model_estimate(self._state)

    def compilationTime(self) -> datetime.timedelta:
        """Wall-clock time of the last compilation (docs/api-sections.md api §5.18).

        Raises:
            poptorch.Error: not compiled, or the progress bar was disabled.
        """
        return inspection.compilation_time(self._state)

    def getPerfCounters(self) -> Dict[str, List[List[float]]]:
        """Host timestamps of the transfers of the last run (docs/api-sections.md api §5.19)."""
        return inspection.perf_counters(self._state)

    def getHostIpuLatency(self):
        """``(min, max, mean)`` seconds from input start to input complete."""
        return inspection.latency(self._state, "input", min, "input_complete", max)

    def getComputeLatency(self):
        """``(min, max, mean)`` seconds from input complete to output start."""
        return inspection.latency(self._state, "input_complete", max, "output", max)

    def getIpuHostLatency(self):
        """``(min, max, mean)`` seconds from output start to output complete."""
        return inspection.latency(self._state, "output", min, "output_complete", max)

    def getLatency(self):
        """``(min, max, mean)`` seconds from input start to output complete."""
        return inspection.latency(self._state, "input", min, "output_complete", max)

    def getTensorNames(self) -> List[str]:
        """Names of the tensors of the compiled graph (docs/semantics.md S-16).

        Raises:
            AssertionError: not compiled.
        """
        return inspection.tensor_names(self._state)

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """The value of an anchor (``Options.anchorTensor``) captured by the last run.

        Raises:
            AssertionError: "No tensor with name <n> found." (unknown name or no run).
        """
        return inspection.anchored_tensor(self._state, short_name)

    def placementSummary(self, backward: bool = True) -> str:
        """Where the compiled program runs, as a readable table (docs/api-sections.md api §9,
        docs/semantics.md S-60).

        One row per (IPU, pipeline stage, phase) with the number of forward ops, of
        backward ops (training; counted on the joint forward/backward graph, ``-``
        with ``backward=False``), and the number and bytes of the parameters whose
        weight update runs there. The title gives the execution strategy, the IPUs
        per replica and the number of stages (``2F − 1`` for pipelined training,
        docs/semantics.md S-63). The same table (without backward counts) is logged at DEBUG when
        the model compiles. Not part of PopTorch's API.

        Raises:
            poptorch.Error: the model is not compiled yet.
        """
        return inspection.placement_summary(self._state, backward)

    def _debugGetPopartIR(self) -> str:
        """A text listing of the compiled graph's operations with their scoped names and
        the annotations the IPU compiler would read (``MultiConv``, ``Attribute``,
        available memory; docs/api-sections.md api §8)."""
        return inspection.program_text(self._state)
