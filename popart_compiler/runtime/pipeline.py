"""Pipelines for real: each stage of a pipelined program runs in its own process
(``Options.Distributed.pipelineAcrossProcesses``; docs/multi-ipu.md).

The program's merged stages (:class:`~.pipeline_program.PipelineProgram`: PopART runs
consecutive stages on one IPU as one) run one per process, and micro-batches flow
between the processes (:class:`~.pipeline_schedule.PipelineRunner`: 1F1B in training,
one weight update per device iteration with its ``A × R`` micro-batches in flight;
forwards only in inference, the ``D × R`` micro-batches of a call; activations and
gradients on ``torch.distributed`` ``isend`` / ``irecv``). ``W / P`` replicas of the
pipeline run side by side (:class:`~.pipeline_mesh.PipelineMesh`, a 2-D
``DeviceMesh``).

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
* the outputs of the last stage are broadcast to the pipeline's other processes; the
  state each stage owns stays in its process, and a host read fetches what the other
  stages own when it needs it (:mod:`.pipeline_state`, :mod:`.pipeline_service`): a
  call that reads nothing moves no weights.

A failure in one stage (an exception in a micro-batch, Ctrl-C) makes that process
leave the run at once, recording which stage failed; the others' pending send or
receive fails within moments with a ``poptorch.Error`` naming it (issue 19's
mechanism, :mod:`.collectives`). So does a process that ends its script normally
while another waits in a pipeline call it never makes (mismatched calls): each call
is counted in the rendezvous store, and the ending process compares the counts.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from popart_compiler.errors import backend_error
from popart_compiler.runtime import collectives, pinning, pipeline_service
from popart_compiler.runtime.device import IpuModel
from popart_compiler.runtime.device_state import DeviceRng
from popart_compiler.runtime.lowering import Runners, lower
from popart_compiler.runtime.pipeline_mesh import GradientSharing, PipelineMesh
from popart_compiler.runtime.pipeline_program import PipelineProgram
from popart_compiler.runtime.pipeline_schedule import PipelineRunner, ScheduleStats
from popart_compiler.runtime.pipeline_state import KINDS, StateProvider, owned_state
from popart_compiler.runtime.session import InferenceSession
from popart_compiler.runtime.training import TrainingSession
from popart_compiler.stages import Executable

__all__ = ["PipelineTrainingSession", "PipelineInferenceSession", "PipelineLayout",
           "join_pipeline"]

_OPTION = "Options.Distributed.pipelineAcrossProcesses"
#: Numbers of the pipelined models this process created (the same order everywhere).
_MODELS = itertools.count()


@dataclasses.dataclass
class PipelineLayout:
    """A program's place in a pipeline run across processes.

    Attributes:
        program: the program's units and what crosses between them.
        group: the run's process group (all processes).
        mesh: this process's stage and replica.
        executable: the executable with the replica options of the run: ``W / P``
            processes of replicas (``process_id`` = this pipeline replica).
        key: the model's number among the pipelined models of the run (the same in
            every process).
    """
    program: PipelineProgram
    group: collectives.ProcessGroup
    mesh: PipelineMesh
    executable: Executable
    key: int


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


def join_pipeline(executable: Executable, optimizer: Any, torch_device: str,
                  stage_runner: Optional[Callable[[fx.GraphModule], Callable]] = None
                  ) -> PipelineLayout:
    """Lay ``executable`` out over the run's processes: check it, join the other
    processes (compare the compiled programs) and build the device mesh. Each stage's
    submodule runs as ``stage_runner`` makes it (:attr:`Runners.stage_runner`; ``None``:
    the submodule itself).

    Raises:
        Error: the model cannot run this way (see :func:`_check`); the number of
            processes does not match its stages; the processes compiled different
            programs; a peer failed.
    """
    _check(executable)
    o, g = executable.options, executable.graph
    trainable = [executable.training and i < len(g.parameters) and g.trainable[i]
                 for i in range(len(g.placeholders))]
    program = PipelineProgram(executable.stages, trainable, stage_runner)
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
    key = next(_MODELS)
    signature = collectives.program_signature(executable, optimizer)
    signature["pipelined models created before this one"] = str(key)
    group.check_consistent(signature)
    mesh = PipelineMesh(group, stages, torch_device)
    replica = f", pipeline replica {mesh.replica} of {mesh.replicas}" \
        if mesh.replicas > 1 else ""
    group.set_role(program.describe(mesh.stage) + replica)
    local = dataclasses.replace(o, num_processes=mesh.replicas, process_id=mesh.replica)
    return PipelineLayout(program, group, mesh, dataclasses.replace(executable,
                                                                    options=local), key)


class _PipelineSession:
    """What both pipeline sessions add to a session: the layout, the runner, the
    state this stage owns (:class:`~.pipeline_state.StateProvider`), the reads of
    the other stages' state and the host writes that change versions."""

    layout: PipelineLayout
    runner: PipelineRunner
    provider: StateProvider

    def _start_pipeline(self, training: bool, optimizer=None) -> None:
        # process p draws from its own RNG stream (p = 0: the single process's)
        self.rng = DeviceRng(self.options.random_seed, self.torch_device,
                             stream=self.layout.group.rank)
        self.runner = PipelineRunner(self, self.layout, training)
        #: the cores this process was pinned to (``POPTORCH_PIPELINE_PIN_CORES``), or None
        self.pinned_cores = pinning.pin_stage_process(self.layout.group.rank,
                                                      self.layout.group.size)
        layout = self.layout
        g = layout.executable.graph
        self.provider = StateProvider(layout.key, owned_state(layout.program, g,
                                                              self.weights, optimizer),
                                      layout.mesh.stage, layout.program.describe)
        # which stage owns each named parameter / written buffer (the others: local)
        self._owners: Dict[str, Tuple[int, str]] = {}
        for i, name in enumerate(g.parameters):
            readers = layout.program.units_reading(i)
            if readers and self.weights.params[i].requires_grad:
                self._owners[name] = (readers[0], "weights")
        for j, name in enumerate(g.buffers):
            readers = layout.program.units_reading(len(g.parameters) + j)
            if readers and name in g.mutated_buffers:
                self._owners[name] = (readers[0], "buffers")
        self._fetched: Dict[tuple, Any] = {}
        self._service = pipeline_service.service(layout.group)
        self._service.register(self.provider, layout.mesh.state_group)
        self._closer = weakref.finalize(self, self._service.close, self.provider)
        self._closer.atexit = False  # at exit the run ends anyway

    @property
    def stage(self) -> int:
        """This process's pipeline stage."""
        return self.layout.mesh.stage

    @property
    def schedule_stats(self) -> ScheduleStats:
        """Where this stage's time went in its calls (see :class:`ScheduleStats`)."""
        return self.runner.stats

    @property
    def state_stats(self) -> "pipeline_service.StateStats":
        """State moved by host reads in this process (all pipelined models)."""
        return self._service.stats

    def close(self) -> None:
        """The model is destroyed: its state stays readable by the other processes
        until each of them destroyed it too."""
        self._closer()

    def _fetch(self, wanted: Set[Tuple[int, str]]) -> None:
        """Bring the ``(stage, kind)`` state other stages own into this process."""
        begin = time.perf_counter()
        pipeline_service.fetch(self.provider, self.layout.mesh, self.layout.mesh.state_group,
                               wanted, self._fetched)
        self._service.stats.seconds += time.perf_counter() - begin

    def readWeights(self, names=None):
        """Device → host: parameters and buffers by name, those other stages own
        fetched from them first (see :mod:`.pipeline_state`).

        Raises:
            Error: an owner failed, or cannot serve this read (the processes made
                different calls or host writes, or it ended).
        """
        chosen = self.weights.names if names is None else names
        self._fetch({self._owners[n] for n in chosen if n in self._owners})
        return super().readWeights(names)

    def writeWeights(self, values):
        with self.provider.writing(("weights", "buffers")):
            super().writeWeights(values)

    def _run_all_or_nothing(self, inputs):
        self.provider.begin_run()
        completed = False
        try:
            outs = super()._run_all_or_nothing(inputs)
            completed = True
            return outs
        finally:
            self.provider.end_run(completed)

    def _mutable_tensors(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """What this stage's call may write (restored if it fails): the parameters
        its stage reads, the written buffers it reads, their optimizer state and the
        mutated inputs; the copies of other stages' state are not touched by a call."""
        g, w = self.executable.graph, self.weights
        reads = self.layout.program.reads[self.stage]
        n = len(g.parameters)
        out = [w.params[i] for i in sorted(reads) if i < n and w.params[i].requires_grad]
        out += [bufs[j] for bufs in w.buffers for j, name in enumerate(g.buffers)
                if name in g.mutated_buffers and n + j in reads]
        out += [inputs[i] for i in sorted(g.mutated_inputs) if i < len(inputs)]
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:
            mine = {g.parameters[i] for i in reads if i < n}
            out += [t for k, t in optimizer.state.items()
                    if "___" not in k or k.partition("___")[2] in mine]
        return out

    def broadcast_state(self) -> None:
        """Every process starts from process 0's weights, buffers (and optimizer
        state), whatever its host model held."""
        with self.provider.writing(KINDS):
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

    def __init__(self, executable: Executable, device: Optional[IpuModel], optimizer,
                 runners: Optional[Runners] = None):
        torch_device = device.torch_device if device is not None else \
            executable.options.device
        runners = runners if runners is not None else lower(executable)
        self.layout = join_pipeline(executable, optimizer, torch_device,
                                    runners.stage_runner)
        super().__init__(self.layout.executable, device, optimizer, runners)
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
        """Optimizer-state tensors by PopART name, those of other stages' parameters
        fetched from them first (see :meth:`readWeights`)."""
        self._fetch({(s, "optimizer") for s in range(self.layout.program.num_units)})
        return super().readOptimizerState()

    def writeOptimizerState(self, state):
        with self.provider.writing(("optimizer",)):
            super().writeOptimizerState(state)

    def writeOptimizerParams(self, params):
        with self.provider.writing(("optimizer",)):
            super().writeOptimizerParams(params)

    def _run(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        self.layout.group.begin_call()
        o = self.options
        d, a, r = o.device_iterations, o.gradient_accumulation, o.replication_factor
        params = self.weights.params
        opt = self.optimizer
        stats = self.runner.stats
        self.runner.begin(self._split(inputs), d * a * r)
        for i in range(d):
            since = time.perf_counter()
            opt.begin_step()
            self.runner.step(i, opt.loss_scale)
            update = time.perf_counter()
            opt.finish_step(params)
            stats.update_s += time.perf_counter() - update
            self.clock.mark(i, 1, since)
        return self.runner.finish(self._finish, (d, a, r))


class PipelineInferenceSession(_PipelineSession, InferenceSession):
    """An inference session running one stage of a pipeline across processes: the
    ``D × R`` micro-batches of a call flow through the stages (GPipe, forward only).

    Raises:
        Error: see :func:`join_pipeline`.
    """

    def __init__(self, executable: Executable, device: Optional[IpuModel] = None,
                 runners: Optional[Runners] = None):
        torch_device = device.torch_device if device is not None else \
            executable.options.device
        runners = runners if runners is not None else lower(executable)
        self.layout = join_pipeline(executable, None, torch_device, runners.stage_runner)
        super().__init__(self.layout.executable, device, runners)
        self._start_pipeline(False)

    def _run(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        self.layout.group.begin_call()
        o = self.options
        d, r = o.device_iterations, o.replication_factor
        since = time.perf_counter()
        self.runner.begin(self._split(inputs), d * r)
        self.runner.step(0)
        self.clock.mark(0, d, since)
        return self.runner.finish(self._finish, (d, 1, r))
