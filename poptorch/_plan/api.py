"""``poptorch.plan()``: capture a model once per micro-batch size, search the IPU Model's
estimate for the fastest placement that fits, and say what would fit when nothing does.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from popart_compiler.errors import Error, py_error
from popart_compiler.planner.candidate import Candidate, full_estimate
from popart_compiler.planner.problem import DEFAULT_PROPORTIONS
from popart_compiler.planner.search import Scored, Space, closest, search
from poptorch._plan.arguments import check_arguments, check_fits_units, micro_batches_to_try
from poptorch._plan.capture import Planning, capture_for_planning
from poptorch._plan.result import Plan
from poptorch.options import Options

__all__ = ["plan"]

#: At most this many more IPUs are tried when suggesting more.
_MAX_EXTRA_IPUS = 8


def _resize(inputs: Sequence, batch: int) -> Tuple:
    """``inputs`` with ``batch`` samples along the first dimension of every tensor
    (rows repeated or dropped; meta tensors are new meta tensors)."""
    result = []
    for t in inputs:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            result.append(t)
        elif t.device.type == "meta":
            result.append(torch.empty((batch, *t.shape[1:]), dtype=t.dtype, device="meta"))
        else:
            index = torch.arange(batch) % t.shape[0]
            result.append(t[index])
    return tuple(result)


@dataclasses.dataclass
class _Request:
    model: nn.Module
    inputs: Tuple
    options: Options
    optimizer: Any
    training: bool
    ipus: int
    global_batch: Optional[int]
    proportions: Tuple[float, ...]
    serialize: bool
    recomputation: bool
    head: bool
    optimizer_state: Optional[bool]
    time_limit: float

    @property
    def replicas(self) -> int:
        return self.options.replication_factor

    def micro_batches(self, micro_batch: int) -> Optional[int]:
        """Gradient accumulation (training) or device iterations (inference) for
        ``micro_batch``; ``None`` when the global batch does not divide."""
        if self.global_batch is None:
            return self.options.Training.gradient_accumulation if self.training \
                else self.options.device_iterations
        per = micro_batch * self.replicas
        if self.global_batch % per:
            return None
        return self.global_batch // per


class _Planner:
    """Captures (once per micro-batch) and searches."""

    def __init__(self, request: _Request):
        self.r = request
        self.captures: Dict[int, Planning] = {}

    def planning(self, micro_batch: int) -> Planning:
        if micro_batch not in self.captures:
            r = self.r
            self.captures[micro_batch] = capture_for_planning(
                r.model, _resize(r.inputs, micro_batch), r.options, r.optimizer,
                r.training, r.micro_batches(micro_batch), r.proportions, r.serialize)
        return self.captures[micro_batch]

    def space(self, planning: Planning, ipus: int, micro_batches: int) -> Space:
        r = self.r
        units = planning.problem.units
        last_layer = max((k for k, u in enumerate(units) if u.layer), default=-1)
        heads = tuple(k for k in range(last_layer + 1, len(units))) if r.head else ()
        stateful = planning.optimizer is not None and (
            planning.problem.memory.optimizer_bytes > 0 or
            planning.problem.memory.optimizer_param_tensors > 0)
        if r.optimizer_state is not None:
            on_chip: Tuple[Optional[bool], ...] = (r.optimizer_state,)
        else:
            on_chip = (True, False) if stateful else (None,)
        modes = (False, True) if r.recomputation and r.training else (False,)
        serial = tuple((planning.head_ops[p], f) for p, f in planning.heads.items()
                       if p in planning.head_ops)
        return Space(ipus, micro_batches, heads, modes, on_chip, serial)

    def best(self, micro_batch: int, ipus: int) -> Optional[Scored]:
        m = self.r.micro_batches(micro_batch)
        if m is None:
            return None
        planning = self.planning(micro_batch)
        return search(planning.problem, self.space(planning, ipus, m), self.r.time_limit)


def _explored(planner: _Planner, micro_batch: int, scored: Optional[Scored]) -> Dict[str, Any]:
    """A micro-batch tried: whether something fits and the best placement's figures."""
    entry: Dict[str, Any] = {"micro_batch": micro_batch, "fits": scored is not None,
                             "samples_per_second": 0.0}
    if scored is None:
        return entry
    problem = planner.planning(micro_batch).problem
    cand = scored.candidate
    stages = [st for _, st in cand.stages(len(problem.units))]
    present = problem.present(stages)
    entry.update(samples_per_second=scored.samples_per_second, memory=list(scored.totals),
                 available_memory_proportion=list(cand.proportions),
                 checkpointed=[u.name for u in problem.units
                               if u.markers and all(m in present for m in u.markers)])
    return entry


