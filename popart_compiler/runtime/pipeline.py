"""Pipelines for real: each stage of a pipelined program runs in its own process
(``Options.Distributed.pipelineAcrossProcesses``; docs/multi-ipu.md).

The program's merged stages (:class:`~.pipeline_program.PipelineProgram`: PopART runs
consecutive stages on one IPU as one) become ``torch.distributed.pipelining``
``PipelineStage`` s, one per process, and micro-batches flow between the processes with
PyTorch's own schedules: ``Schedule1F1B`` in training (one weight update per device
iteration, its ``A × R`` micro-batches in flight: fill, one forward and one backward
per step, drain) and ``ScheduleGPipe`` without backward in inference (the ``D × R``
micro-batches of a call). ``W / P`` replicas of the pipeline run side by side
(:class:`~.pipeline_mesh.PipelineMesh`, a 2-D ``DeviceMesh``).

What each process does, so that the results equal the single-process run:

* every process captures and compiles the whole program (they must agree: the
  program signature is compared as for replicas), then runs its stage's ops;
  graph inputs are local (every process of a pipeline is given the same inputs), and
  only values computed by one stage and used by a later one travel;
* the last stage starts each micro-batch's backward from the loss times the loss
  scale (the single process's seed); each stage hands its parameters' gradients to
  the optimizer micro-batch by micro-batch, as the single process does;
* the weight update runs in each stage on the parameters it reads (PopART places a
  weight's update with its consumer); a parameter read by several stages gets one
  gradient sum over them (and over the replicas) and the same update in each
  (:class:`~.pipeline_mesh.GradientSharing`), gradient clipping sees every stage's
  norms and automatic loss scaling every process's statistics;
* the outputs of the last stage are broadcast to the pipeline's other processes, and
  after each run every stage publishes its state (:class:`~.pipeline_sync.
  StatePublisher`), so that every process holds the whole trained model.

A failure in one stage (an exception in a micro-batch, Ctrl-C) makes that process
leave the run at once, recording which stage failed; the others' pending send or
receive fails within moments with a ``poptorch.Error`` naming it (issue 19's
mechanism, :mod:`.collectives`). So does a process that ends its script normally
while another waits in a pipeline call it never makes (mismatched calls): each call
is counted in the rendezvous store, and the ending process compares the counts.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from popart_compiler.errors import backend_error
from popart_compiler.runtime import collectives
from popart_compiler.runtime.device import IpuModel
from popart_compiler.runtime.device_state import DEVICE_DTYPES, DeviceRng
from popart_compiler.runtime.pipeline_mesh import GradientSharing, PipelineMesh
from popart_compiler.runtime.pipeline_program import PipelineProgram
from popart_compiler.runtime.pipeline_sync import StatePublisher
from popart_compiler.runtime.session import InferenceSession, reduce_output
from popart_compiler.runtime.training import _AUTOGRAD_LOCK, TrainingSession
from popart_compiler.stages import Executable

__all__ = ["PipelineTrainingSession", "PipelineInferenceSession", "PipelineLayout",
           "join_pipeline"]

_OPTION = "Options.Distributed.pipelineAcrossProcesses"


@dataclasses.dataclass
class PipelineLayout:
    """A program's place in a pipeline run across processes.

    Attributes:
        program: the program's units and what crosses between them.
        group: the run's process group (all processes).
        mesh: this process's stage and replica.
        executable: the executable with the replica options of the run: ``W / P``
            processes of replicas (``process_id`` = this pipeline replica).
    """
    program: PipelineProgram
    group: collectives.ProcessGroup
    mesh: PipelineMesh
    executable: Executable


def _check(exe: Executable) -> None:
    """What the mode cannot run: a clear error before any process waits."""
    o = exe.options
    staged = exe.stages
    if staged is None or not staged.pipelined or max(staged.merged_units()) == 0:
        kind = "has one pipeline stage" if staged is None or staged.pipelined else \
            "is not pipelined (sharded or phased execution)"
        raise backend_error(
            f"{_OPTION} runs each pipeline stage in its own process, but this model "
            f"{kind}: place its blocks on several IPUs (poptorch.BeginBlock(..., "
            "ipu_id=k)) with PipelinedExecution, or turn the option off.")
    if o.num_processes < 2:
        raise backend_error(
            f"{_OPTION}: this model runs as {max(staged.merged_units()) + 1} pipeline "
            "stages, one per process, but only 1 process was started: launch one process "
            "per stage, e.g. torchrun --nproc-per-node <stages> script.py.")
    if o.replica_groupings:
        raise backend_error(f"{_OPTION} does not support replica-grouped weights "
                            f"({', '.join(sorted(o.replica_groupings))}): remove "
                            "replicaGrouping() or turn the option off.")
    if exe.state_anchors:
        raise backend_error(
            f"{_OPTION} cannot anchor weights, gradients or optimizer state "
            f"({', '.join(a.name for a in exe.state_anchors)}): read them with "
            "copyWeightsToHost() / the optimizer's state_dict() instead, or turn the "
            "option off.")


def join_pipeline(executable: Executable, optimizer: Any, torch_device: str
                  ) -> PipelineLayout:
    """Lay ``executable`` out over the run's processes: check it, join the other
    processes (compare the compiled programs) and build the device mesh.

    Raises:
        Error: the model cannot run this way (see :func:`_check`); the number of
            processes does not match its stages; the processes compiled different
            programs; a peer failed.
    """
    _check(executable)
    o, g = executable.options, executable.graph
    trainable = [executable.training and i < len(g.parameters) and g.trainable[i]
                 for i in range(len(g.placeholders))]
    program = PipelineProgram(executable.stages, trainable, executable.stage_runner)
    if len(program.placeholders) != len(g.placeholders):
        raise backend_error("The staged program's inputs differ from the graph's.")
    stages = program.num_units
    per_replica = o.pipeline_stages or o.num_processes
    if per_replica != stages:
        path = " → ".join(f"IPU {ipu}" for ipu in program.unit_ipus)
        how = "were declared" if o.pipeline_stages else "were started"
        raise backend_error(
            f"{_OPTION}: this model runs as {stages} pipeline stages ({path}; "
            "consecutive stages on one IPU run as one), one process each, but "
            f"{per_replica} processes per pipeline {how}. "
            f"Start {stages} processes per pipeline replica (torchrun --nproc-per-node "
            f"{stages}) or declare pipelineAcrossProcesses(stages={stages}).")
    group = collectives.process_group(o.process_id, o.num_processes, torch_device)
    group.check_consistent(collectives.program_signature(executable, optimizer))
    mesh = PipelineMesh(group, stages, torch_device)
    replica = f", pipeline replica {mesh.replica} of {mesh.replicas}" \
        if mesh.replicas > 1 else ""
    group.set_role(program.describe(mesh.stage) + replica)
    local = dataclasses.replace(o, num_processes=mesh.replicas, process_id=mesh.replica)
    return PipelineLayout(program, group, mesh, dataclasses.replace(executable,
                                                                    options=local))


class _StageModule(nn.Module):
    """What ``PipelineStage`` calls for a micro-batch: the runner's stage, given the
    values received from the previous stage and the micro-batch index ``mb`` (a
    one-element tensor, chunked by the schedule from ``arange(M)``)."""

    def __init__(self, runner: "PipelineRunner"):
        super().__init__()
        self._forward = runner.forward

    def forward(self, *received: torch.Tensor, mb: torch.Tensor):
        return self._forward(received, int(mb))


class _Stage(PipelineStage):
    """A ``PipelineStage`` that hands each micro-batch's parameter gradients to the
    optimizer as soon as that micro-batch's backward has run."""

    def __init__(self, after_backward: Callable[[int], None], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._after_backward = after_backward

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False):
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                   last_backward=last_backward)
        if self.has_backward:
            self._after_backward(bwd_chunk_id)


