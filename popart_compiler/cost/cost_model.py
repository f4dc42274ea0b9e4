"""The IPU Model's estimate of a compiled program: memory per IPU, cycles, throughput.

:func:`estimate` ties the parts together: :mod:`.op_costs` (per-op shapes, FLOPs and
placement), :mod:`.memory_model` (bytes per IPU by category, out-of-memory) and
:mod:`.cycle_model` (per-op cycles, pipeline schedule, samples per second). It reads
only shapes (``node.meta["val"]``), so it is cheap for large models captured on the
``meta`` device. The compiler calls it for every program and raises the
out-of-memory report (:func:`check`: a warning, or an error in strict mode);
``PoplarExecutor.cycleCount()`` and ``estimatedThroughput()`` read the result
(docs/api-sections.md api §5.17, docs/semantics.md S-85).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from popart_compiler.cost.cycle_model import CycleEstimate, CycleSettings, estimate_cycles
from popart_compiler.cost.host_model import HostSettings, HostTime, host_time
from popart_compiler.cost.ipu_model import IpuTarget
from popart_compiler.enums import ExecutionMode, OutputMode
from popart_compiler.ir import Graph
from popart_compiler.logging import logger
from popart_compiler.errors import backend_error
from popart_compiler.cost.memory_model import IpuMemory, Location, MemorySettings, estimate_memory
from popart_compiler.cost.memory_report import memory_problem
from popart_compiler.cost.op_costs import ProgramCosts, collect
from popart_compiler.implicit_defaults import (ImplicitDefault, ProgramFacts, implicit_defaults,
                                               with_defaults)
from popart_compiler.popart_enums import RecomputationType
from popart_compiler.popart_options import TensorLocation
from popart_compiler.session_options import SessionOptions

__all__ = ["IpuEstimate", "estimate", "estimate_costs", "estimate_with", "memory_settings",
           "cycle_settings", "check", "with_implicit_defaults", "host_settings",
           "call_time"]


@dataclasses.dataclass
class IpuEstimate:
    """Memory and cycles of a program on the IPU Model.

    Attributes:
        target: the IPU (tile count of the small IPU Model when selected).
        costs: the costed program.
        memory: per IPU of one replica.
        cycles: cycles and throughput of one replica (throughput of all replicas).
        settings: the memory settings used.
        micro_batch: samples per micro-batch.
        replicas: replication factor.
        defaults: the options PopTorch's compiler set because the user did not
            (:mod:`popart_compiler.implicit_defaults`), as the estimate used them.
        host: the host time of one call (:mod:`.host_model`).
        host_settings: what it was computed from (``summary()["host"]["settings"]``).
    """
    target: IpuTarget
    costs: ProgramCosts
    memory: List[IpuMemory]
    cycles: CycleEstimate
    settings: MemorySettings
    micro_batch: int
    replicas: int
    defaults: Tuple[ImplicitDefault, ...] = ()
    host: Optional[HostTime] = None
    host_settings: Optional[HostSettings] = None

    @property
    def fits(self) -> bool:
        """Whether every IPU fits in its on-chip memory."""
        return all(m.fits for m in self.memory)

    @property
    def samples_per_second(self) -> float:
        """Estimated samples per second of all replicas, as the device sees it."""
        return self.cycles.samples_per_second

    @property
    def loop_samples_per_second(self) -> float:
        """Estimated samples per second of a Python loop of calls (:mod:`.host_model`:
        the device's run plus the call's host time); the device's figure when the host
        time is unknown."""
        return self.host.loop_samples_per_second if self.host else self.samples_per_second

    def summary(self) -> Dict[str, Any]:
        """A JSON-ready summary (the figures of ``profile.json``)."""
        c = self.cycles
        return {
            "target": {"name": self.target.name, "tiles": self.target.tiles,
                       "sram_per_tile": self.target.sram_per_tile,
                       "clock_hz": self.target.clock_hz,
                       "memory_per_ipu": self.target.memory_bytes},
            "replicas": self.replicas, "micro_batch": self.micro_batch,
            "fits": self.fits,
            "memory": [{"ipu": m.ipu, "capacity": m.capacity, "total": int(m.total),
                        "fits": m.fits, "off_chip": int(m.off_chip),
                        "categories": {k: int(v) for k, v in m.categories.items()},
                        "largest": [{"name": n, "category": cat, "bytes": int(b)}
                                    for n, cat, b in m.largest]}
                       for m in self.memory],
            "cycles": {"run": int(c.run_cycles), "pipeline": int(c.pipeline_cycles),
                       "weight_update": int(c.update_cycles),
                       "samples_per_second": round(c.samples_per_second, 3),
                       "pipeline_efficiency": round(c.efficiency, 4),
                       "stages": [{"name": s.name, "ipu": s.ipu, "cycles": int(s.cycles),
                                   "forward_cycles": int(s.forward_cycles),
                                   "balance": round(b, 4)}
                                  for s, b in zip(c.stages, c.balance)],
                       "schedule": [{"cycles": int(p.cycles), "repeat": p.repeat,
                                     "work": [{"ipu": i, "stage": n, "micro_batch": mb,
                                               "cycles": int(w), "forward_cycles": int(f)}
                                              for i, n, mb, w, f in p.work]}
                                    for p in c.schedule]},
            "host": None if self.host is None else {
                "seconds_per_call": self.host.total, "device": self.host.device,
                "call": self.host.call, "inputs": self.host.inputs,
                "outputs": self.host.outputs, "loading": self.host.loading,
                "sync": self.host.sync,
                "samples_per_call": self.host.samples,
                "samples_per_second": round(self.host.loop_samples_per_second, 3),
                "settings": None if self.host_settings is None else {
                    **dataclasses.asdict(self.host_settings),
                    "output_mode": int(self.host_settings.output_mode)}},
        }


def _optimizer_state(optimizer, accumulating: bool) -> Tuple[float, int]:
    """``(state bytes per trainable element, state tensors in the parameter's dtype)``
    (docs/semantics.md S-54 dtypes). The combined SGD variant keeps one tensor, PopART's velocity,
    in the parameter's dtype whenever it has momentum or accumulates (it is also the gradient
    accumulator)."""
    if optimizer is None:
        return 0.0, 0
    size = lambda dtype: torch.empty((), dtype=dtype).element_size()  # noqa: E731
    hyper = [optimizer.defaults] + list(optimizer.groups)
    if optimizer.type == "SGD":
        momentum = any(h.get("momentum", 0.0) for h in hyper) or \
            optimizer.is_variable("momentum")
        if optimizer.use_combined_accum:
            return 0.0, int(momentum or accumulating)
        return (float(size(optimizer.velocity_accum_type)) if momentum else 0.0), 0
    if optimizer.type in ("Adam", "AdamW", "LAMB"):
        return float(size(optimizer.first_order_type) + size(optimizer.second_order_type)), 0
    total = size(optimizer.second_order_type)  # RMSprop
    if any(h.get("centered", False) for h in hyper):
        total += size(optimizer.first_order_type)
    if any(h.get("momentum", 0.0) for h in hyper):
        total += size(optimizer.accum_type)
    return float(total), 0


def memory_settings(options: SessionOptions, training: bool, optimizer=None
                    ) -> MemorySettings:
    """The :class:`MemorySettings` of these session options and optimizer.

    Reads the typed PopART options (``options.popart``,
    :class:`~popart_compiler.popart_options.PopartOptions`): ``autoRecomputation`` and
    ``explicitRecomputation``, ``enablePipelining`` with the execution strategy's mode
    (``options.strategy.mode``: pipelined unless sharded or phased),
    ``enableLoadAndOffloadRNGState``, the four tensor locations (docs/api-sections.md
    options §4.3), ``available_memory_proportion`` and the partials types. The compiler
    hands it the options with PopTorch's implicit defaults added
    (:mod:`popart_compiler.implicit_defaults`: ``autoRecomputation = Pipeline`` for a
    pipeline over several IPUs, off-chip locations for phased execution, ...).
    """
    popart = options.popart
    accumulating = training and options.gradient_accumulation > 1
    combined = optimizer is not None and optimizer.type == "SGD" and \
        optimizer.use_combined_accum
    accum = 0.0
    if accumulating and not combined:
        accum = float(torch.empty((), dtype=optimizer.accum_type).element_size()) \
            if optimizer is not None else 4.0
    state, param_tensors = _optimizer_state(optimizer, accumulating) if training else (0.0, 0)
    return MemorySettings(
        training=training,
        optimizer_bytes=state,
        optimizer_param_tensors=param_tensors,
        accumulator_bytes=accum,
        replicas=options.replication_factor,
        # unset: PopTorch's default, Pipeline, which acts in a pipeline of several
        # IPUs only (implicit_defaults.py; activation_memory.recomputation_active)
        auto_recomputation=RecomputationType.Pipeline if popart.auto_recomputation is None
        else popart.auto_recomputation,
        explicit_recomputation=popart.explicit_recomputation,
        pipelined=options.strategy.mode is ExecutionMode.Pipelined and
        popart.enable_pipelining is not False,
        rng_state=popart.rng_state is not False,  # PopTorch's default: on
        weight=_location(popart.location_weight),
        optimizer=_location(popart.location_optimizer),
        accumulator=_location(popart.location_accumulator),
        activation=_location(popart.location_activation),
        available_memory=dict(popart.available_memory),
        half_partials=popart.half_partials_matmul,
        conv_half_partials=popart.half_partials_conv)


def _location(where: TensorLocation) -> Location:
    """The memory model's :class:`Location` of a tensor location (on chip unless
    chosen otherwise)."""
    return Location(on_chip=where.on_chip is not False, sharded=where.sharded,
                    min_off_chip=where.min_off_chip, min_sharding=where.min_sharding)


def estimate(graph: Graph, options: SessionOptions, training: bool, target: IpuTarget,
             optimizer=None, layers_per_ipu: Optional[Sequence[int]] = None,
             head_ipu: Optional[int] = None) -> IpuEstimate:
    """Estimate memory per IPU, cycles and throughput of ``graph``.

    Args:
        graph: the captured program (one micro-batch); placement from
            ``node.meta["placement"]`` (IPU 0 / stage 0 where absent).
        options: batching, replication, recomputation, tensor locations, available
            memory proportions.
        training: forward, backward and weight update.
        target: the IPU (see :func:`~popart_compiler.cost.ipu_model.target_for`).
        optimizer: the ``OptimizerDescription`` (training); ``None``: no state.
        layers_per_ipu: layers-per-IPU list used when the graph has no placement.
        head_ipu: with ``layers_per_ipu``, the IPU of the ops after the last layer.

    Returns:
        The :class:`IpuEstimate`. Logs the estimated samples per second at INFO.
    """
    costs = collect(graph, layers_per_ipu, head_ipu)
    user = graph.user_inputs
    micro = int(user[0].shape[0]) if user and user[0] is not None and \
        len(user[0].shape) else 1
    return estimate_costs(costs, options, training, target, optimizer, micro)


def cycle_settings(settings: MemorySettings, options: SessionOptions, training: bool,
                   optimizer, micro_batch: int) -> CycleSettings:
    """The :class:`CycleSettings` of these options: micro-batches per weight update
    (training: ``gradientAccumulation``) or per run (``deviceIterations``), the
    optimizer, ``numIOTiles``."""
    return CycleSettings(
        memory=settings, micro_batch=micro_batch,
        micro_batches=options.gradient_accumulation if training
        else options.device_iterations,
        device_iterations=options.device_iterations,
        optimizer=optimizer.type if optimizer is not None else "SGD",
        io_tiles=options.popart.io_tiles,
        synthetic=options.synthetic_data, output_mode=options.output_mode,
        output_return_period=options.output_return_period,
        accumulation=options.gradient_accumulation if training else 1)


def with_implicit_defaults(options: SessionOptions, costs: ProgramCosts, training: bool,
                           optimizer=None
                           ) -> Tuple[SessionOptions, Tuple[ImplicitDefault, ...]]:
    """``options`` with the defaults PopTorch's compiler derives for this program
    (:mod:`popart_compiler.implicit_defaults`) added where the user set nothing: the
    compiler's ``session_defaults`` pass has added them already; a direct call of
    :func:`estimate` gets the same. Facts come from the costed program (the IPUs its
    ops use) and the optimizer (gradient clipping). Returns the options and the
    defaults added."""
    norm = getattr(optimizer, "max_grad_norm", math.inf) if training else math.inf
    facts = ProgramFacts(training=training,
                         used_ipus=max(1, len({op.ipu for op in costs.ops})),
                         clipping=norm is not None and math.isfinite(norm))
    defaults = implicit_defaults(options, facts)
    return with_defaults(options, defaults), defaults


def estimate_costs(costs: ProgramCosts, options: SessionOptions, training: bool,
                   target: IpuTarget, optimizer=None, micro_batch: int = 1) -> IpuEstimate:
    """:func:`estimate` of a program already costed (:func:`~.op_costs.collect`), under
    ``options`` with PopTorch's implicit defaults (:func:`with_implicit_defaults`)."""
    options, defaults = with_implicit_defaults(options, costs, training, optimizer)
    settings = memory_settings(options, training, optimizer)
    result = estimate_with(costs, target, settings,
                           cycle_settings(settings, options, training, optimizer, micro_batch))
    return dataclasses.replace(result, defaults=defaults)


