"""The session options PopTorch's compiler sets by itself when the user did not.

PopTorch's ``Compiler::initSession`` (``shared/reference/Compiler.cpp``) derives a
number of PopART session options from the program and the other options, each only
when the user left it unset (its ``setOptionIfNotSet``), and logs every one at DEBUG
as "``<option> set to value <value>``". :func:`implicit_defaults` reproduces that list
as a pure function of the typed session options
(:class:`~popart_compiler.session_options.SessionOptions`, its PopART part
:class:`~popart_compiler.popart_options.PopartOptions`) and a few facts about the
placed program (:class:`ProgramFacts`); :func:`with_defaults` returns the session
options with them added (``dataclasses.replace``), which is what the IPU Model's
estimate, the runtime and the profile report read. The table of every default, where it
comes from and what it changes is in ``docs/ipu-model-estimates.md``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Tuple

from popart_compiler.enums import ExecutionMode, Liveness
from popart_compiler.logging import logger
from popart_compiler.popart_enums import (AccumulateOuterFragmentSchedule,
                                          RecomputationType, VirtualGraphMode)
from popart_compiler.popart_options import LOCATION_KEYS, PopartOptions
from popart_compiler.session_options import SessionOptions

__all__ = ["ProgramFacts", "ImplicitDefault", "implicit_defaults", "with_defaults",
           "log_defaults", "LOCATION_KEYS"]

#: The defaults that have a typed :class:`PopartOptions` field, by option key.
_TYPED_FIELDS = {"autoRecomputation": "auto_recomputation",
                 "enablePipelining": "enable_pipelining",
                 "enableLoadAndOffloadRNGState": "rng_state"}


@dataclasses.dataclass(frozen=True)
class ProgramFacts:
    """What ``initSession`` knows about the program besides the options.

    Attributes:
        training: a training program.
        used_ipus: distinct IPUs the program's ops run on (one replica).
        max_phase: the highest execution phase (phased execution; 0 otherwise).
        overlapped_io: an input or output is marked for overlapped IO
            (``set_overlap_for_input`` / ``set_overlap_for_output``).
        clipping: the optimizer clips the gradient norm (``max_grad_norm`` finite).
    """
    training: bool
    used_ipus: int = 1
    max_phase: int = 0
    overlapped_io: bool = False
    clipping: bool = False


@dataclasses.dataclass(frozen=True)
class ImplicitDefault:
    """One option PopTorch's compiler set because the user did not.

    Attributes:
        key: the option's key in ``SessionOptions.raw`` (``engineOptions[...]`` keys
            live inside the ``engineOptions`` map).
        value: the value as the options dictionary holds it (an int for enums).
        shown: the value as PopTorch logs it (``Pipeline``, ``true``).
        reason: why (for the log and the profile report).
    """
    key: str
    value: Any
    shown: str
    reason: str


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _strategy_defaults(options: SessionOptions, facts: ProgramFacts
                       ) -> Tuple[VirtualGraphMode, list]:
    """The execution strategy's defaults and its virtual graph mode."""
    strategy = options.strategy
    mode = strategy.mode
    graph_mode = VirtualGraphMode.Auto
    found = []
    if mode is ExecutionMode.Pipelined:
        multi = facts.used_ipus > 1
        found.append(("enablePipelining", multi, _bool(multi),
                      f"pipelined execution over {facts.used_ipus} IPU(s)"))
        if multi:
            graph_mode = VirtualGraphMode.Manual
            found.append(("autoRecomputation", int(RecomputationType.Pipeline), "Pipeline",
                          "a pipeline over more than one IPU recomputes by default"))
        if facts.clipping:
            found.append(("accumulateOuterFragmentSettings.schedule",
                          int(AccumulateOuterFragmentSchedule.Scheduler),
                          "AccumulateOuterFragmentSchedule::Scheduler",
                          "gradient clipping with pipelining"))
    elif mode is ExecutionMode.Sharded:
        found.append(("enablePipelining", False, "false", "sharded execution"))
        if facts.used_ipus > 1 or facts.overlapped_io:
            graph_mode = VirtualGraphMode.Manual
    else:  # phased
        found.append(("enablePipelining", False, "false", "phased execution"))
        graph_mode = VirtualGraphMode.ExecutionPhases
        phases = facts.max_phase + 1
        if strategy.liveness is not Liveness.AlwaysLive:
            phases += 3  # tensors stay live over 3 phases before going off chip
        elif strategy.separate_backward_phase:
            phases += 1
        stages = 1 if strategy.serial_phases else 2
        found.append(("executionPhaseSettings.phases", phases, str(phases),
                      "phased execution"))
        found.append(("executionPhaseSettings.stages", stages, str(stages),
                      "serial phases" if stages == 1 else "parallel phases"))
        for key in LOCATION_KEYS:
            found.append((key, "OffChip", "useOnChipStorage(False)", "phased execution"))
    return graph_mode, found