def _plan_of(planner: _Planner, micro_batch: int, cand: Candidate, seconds: float = 0.0,
             explored: Optional[List[Dict[str, Any]]] = None) -> Plan:
    """The :class:`Plan` of candidate ``cand`` (estimated as the whole placed program)."""
    r = planner.r
    planning = planner.planning(micro_batch)
    problem = planning.problem
    m = r.micro_batches(micro_batch)
    estimate = full_estimate(problem, cand, m)
    placement = cand.stages(len(problem.units))
    units = []
    for ipu, st in sorted(placement, key=lambda s: s[1].first):
        for k in range(st.first, st.last + 1):
            units.append((problem.units[k].name, ipu, st.position))
    present = problem.present([st for _, st in placement])
    checkpointed = [u.name for u in problem.units if u.markers and
                    all(mk in present for mk in u.markers)]
    head_ipu = 0 if cand.head is not None else cand.num_ipus - 1
    op_to_path = {op: path for path, op in planning.head_ops.items()}
    serialization = {op_to_path[name]: f for name, f in cand.serialization}
    for path in planning.heads:
        serialization.setdefault(path, 1)  # captured as a serialised matmul: keep it one
    return Plan(units, planning.layers, cand.num_ipus, head_ipu, checkpointed,
                problem.recomputes(cand.num_ipus + (cand.head is not None)),
                list(cand.checkpoints) if cand.checkpoints is not None else None,
                list(cand.proportions), serialization, micro_batch, m, r.replicas,
                cand.optimizer_on_chip, r.training, estimate, seconds, explored or [],
                _base_options=r.options)