def _host_of(costs: ProgramCosts, settings: MemorySettings, cycles: CycleSettings
             ) -> HostSettings:
    return HostSettings(
        micro_batches=cycles.accumulation, device_iterations=cycles.device_iterations,
        replicas=settings.replicas, ipus_per_replica=costs.num_ipus,
        input_bytes=costs.input_bytes, output_bytes=costs.output_bytes,
        output_mode=cycles.output_mode,
        output_return_period=cycles.output_return_period, synthetic=cycles.synthetic)


def host_settings(options: SessionOptions, training: bool, costs: ProgramCosts,
                  loader_samples_per_s: Optional[float] = None) -> HostSettings:
    """The :class:`~.host_model.HostSettings` of these options and program."""
    return HostSettings(
        micro_batches=options.gradient_accumulation if training else 1,
        device_iterations=options.device_iterations,
        replicas=options.replication_factor, ipus_per_replica=costs.num_ipus,
        input_bytes=costs.input_bytes, output_bytes=costs.output_bytes,
        output_mode=options.output_mode,
        output_return_period=options.output_return_period,
        synthetic=options.synthetic_data, loader_samples_per_s=loader_samples_per_s)


def call_time(result: "IpuEstimate", options: SessionOptions, training: bool,
              loader_samples_per_s: Optional[float] = None) -> HostTime:
    """The host time of one call of the estimated program (:func:`.host_model.host_time`),
    optionally fed by a ``DataLoader`` of ``loader_samples_per_s``."""
    device = result.cycles.run_cycles / result.target.clock_hz
    return host_time(device, result.micro_batch,
                     host_settings(options, training, result.costs, loader_samples_per_s))