def implicit_defaults(options: SessionOptions, facts: ProgramFacts
                      ) -> Tuple[ImplicitDefault, ...]:
    """The options PopTorch's ``initSession`` would set for this program, in its order.

    Args:
        options: the session options (replicas, processes, gradient accumulation, the
            execution strategy, and which PopART options are set:
            ``options.popart.set_keys`` and the tensor locations' ``on_chip``).
        facts: what the placed program tells (:class:`ProgramFacts`).

    Returns:
        One :class:`ImplicitDefault` per option the user did not set, in the order
        PopTorch sets them (a program on no IPU gets none, as PopTorch skips its
        session).
    """
    if facts.used_ipus < 1:
        return ()
    replicas, processes = options.replication_factor, options.num_processes
    process = options.process_id
    accumulation = options.gradient_accumulation if facts.training else 1
    popart = options.popart
    found = [("engineOptions[debug.retainDebugInformation]", "false", "false",
              "Poplar keeps no debug information unless asked")]
    graph_mode, strategy = _strategy_defaults(options, facts)
    found += strategy
    found.append(("enableLoadAndOffloadRNGState", True, "true",
                  "the RNG state can be saved and restored"))
    found.append(("virtualGraphMode", int(graph_mode), graph_mode.name,
                  "the execution strategy's graph mode"))
    found.append(("enableDistributedReplicatedGraphs", processes > 1,
                  _bool(processes > 1), f"{processes} process(es)"))
    found.append(("globalReplicationFactor", processes * replicas,
                  str(processes * replicas), "processes x local replicas"))
    found.append(("globalReplicaOffset", process * replicas, str(process * replicas),
                  "process index x local replicas"))
    found.append(("enableReplicatedGraphs", replicas > 1, _bool(replicas > 1),
                  f"{replicas} local replica(s)"))
    found.append(("constantWeights", False, "false", "weights stay variables"))
    found.append(("enableGradientAccumulation", accumulation > 1,
                  _bool(accumulation > 1), f"gradient accumulation {accumulation}"))
    if facts.overlapped_io:
        found.append(("useHostCopyOps", True, "true", "overlapped IO"))
        found.append(("enableExplicitMainLoops", True, "true", "overlapped IO"))
    return tuple(ImplicitDefault(key, value, shown, reason)
                 for key, value, shown, reason in found if not _is_set(popart, key))


def _is_set(popart: PopartOptions, key: str) -> bool:
    """Whether option ``key`` holds a value (a location: its ``useOnChipStorage``)."""
    if key in LOCATION_KEYS:
        return popart.location(key).on_chip is not None
    return key in popart.set_keys


def with_defaults(options: SessionOptions, defaults: Tuple[ImplicitDefault, ...]
                  ) -> SessionOptions:
    """``options`` with ``defaults`` added (new options; ``options`` is not changed):
    the typed PopART options they set (``popart``: recomputation, pipelining, RNG
    state, off-chip locations, and every key among ``set_keys``) and the option
    dictionary (``raw``: engine-option defaults in its ``engineOptions`` map, location
    defaults as ``onChip = 0``, every other default under its key)."""
    popart = options.popart
    changes: Dict[str, Any] = {}
    for d in defaults:
        if d.key in LOCATION_KEYS:
            changes[d.key] = dataclasses.replace(popart.location(d.key), on_chip=False)
        elif d.key == "autoRecomputation":
            changes["auto_recomputation"] = RecomputationType(int(d.value))
        elif d.key in _TYPED_FIELDS:
            changes[_TYPED_FIELDS[d.key]] = d.value
    popart = dataclasses.replace(popart, set_keys=popart.set_keys | {
        d.key for d in defaults if d.key not in LOCATION_KEYS}, **changes)
    return dataclasses.replace(options, popart=popart, raw=_with_raw(options.raw, defaults))


def _with_raw(raw: Mapping[str, Any], defaults: Tuple[ImplicitDefault, ...]
              ) -> Dict[str, Any]:
    """``raw`` with ``defaults`` added (a new dictionary)."""
    merged: Dict[str, Any] = dict(raw)
    for d in defaults:
        if d.key.startswith("engineOptions["):
            name = d.key[len("engineOptions["):-1]
            merged["engineOptions"] = {**(merged.get("engineOptions") or {}), name: d.value}
        elif d.key in LOCATION_KEYS:
            merged[d.key] = {**(merged.get(d.key) or {}), "onChip": 0}
        else:
            merged[d.key] = d.value
    return merged


def log_defaults(defaults: Tuple[ImplicitDefault, ...]) -> None:
    """Log each default at DEBUG in PopTorch's form, "``<option> set to value <v>``"."""
    for d in defaults:
        logger.debug("%s set to value %s (PopTorch's default: %s)", d.key, d.shown, d.reason)