def plan(model: nn.Module, *example_inputs, options: Optional[Options] = None,
         optimizer: Optional[torch.optim.Optimizer] = None, ipus: int = 1,
         training: bool = True, micro_batch: Union[None, int, Sequence[int]] = None,
         global_batch: Optional[int] = None,
         available_memory_proportions: Sequence[float] = DEFAULT_PROPORTIONS,
         serialize: bool = True, recomputation: bool = True, head_on_first_ipu: bool = True,
         optimizer_state_on_chip: Optional[bool] = None,
         time_limit: float = 600.0) -> Plan:
    """Choose the placement of ``model`` on ``ipus`` IPUs that fits and runs fastest on
    the IPU Model, with the knobs PopTorch users tuned by hand.

    The model is captured once per micro-batch size tried (build it on the ``meta``
    device to plan without weights: only shapes are read). Its repeated layers (the
    modules of its largest ``nn.ModuleList`` / ``nn.Sequential`` family, or the finer
    ones nested in them, such as a Swin's blocks inside its stages, up to
    ``MAX_UNITS`` units: ``poptorch/_plan/structure.py``) and the modules with weights
    around them (embeddings, heads, a stage's downsampling) are the *units*; a plan puts
    consecutive units on each IPU (a pipeline stage per IPU, optionally the units after
    the last layer as one more stage on IPU 0, where tied embeddings are), and chooses:

    * per stage, whether every layer output is a recomputation checkpoint or the stage
      recomputes from its input, or no recomputation at all;
    * per IPU, the available memory proportion (``available_memory_proportions``);
    * the serialisation factor of vocabulary projections (``nn.Linear`` layers tied to
      an embedding or with ≥ 16384 outputs): ``poptorch.serializedMatMul``;
    * the optimizer state on or off chip (with replicated tensor sharding when
      replicated);
    * the micro-batch (among ``micro_batch``) and with it the gradient accumulation
      a ``global_batch`` allows.

    The search is exact over that space for the IPU Model's estimate (branch and
    bound over consecutive splits; each IPU's estimate depends only on its own units).
    While it is captured the model carries the planner's blocks, checkpoints and
    serialised projections (its own ``BeginBlock`` calls set aside); everything is
    restored afterwards.

    Args:
        model: the model (its ``forward`` returns the loss in training).
        *example_inputs: ``forward``'s arguments for one micro-batch (the first
            dimension of every tensor is the batch).
        options: ``poptorch.Options`` (replicas, precision, target via
            ``useOfflineIpuTarget``, ``gradientAccumulation`` without
            ``global_batch``); not modified. Default: ``poptorch.Options()``.
        optimizer: the training optimizer (its state counts); default PopTorch's SGD.
        ipus: IPUs per replica (at most the number of units).
        training: plan a training program (else inference).
        micro_batch: the micro-batch, or candidates to try (one capture each);
            default: the examples' batch.
        global_batch: samples per weight update of all replicas: gradient
            accumulation = global_batch / (micro_batch × replicas). Default: the
            options' gradient accumulation (device iterations in inference).
        available_memory_proportions: proportions tried per IPU (non-empty, each in
            ``(0, 1]``).
        serialize: allow serialising vocabulary projections.
        recomputation: allow recomputation checkpoints.
        head_on_first_ipu: allow the head as a stage on IPU 0.
        optimizer_state_on_chip: force the optimizer-state location (``None``: try
            both).
        time_limit: seconds per search, ≥ 0 (the best found so far is kept).

    Returns:
        The :class:`~poptorch.plan.Plan` (``plan.apply(model, options)`` applies it;
        ``print(plan)`` shows it).

    Raises:
        Error: nothing fits: the message gives the closest placement (memory
            per IPU, samples/s) and what would fit (more IPUs, a smaller micro-batch);
            the error's ``closest`` attribute is that :class:`Plan` and
            ``suggestions`` a list of ``{"ipus", "micro_batch", "samples_per_second"}``.
            Also, before anything is captured, an argument of the wrong type or value
            (the message names it and the values it takes: ``model`` not an
            ``nn.Module``, ``ipus`` / ``global_batch`` / ``micro_batch`` not positive
            integers, ``available_memory_proportions`` empty or outside ``(0, 1]``, ...);
            a gradient accumulation too small for a pipeline of ``ipus`` IPUs; a global
            batch no micro-batch divides. After the capture: no repeated layers; more
            IPUs than the model has units (every IPU holds one at least).
    """
    start = time.perf_counter()
    request, batches = _request(
        model, *example_inputs, options=options, optimizer=optimizer, ipus=ipus,
        training=training, micro_batch=micro_batch, global_batch=global_batch,
        available_memory_proportions=available_memory_proportions, serialize=serialize,
        recomputation=recomputation, head_on_first_ipu=head_on_first_ipu,
        optimizer_state_on_chip=optimizer_state_on_chip, time_limit=time_limit)
    planner = _Planner(request)
    explored: List[Dict[str, Any]] = []
    winner: Optional[Tuple[int, Scored]] = None
    for mb in sorted(set(batches), reverse=True):
        if request.micro_batches(mb) is None:
            continue
        check_fits_units(model, ipus, [u.name for u in planner.planning(mb).problem.units])
        scored = planner.best(mb, ipus)
        explored.append(_explored(planner, mb, scored))
        if scored is not None and (winner is None or
                                   scored.samples_per_second > winner[1].samples_per_second):
            winner = (mb, scored)
    if winner is None:
        raise _nothing_fits(planner, batches, time.perf_counter() - start, explored)
    result = _plan_of(planner, winner[0], winner[1].candidate, time.perf_counter() - start,
                      explored)
    if not result.fits:  # the per-IPU estimate and the whole program's must agree
        raise py_error(f"poptorch.plan: internal error: the chosen placement needs "
                       f"{result.memory_per_ipu} bytes per IPU, more than the IPUs hold, "
                       "although each IPU's estimate fitted. Please report it.")
    return result


def _request(model, *example_inputs, options=None, optimizer=None, ipus=1, training=True,
             micro_batch=None, global_batch=None,
             available_memory_proportions=DEFAULT_PROPORTIONS, serialize=True,
             recomputation=True, head_on_first_ipu=True, optimizer_state_on_chip=None,
             time_limit=600.0) -> Tuple[_Request, List[int]]:
    """:func:`plan`'s arguments, checked: ``(request, micro-batches to try)``."""
    proportions = check_arguments(
        model, example_inputs, options, optimizer, ipus, training, global_batch,
        available_memory_proportions, serialize, recomputation, head_on_first_ipu,
        optimizer_state_on_chip, time_limit)
    batches = micro_batches_to_try(micro_batch, example_inputs)
    options = options if options is not None else Options()
    request = _Request(model, tuple(example_inputs), options, optimizer, training, int(ipus),
                       None if global_batch is None else int(global_batch), proportions,
                       serialize, recomputation, head_on_first_ipu, optimizer_state_on_chip,
                       float(time_limit))
    _check_batches(request, batches)
    return request, batches