def estimate_with(costs: ProgramCosts, target: IpuTarget, settings: MemorySettings,
                  cycles_settings: CycleSettings) -> IpuEstimate:
    """:func:`estimate` of a costed program under explicit memory and cycle settings
    (what :func:`memory_settings` and :func:`cycle_settings` derive from options)."""
    memory = estimate_memory(costs, target, settings)
    cycles = estimate_cycles(costs, target, cycles_settings)
    result = IpuEstimate(target, costs, memory, cycles, settings, cycles_settings.micro_batch,
                         settings.replicas)
    result.host_settings = _host_of(costs, settings, cycles_settings)
    result.host = host_time(cycles.run_cycles / target.clock_hz, cycles_settings.micro_batch,
                            result.host_settings)
    logger.info("IPU Model estimate (%s, %d IPU(s) per replica): %s; %d cycles per run; "
                "%.1f samples/s; pipeline efficiency %.1f %%", target.name, costs.num_ipus,
                ", ".join(f"IPU {m.ipu} {m.total / 1e6:.1f}/{m.capacity / 1e6:.1f} MB"
                          for m in memory), cycles.run_cycles, cycles.samples_per_second,
                100 * cycles.efficiency)
    return result


def check(result: IpuEstimate, strict: bool = False, allow_out_of_memory: bool = False
          ) -> None:
    """Report a program that does not fit, as Poplar's IPU Model does; raise in strict
    mode.

    Args:
        result: the estimate.
        strict: ``Options.ipuModelStrictMemory`` / ``POPTORCH_IPU_MODEL_STRICT_MEMORY``:
            raise the out-of-memory error, as hardware would.
        allow_out_of_memory: the ``debug.allowOutOfMemory`` engine option: never
            raise (profiling reports a program that does not fit).

    Without ``strict`` (or with ``allow_out_of_memory``) a program that does not fit
    logs a warning with the error's text (the IPUs, bytes needed / available, largest
    categories and tensors) and compiles; ``result.fits`` is ``False``.

    Raises:
        Error: ``type == "poplar_out_of_memory"`` (see
            :func:`~popart_compiler.cost.memory_report.memory_problem`), in strict mode only.
    """
    problem = memory_problem(result.memory, result.target, result.settings,
                             result.micro_batch)
    if problem is None:
        return
    if strict and not allow_out_of_memory:
        raise backend_error(problem, type="poplar_out_of_memory")
    reason = ("debug.allowOutOfMemory is set" if allow_out_of_memory else
              "the IPU Model runs it, as Poplar's IPU Model does; hardware would refuse "
              "to compile it. poptorch.Options().ipuModelStrictMemory(True) or "
              "POPTORCH_IPU_MODEL_STRICT_MEMORY=1 make this an error")
    logger.warning("The program does not fit in the IPU's memory (%s).\n%s", reason,
                   problem)