class PipelineRunner:
    """Runs this process's stage of a pipelined program with PyTorch's schedules.

    Args:
        session: the pipeline session (its weights, options, optimizer).
        layout: the program's layout over the processes.
        training: forward and backward (``Schedule1F1B``), else forward only
            (``ScheduleGPipe``).
    """

    def __init__(self, session, layout: PipelineLayout, training: bool):
        self.session = session
        self.layout = layout
        self.program = layout.program
        self.training = training
        self.unit = layout.mesh.stage
        self.last = self.unit == self.program.num_units - 1
        o = session.options
        self.replicas = o.replication_factor
        self.micro_batches = (o.gradient_accumulation if training else
                              o.device_iterations) * self.replicas
        device = torch.device(session.torch_device)
        received = tuple(v.example(device) if training else v.example(device).detach()
                         for v in self.program.receives[self.unit])
        sent = tuple(v.example(device) if training else v.example(device).detach()
                     for v in self.program.sends[self.unit])
        self.stage = _Stage(self._collect_gradients, _StageModule(self), self.unit,
                            self.program.num_units, device, input_args=received,
                            output_args=sent, group=layout.mesh.pp_group)
        if training:
            self.schedule = Schedule1F1B(self.stage, self.micro_batches,
                                         loss_fn=self._loss, scale_grads=False)
        else:
            self.schedule = ScheduleGPipe(self.stage, self.micro_batches, scale_grads=False)
        num_params = len(session.weights.params)
        self._grad_params = sorted(i for i in self.program.reads[self.unit]
                                   if i < num_params and session.weights.params[i].requires_grad)
        self._split: List[torch.Tensor] = []
        self._iteration = 0
        self._scale = 1.0
        self._results: List[Optional[List[torch.Tensor]]] = []
        self._error: Optional[BaseException] = None

    # -- one micro-batch --------------------------------------------------------------

    def _slot(self, m: int) -> Tuple[int, int, int]:
        """``(device iteration, accumulation step, replica)`` of micro-batch ``m``."""
        step, rep = divmod(m, self.replicas)
        return (self._iteration, step, rep) if self.training else (step, 0, rep)

    def forward(self, received: Sequence[torch.Tensor], m: int) -> Tuple[torch.Tensor, ...]:
        try:
            i, step, rep = self._slot(m)
            local = [*self.session.weights.state(rep), *[t[i, step, rep] for t in self._split]]
            outs = self.program.run(self.unit, received, local)
            if self.last:
                shared = {t.untyped_storage().data_ptr() for t in received}
                self._results[(self._iteration if self.training else 0) *
                              self.micro_batches + m] = [
                    t.detach().clone() if t.untyped_storage().data_ptr() in shared
                    else t.detach() for t in outs]
            return outs
        except BaseException as e:
            self._error = e
            raise

    def _loss(self, outputs: Sequence[torch.Tensor], _target) -> torch.Tensor:
        """The last stage's backward starts from the loss times the loss scale (the
        gradient seed of the single-process run)."""
        loss = outputs[self.session.executable.loss_index]
        return (loss * self._scale).sum()

    def _collect_gradients(self, m: int) -> None:
        """Hand micro-batch ``m``'s gradients of this stage's parameters to the
        optimizer (and clear them), as the single process does after each backward."""
        try:
            session = self.session
            params = session.weights.params
            grads: List[Optional[torch.Tensor]] = [None] * len(params)
            for j in self._grad_params:
                grads[j], params[j].grad = params[j].grad, None
            if session.options.fp_exceptions:
                for g in grads:
                    if g is not None and g.is_floating_point() and \
                            not bool(torch.isfinite(g).all()):
                        raise backend_error(
                            "Floating point exception: overflow in the backward pass (a "
                            f"gradient of {self.program.describe(self.unit)} is not "
                            "finite). Lower the loss scaling or disable poptorch.Options()."
                            "Precision.enableFloatingPointExceptions.",
                            type="poplar_application_runtime_error")
            _, step, rep = self._slot(m)
            session.optimizer.accumulate(rep, step, grads)
        except BaseException as e:
            self._error = e
            raise

    # -- a schedule step --------------------------------------------------------------

    def begin(self, split: List[torch.Tensor], results: int) -> None:
        """Start a run: its inputs (``[D, A, R, ...]`` views) and the number of
        micro-batch results the last stage keeps."""
        self._split = split
        self._results = [None] * results if self.last else []

    def step(self, iteration: int, scale: float = 1.0) -> None:
        """Run the micro-batches of one weight update (training) or of the whole call
        (inference) through the pipeline.

        Raises:
            Error: another stage failed (naming it), or this stage's error.
        """
        self._iteration, self._scale, self._error = iteration, scale, None
        kwargs = {"mb": torch.arange(self.micro_batches)}
        if self.last and self.training:
            kwargs["target"] = torch.zeros(self.micro_batches)
        group = self.layout.group
        try:
            if self.training:
                with _AUTOGRAD_LOCK:
                    self.schedule.step(return_outputs=False, **kwargs)
            else:
                with torch.no_grad():
                    self.schedule.step(return_outputs=False, **kwargs)
        except BaseException as e:
            local, caught = self._error, e
            self._error = None
            if local is None and isinstance(e, (RuntimeError, ValueError)):
                group.guard("pipeline step", lambda: _reraise(caught))  # a peer failed
            # this stage failed: the others cannot go on without it; leave at once
            # so that they fail now, naming this stage
            failure = local if local is not None else e
            text = f"{type(failure).__name__}: {failure}".strip()
            group.leave_after_error(text if len(text) <= 300 else text[:297] + "...")
            if local is not None:
                raise local from None
            raise

    def finish(self, finish_outputs: Callable[[List[torch.Tensor]], List[torch.Tensor]],
               shape: Tuple[int, int, int]) -> List[torch.Tensor]:
        """The run's outputs in every process of the pipeline: the last stage applies
        the output modes (``finish_outputs`` of the ``[D, A, R, ...]`` results) and
        broadcasts the results and the activation anchors to the others.

        Raises:
            Error: a peer failed or timed out.
        """
        session = self.session
        exe = session.executable
        n_user = exe.num_user_outputs
        anchors = exe.activation_anchors
        if self.last:
            results = self._results
            self._results = []
            stacked = [torch.stack([res[j] for res in results]).reshape(
                *shape, *results[0][j].shape) for j in range(len(results[0]))] \
                if results else []
            outs = finish_outputs(stacked)
            payload = list(outs) + [session.anchors[a.key] for a in anchors]
        else:
            payload = [torch.empty(s, dtype=dt) for s, dt in
                       finished_shapes(exe, session.options, shape)]
        if self.program.num_units > 1 and payload:
            self.layout.group.broadcast_(
                [t.view(torch.uint8) if t.dtype == torch.bool else t for t in payload],
                src=self.layout.mesh.rank_of(self.program.num_units - 1),
                group=self.layout.mesh.pp_group, what="broadcast of the last stage's outputs")
        if not self.last:
            for anchor, t in zip(anchors, payload[n_user:]):
                session.anchors[anchor.key] = t
        return payload[:n_user]


