"""``poptorch.plan.Plan``: a placement chosen by the planner, its estimate, and how to
apply it."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch.nn as nn

from popart_compiler.cost.cost_model import IpuEstimate
from poptorch._plan.apply import apply_to_model, apply_to_options
from poptorch.options import Options

__all__ = ["Plan"]


@dataclasses.dataclass
class Plan:
    """The plan :func:`poptorch.plan` chose: where every unit runs, the knobs, and the
    IPU Model's estimate of the placed program (the figures ``ipuModelEstimate()``
    reports after :meth:`apply` and compiling).

    Attributes:
        units: the units placed, in order: ``(module path, ipu, stage)``; a unit is
            everything from the start of its module's call to the next unit's.
        layers: paths of the model's repeated layers.
        num_ipus: IPUs per replica.
        head_ipu: IPU of the units after the last layer's (IPU 0 when the head is a
            stage of its own there, else the last IPU).
        checkpointed: layers whose outputs are recomputation checkpoints.
        recomputation: whether the program recomputes (per stage from its input or
            from the checkpoints); ``False``: everything backward needs is stashed.
        stage_checkpoints: per forward stage, whether every layer output is a
            checkpoint (``None`` without recomputation).
        available_memory_proportion: per IPU.
        serialization: vocabulary projection path → serialisation factor.
        micro_batch: samples per micro-batch.
        gradient_accumulation: micro-batches per weight update (training) or device
            iterations (inference).
        replicas: replication factor.
        optimizer_state_on_chip: where the optimizer state lives (``None``: as the
            options said, e.g. an optimizer without state).
        training: a training plan.
        estimate: the IPU Model's estimate of the placed program.
        plan_seconds: time taken to plan (capture, costing, search).
        explored: per micro-batch tried, the best placement's figures:
            ``{"micro_batch", "fits", "samples_per_second"}`` and, when it fits,
            ``"memory"`` (bytes per IPU), ``"available_memory_proportion"`` and
            ``"checkpointed"`` (layers).
    """
    units: List[Tuple[str, int, int]]
    layers: List[str]
    num_ipus: int
    head_ipu: int
    checkpointed: List[str]
    recomputation: bool
    stage_checkpoints: Optional[List[bool]]
    available_memory_proportion: List[float]
    serialization: Dict[str, int]
    micro_batch: int
    gradient_accumulation: int
    replicas: int
    optimizer_state_on_chip: Optional[bool]
    training: bool
    estimate: IpuEstimate
    plan_seconds: float = 0.0
    explored: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    _base_options: Any = None

    # -- the estimate -------------------------------------------------------------------

    @property
    def fits(self) -> bool:
        """Every IPU fits in its memory."""
        return self.estimate.fits

    @property
    def memory_per_ipu(self) -> List[int]:
        """Bytes needed on each IPU of a replica."""
        return [int(m.total) for m in self.estimate.memory]

    @property
    def samples_per_second(self) -> float:
        """Estimated samples per second of all replicas."""
        return self.estimate.samples_per_second

    @property
    def pipeline_efficiency(self) -> float:
        """``M × steady cycle / pipeline cycles`` (1 without a pipeline)."""
        return self.estimate.cycles.efficiency

    @property
    def layers_per_ipu(self) -> List[int]:
        """Repeated layers on each IPU (optimum-graphcore's ``layers_per_ipu``)."""
        layers = set(self.layers)
        counts = [0] * self.num_ipus
        for path, ipu, _stage in self.units:
            if path in layers:
                counts[ipu] += 1
        return counts

    @property
    def global_batch(self) -> int:
        """Samples per weight update of all replicas (training) or per run."""
        return self.micro_batch * self.gradient_accumulation * self.replicas

    # -- applying -----------------------------------------------------------------------

    def blocks(self) -> List[Tuple[str, int]]:
        """``(module path, ipu)`` of each block the plan starts: the first unit of every
        IPU, and of the head stage."""
        result, last = [], None
        for path, ipu, stage in self.units:
            if (ipu, stage) != last:
                result.append((path, ipu))
                last = (ipu, stage)
        return result if self.num_ipus > 1 else []

    def apply(self, model: nn.Module, options: Optional[Options] = None
              ) -> Options:
        """Apply the plan to ``model`` (in place) and to ``options``.

        The model's ``BeginBlock``\\ s are replaced by the plan's (one block per IPU,
        ``AutoStage.AutoIncrement``), its layers get the plan's recomputation
        checkpoints (``poptorch.recomputationCheckpoint`` on their outputs) and its
        vocabulary projections are computed by ``poptorch.serializedMatMul`` at the
        plan's factor (the same weights: numerics are unchanged within float
        rounding). Applying again replaces the previous plan's changes.

        Args:
            model: the model planned (or one with the same module structure).
            options: the options to set (pipelined execution, gradient accumulation
                or device iterations, available memory proportions, optimizer state
                location); ``None``: a copy of the options given to
                :func:`poptorch.plan`.

        Returns:
            The options: wrap ``model`` with them (``poptorch.trainingModel(model,
            options, optimizer)``) and feed ``global_batch`` samples per call.
        """
        apply_to_model(model, self.blocks(), self.checkpointed, self.serialization)
        if options is None:
            options = self._base_options.clone() if self._base_options is not None \
                else Options()
        return apply_to_options(options, self.training, self.num_ipus,
                                self.gradient_accumulation,
                                self.available_memory_proportion,
                                self.optimizer_state_on_chip)

    def ipu_config(self) -> Dict[str, Any]:
        """The plan as optimum-graphcore ``IPUConfig`` fields (``layers_per_ipu``
        counts the repeated layers; the embeddings run on IPU 0 and the head on
        :attr:`head_ipu`)."""
        checks = self.stage_checkpoints or []
        factors = set(self.serialization.values()) or {1}
        return {
            "ipus_per_replica": self.num_ipus,
            "layers_per_ipu": self.layers_per_ipu,
            "matmul_proportion": list(self.available_memory_proportion),
            "recompute_checkpoint_every_layer": bool(checks) and all(checks),
            "embedding_serialization_factor": max(factors),
            "optimizer_state_offchip": self.optimizer_state_on_chip is False,
            "replicated_tensor_sharding": self.replicas > 1 and
            self.optimizer_state_on_chip is not None,
            "replication_factor": self.replicas,
            "gradient_accumulation_steps": self.gradient_accumulation if self.training else 1,
            "device_iterations": 1 if self.training else self.gradient_accumulation,
        }

    # -- printing -----------------------------------------------------------------------

    def table(self) -> str:
        """The plan as a table: one row per IPU (its units per stage, repeated layers,
        available memory proportion, checkpoints per stage, MB needed / available), then
        the batch, knobs and throughput."""
        cap = self.estimate.target.memory_bytes
        rows = [f"{'IPU':>3}  {'units (per stage)':<58} {'layers':>6} {'amp':>5} "
                f"{'ckpt':>7} {'MB':>7} {'of MB':>6}"]
        memory = self.memory_per_ipu
        checks = self.stage_checkpoints
        stages: Dict[int, Dict[int, List[str]]] = {}
        for path, ipu, stage in self.units:
            stages.setdefault(ipu, {}).setdefault(stage, []).append(path)
        layers = self.layers_per_ipu
        for ipu in range(self.num_ipus):
            mine = stages.get(ipu, {})
            names = " + ".join(_span(mine[s]) for s in sorted(mine))
            layer_set = set(self.layers)
            ck = "-" if checks is None else "/".join(
                ("all" if checks[s] else "input") if layer_set & set(mine[s]) else "-"
                for s in sorted(mine))
            rows.append(f"{ipu:>3}  {names:<58} {layers[ipu]:>6} "
                        f"{self.available_memory_proportion[ipu]:>5.2f} {ck:>7} "
                        f"{memory[ipu] / 1e6:>7.1f} {cap / 1e6:>6.0f}")
        c = self.estimate.cycles
        state = {None: "as the options", True: "on chip", False: "off chip"}
        batches = "gradient accumulation" if self.training else "device iterations"
        serial = ", ".join(f"{p} x{f}" for p, f in self.serialization.items()
                           if f > 1) or "none"
        rows.append(f"micro-batch {self.micro_batch}, {batches} {self.gradient_accumulation}, "
                    f"replicas {self.replicas}; optimizer state "
                    f"{state[self.optimizer_state_on_chip]}; serialised: {serial}")
        rows.append(f"fits: {'yes' if self.fits else 'NO'}; {self.samples_per_second:,.1f} "
                    f"samples/s; pipeline efficiency {100 * c.efficiency:.1f} %; planned in "
                    f"{self.plan_seconds:.1f} s")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def _span(paths: List[str]) -> str:
    """``first..last (n)`` of consecutive module paths (their common prefix once)."""
    if len(paths) == 1:
        return paths[0]
    first, last = paths[0], paths[-1]
    common = 0
    for a, b in zip(first.split("."), last.split(".")):
        if a != b:
            break
        common += len(a) + 1
    return f"{first}..{last[common:]} ({len(paths)})"