def _check_batches(r: _Request, batches: List[int]) -> None:
    if all(r.micro_batches(b) is None for b in batches):
        raise py_error(
            f"poptorch.plan: global_batch {r.global_batch} is not a multiple of micro-batch "
            f"x replicas for any micro-batch tried ({batches}; replicas {r.replicas}). Choose "
            "a global batch that one of them divides.")
    if r.ipus > 1:
        m = max(r.micro_batches(b) or 0 for b in batches)
        need = 2 * r.ipus - 1 if r.training else r.ipus
        if m < need:
            what = "gradient accumulation" if r.training else "device iterations"
            setter = "Options().Training.gradientAccumulation" if r.training \
                else "Options().deviceIterations"
            least = need * min(batches) * r.replicas
            per = "weight update" if r.training else "step"
            change = (f"Pass global_batch={least} or more (samples per {per}) or "
                      f"set {setter}({need})") if r.global_batch is None else \
                f"Use a global_batch of {least} or more"
            raise py_error(f"poptorch.plan: a pipeline over {r.ipus} IPUs needs {what} >= "
                           f"{need}, but it is {m}. {change}.")


def _nothing_fits(planner: _Planner, batches: List[int], seconds: float,
                  explored: List[Dict[str, Any]]) -> Error:
    """The error when nothing fits: the closest placement and what would fit."""
    r = planner.r
    mb = max(b for b in batches if r.micro_batches(b) is not None)
    planning = planner.planning(mb)
    near = closest(planning.problem, planner.space(planning, r.ipus, r.micro_batches(mb)))
    closest_plan = _plan_of(planner, mb, near.candidate, seconds, explored) if near else None
    suggestions = []
    most, limit = _most_ipus(r, len(planning.problem.units), r.micro_batches(mb))
    for n in range(r.ipus + 1, most + 1):
        found = planner.best(mb, n)
        if found is not None:
            suggestions.append({"ipus": n, "micro_batch": mb,
                                "samples_per_second": found.samples_per_second})
            break
    smaller = mb // 2
    while smaller >= 1:
        if r.micro_batches(smaller) is not None:
            found = planner.best(smaller, r.ipus)
            if found is not None:
                suggestions.append({"ipus": r.ipus, "micro_batch": smaller,
                                    "samples_per_second": found.samples_per_second})
                break
        smaller //= 2
    lines = [f"poptorch.plan: no placement of {type(r.model).__name__} on {r.ipus} IPU(s) "
             f"fits with micro-batch {mb} (tried {sorted(set(batches))})."]
    if closest_plan is not None:
        cap = closest_plan.estimate.target.memory_bytes / 1e6
        mem = ", ".join(f"IPU {i} {m / 1e6:,.0f} MB" for i, m in
                        enumerate(closest_plan.memory_per_ipu))
        lines.append(f"The closest, layers per IPU {closest_plan.layers_per_ipu}, needs {mem} "
                     f"of {cap:,.0f} MB each ({closest_plan.samples_per_second:,.1f} "
                     "samples/s if it fitted).")
    for s in suggestions:
        lines.append(f"It fits on {s['ipus']} IPU(s) with micro-batch {s['micro_batch']}: "
                     f"{s['samples_per_second']:,.1f} samples/s.")
    if not suggestions:
        tried = f"Neither more IPUs (up to {most}) nor" if most > r.ipus else "No"
        lines += [f"{tried} a smaller micro-batch fits.", limit,
                  "Reduce the model, or keep state off chip (Options.TensorLocations)."]
    error = py_error(" ".join(line for line in lines if line))
    error.closest = closest_plan
    error.suggestions = suggestions
    return error



def _most_ipus(r: _Request, units: int, micro_batches: int) -> Tuple[int, str]:
    """The most IPUs worth trying for a suggestion, and what limits them."""
    what = "gradient accumulation" if r.training else "device iterations"
    pipeline = (micro_batches + 1) // 2 if r.training else micro_batches
    most = min(r.ipus + _MAX_EXTRA_IPUS, units, pipeline)
    if most == r.ipus + _MAX_EXTRA_IPUS:
        return most, ""
    if most == units:
        return most, f"The model's {units} units allow at most {units} IPUs."
    return most, (f"With {what} {micro_batches}, a pipeline takes at most {pipeline} IPUs: "
                  "a larger global_batch allows more.")