def _reraise(e: BaseException):
    raise e


def finished_shapes(exe: Executable, options, shape: Tuple[int, int, int]
                    ) -> List[Tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of each user output after its output mode (and the 32-bit
    output rule), then of each activation anchor, for ``[D, A, R]`` micro-batch
    results (computed on meta tensors, as :meth:`Session._finish` computes values).

    Raises:
        Error: a graph output without shape information.
    """
    out = []
    nodes = list(exe.graph.output_node.args[0])
    n_user = exe.num_user_outputs
    modes = [(options.output_mode, options.output_return_period)] * n_user + \
        [(a.output_mode, a.return_period) for a in exe.activation_anchors]
    for k, (node, (mode, period)) in enumerate(zip(nodes, modes)):
        val = node.meta.get("val") if hasattr(node, "meta") else None
        if not isinstance(val, torch.Tensor):
            raise backend_error(f"{_OPTION}: output {k} of the model is not a tensor.")
        t = reduce_output(torch.empty(*shape, *val.shape, dtype=val.dtype, device="meta"),
                          mode, period)
        dtype = DEVICE_DTYPES.get(t.dtype, t.dtype) if k < n_user else t.dtype
        out.append((t.shape, dtype))
    return out


def _owned_state(layout: PipelineLayout, weights, optimizer=None) -> List[List[torch.Tensor]]:
    """For each stage, the state it owns and publishes after a run: its trainable
    parameters (those whose first reader it is), the buffers it writes (every
    replica's copy) and the optimizer state of its parameters, less the gradient
    accumulators (``Accum___``: zero after every weight update, so after every run, in
    every process)."""
    program, g = layout.program, layout.executable.graph
    owned: List[List[torch.Tensor]] = [[] for _ in range(program.num_units)]
    owner: Dict[str, int] = {}
    for i, name in enumerate(g.parameters):
        readers = program.units_reading(i)
        if readers:
            owner[name] = readers[0]
            if weights.params[i].requires_grad:
                owned[readers[0]].append(weights.params[i])
    for j, name in enumerate(g.buffers):
        readers = program.units_reading(len(g.parameters) + j)
        if readers and name in g.mutated_buffers:
            owned[readers[0]].extend(bufs[j] for bufs in weights.buffers)
    if optimizer is not None:
        for key in sorted(optimizer.state):
            kind, _, name = key.partition("___")
            if name in owner and kind != "Accum":
                owned[owner[name]].append(optimizer.state[key])
    return owned


class _PipelineSession:
    """What both pipeline sessions add to a session: the layout, the runner, the
    publisher, and waiting for the last publication before the host touches the
    state."""

    layout: PipelineLayout
    runner: PipelineRunner
    publisher: StatePublisher

    def _start_pipeline(self, training: bool, optimizer=None) -> None:
        # process p draws from its own RNG stream (p = 0: the single process's)
        self.rng = DeviceRng(self.options.random_seed, self.torch_device,
                             stream=self.layout.group.rank)
        self.runner = PipelineRunner(self, self.layout, training)
        device = "cpu" if self.layout.group.backend == "gloo" else self.torch_device
        self.publisher = StatePublisher(
            self.layout.mesh, _owned_state(self.layout, self.weights, optimizer), device)

    @property
    def stage(self) -> int:
        """This process's pipeline stage."""
        return self.layout.mesh.stage

    def readWeights(self, names=None):
        self.publisher.settle()
        return super().readWeights(names)

    def writeWeights(self, values):
        self.publisher.settle()
        super().writeWeights(values)

    def broadcast_state(self) -> None:
        """Every process starts from process 0's weights, buffers (and optimizer
        state), whatever its host model held."""
        self.publisher.settle()
        w = self.weights
        tensors = list(w.params) + [b for bufs in w.buffers for b in bufs
                                    if isinstance(b, torch.Tensor)]
        optimizer = getattr(self, "optimizer", None)
        names = sorted(optimizer.state) if optimizer is not None else []
        tensors += [optimizer.state[k] for k in names]
        if tensors:
            self.layout.group.broadcast_(tensors, src=0)
        if optimizer is not None:
            optimizer.note_state_written(names)


class PipelineTrainingSession(_PipelineSession, TrainingSession):
    """A training session running one stage of a pipeline across processes.

    Args:
        executable: a pipelined training executable (every process compiled it).
        device: the attached IPU Model.
        optimizer: the optimizer to run on the device.

    Raises:
        Error: see :func:`join_pipeline`.
    """

    def __init__(self, executable: Executable, device: Optional[IpuModel], optimizer):
        torch_device = device.torch_device if device is not None else \
            executable.options.device
        self.layout = join_pipeline(executable, optimizer, torch_device)
        super().__init__(self.layout.executable, device, optimizer)
        self._start_pipeline(True, self.optimizer)

    def _join_run(self, optimizer):
        return self.layout.group

    def _gradient_sums(self):
        g = self.executable.graph
        program = self.layout.program
        readers = {name: program.units_reading(i) for i, name in enumerate(g.parameters)}
        shapes = {name: p.shape for name, p in zip(g.parameters, self.weights.params)}
        return None, GradientSharing(self.layout.mesh, g.parameters, readers, shapes)

    def readOptimizerState(self):
        self.publisher.settle()
        return super().readOptimizerState()

    def writeOptimizerState(self, state):
        self.publisher.settle()
        super().writeOptimizerState(state)

    def _run(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        self.layout.group.begin_call()
        self.publisher.settle()
        o = self.options
        d, a, r = o.device_iterations, o.gradient_accumulation, o.replication_factor
        params = self.weights.params
        opt = self.optimizer
        self.runner.begin(self._split(inputs), d * a * r)
        for i in range(d):
            since = time.perf_counter()
            opt.begin_step()
            self.runner.step(i, opt.loss_scale)
            opt.finish_step(params)
            self.clock.mark(i, 1, since)
        outs = self.runner.finish(self._finish, (d, a, r))
        self.publisher.publish()
        return outs


class PipelineInferenceSession(_PipelineSession, InferenceSession):
    """An inference session running one stage of a pipeline across processes: the
    ``D × R`` micro-batches of a call flow through the stages (GPipe, forward only).

    Raises:
        Error: see :func:`join_pipeline`.
    """

    def __init__(self, executable: Executable, device: Optional[IpuModel] = None):
        torch_device = device.torch_device if device is not None else \
            executable.options.device
        self.layout = join_pipeline(executable, None, torch_device)
        super().__init__(self.layout.executable, device)
        self._start_pipeline(False)

    def _run(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        self.layout.group.begin_call()
        self.publisher.settle()
        o = self.options
        d, r = o.device_iterations, o.replication_factor
        since = time.perf_counter()
        self.runner.begin(self._split(inputs), d * r)
        self.runner.step(0)
        self.clock.mark(0, d, since)
        outs = self.runner.finish(self._finish, (d, 1, r))
        self.publisher.publish()
        return outs
