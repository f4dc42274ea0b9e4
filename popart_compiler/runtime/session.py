"""Sessions: load an :class:`~popart_compiler.stages.Executable` on the IPU Model and
run it (our PopART ``InferenceSession``; ``TrainingSession`` is in
:mod:`popart_compiler.runtime.training`).

A run takes the user inputs of one host call, each with a leading dimension of
``N × B`` (``N = D × G × A``, docs/semantics.md S-11) laid out as docs/semantics.md
S-13 describes,
executes ``D`` device iterations × ``A`` micro-batches on each of the ``R`` replicas, and returns
every output reduced according to its output mode (docs/semantics.md S-12). Training sessions run
forward, backward (PyTorch autograd) and the optimizer update on the device weights. The device
weights and the device RNG are in :mod:`.device_state`.
"""
from __future__ import annotations

import abc
import functools
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from popart_compiler.backends import decisions
from popart_compiler.backends.auto import AutoChooser, Lowering
from popart_compiler.enums import CommGroupType, OutputMode
from popart_compiler.errors import backend_error
from popart_compiler.runtime import warm_up
from popart_compiler.runtime.device import IpuModel
from popart_compiler.runtime.device_state import DEVICE_DTYPES, DeviceRng, DeviceWeights
from popart_compiler.runtime.lowering import Runners, lower
from popart_compiler.runtime.perf_counters import IterationClock, returned_iterations
from popart_compiler.runtime.rollback import SavedTensors, deferred_interrupts
from popart_compiler.runtime.schedule import StagedProgram
from popart_compiler.stages import Executable

__all__ = ["Session", "InferenceSession", "reduce_output"]

def _merge(t: torch.Tensor, k: int, shape: torch.Size) -> torch.Tensor:
    """Fold ``k`` results of shape ``shape`` into the leading dimension (docs/semantics.md S-12)."""
    if k == 1:
        return t.reshape(shape)
    if len(shape) == 0:
        return t.reshape(k)
    return t.reshape(k * shape[0], *shape[1:])


def reduce_output(t: torch.Tensor, mode: OutputMode, period: int = 1) -> torch.Tensor:
    """Apply an output mode to stacked results.

    Args:
        t: results of shape ``[D, A, R, *s]`` (device iteration, accumulation step,
            replica, per-micro-batch shape ``s``).
        mode: the output mode.
        period: the ``EveryN`` period.

    Returns:
        ``s`` with its first dimension multiplied by ``k`` (a 0-d ``s`` becomes ``[k]``
        unless ``k == 1``): All ``k = D·A·R``, EveryN ``k = (D/P)·A·R`` (iterations
        ``P−1, 2P−1, …``), Final ``k = R`` (last micro-batch), Sum ``k = R``.
    """
    d, a, r = t.shape[:3]
    shape = t.shape[3:]
    if mode is OutputMode.All:
        return _merge(t, d * a * r, shape)
    if mode is OutputMode.EveryN:
        t = t[period - 1::period]
        return _merge(t, t.shape[0] * a * r, shape)
    if mode is OutputMode.Final:
        return _merge(t[-1, -1], r, shape)
    if mode is OutputMode.Sum:
        summed = t.sum(dim=(0, 1)) if t.dtype != torch.bool else t.any(dim=1).any(dim=0)
        return _merge(summed.to(t.dtype), r, shape)
    raise backend_error(f"Invalid output mode {mode}")


class Session(abc.ABC):
    """Shared part of inference and training sessions."""

    training = False
    #: Roll a failed run back (docs/semantics.md S-73). Only ``bench/overhead.py`` turns it off, to
    #: measure what the snapshot costs.
    all_or_nothing = True

    def __init__(self, executable: Executable, device: Optional[IpuModel] = None,
                 runners: Optional[Runners] = None):
        self.executable = executable
        self.options = executable.options
        self.device = device
        torch_device = device.torch_device if device is not None else executable.options.device
        self.torch_device = torch_device
        self.weights = DeviceWeights(executable, torch_device)
        #: the executable lowered to its backend (``runners``, else :func:`lower` now)
        self.runners = runners if runners is not None else lower(executable)
        self._use(self.runners.lowering)
        #: the ``auto`` backend's choice between eager and Inductor, call by call
        self.auto: Optional[AutoChooser] = None
        if self.runners.alternative is not None:
            kind = torch.device(torch_device).type
            start, record, source = decisions.for_program(executable, kind)
            expected, compiled = decisions.compile_estimate(executable, kind)
            self.auto = AutoChooser(self.runners.lowering, self._compile_alternative,
                                    device=kind, start=start, on_decide=record,
                                    source=source, expected_compile=expected,
                                    on_compiled=compiled)
        #: Several stages: micro-batches run through them in schedule order
        #: (docs/semantics.md S-63).
        self._staged = StagedProgram(executable.stages, wrap=self.runners.stage_runner) \
            if executable.stages is not None else None
        self.rng = DeviceRng(self.options.random_seed, torch_device,
                              stream=self.options.process_id)
        self.anchors: Dict[str, torch.Tensor] = {}
        self._perf_counters: Dict[str, List[List[float]]] = {
            "input": [[]], "input_complete": [[]], "output": [[]], "output_complete": [[]]}
        #: the last run's (clock, end, inputs, outputs), until :attr:`perf_counters` reads it
        self._last_run: Optional[Tuple[IterationClock, float, int, int]] = None
        self.runs = 0
        self.clock = IterationClock(self.options.device_iterations)
        self._saved = SavedTensors()

    def _compile_alternative(self) -> Lowering:
        return warm_up.precompile(self.executable, self.runners.alternative(),
                          self.weights.state(0))

    def _use(self, lowering: Lowering) -> None:
        self._runner = lowering.runner
        self._vectorized = lowering.vectorized
        self._vectorized_slots = lowering.vectorized_slots

    # -- weights IO -------------------------------------------------------------------

    def writeWeights(self, values: Dict[str, torch.Tensor]) -> None:
        """Host → device: write parameters / buffers by name (unknown names ignored).

        Raises:
            Error: a value whose shape differs from the device tensor's (nothing is
                written then).
        """
        self.weights.write(values)

    def readWeights(self, names: Optional[Sequence[str]] = None) -> Dict[str, torch.Tensor]:
        """Device → host: parameters and buffers by name (replica 0's buffers)."""
        names = self.weights.names if names is None else names
        return {n: self.weights.read(n).to("cpu") for n in names}

    def broadcast_state(self) -> None:
        """Called once after the host state was uploaded at the first compile: a run
        of several processes starts from process 0's state. Nothing to do for one
        process (see :meth:`TrainingSession.broadcast_state`)."""

    def close(self) -> None:
        """The executor discards this session (``destroy()``): nothing to release for
        one process (a pipeline across processes keeps its stage's state readable by
        the others until they destroy theirs)."""

    # -- RNG --------------------------------------------------------------------------

    @property
    def uses_rng(self) -> bool:
        return self.executable.graph.random

    def getRandomSeed(self) -> int:
        return self.rng.seed if self.uses_rng else 0

    def getRngState(self) -> List[int]:
        """``[seed, *state]`` of the device RNG (docs/semantics.md S-96); ``[0]`` without random
        ops."""
        if not self.uses_rng:
            return [0]
        return self.rng.to_list()

    def checkRngState(self, values: Sequence[int]) -> None:
        """Raise ``Error`` if :meth:`setRngState` would reject ``values``."""
        if self.uses_rng:
            self.rng.check(values)

    def setRngState(self, values: Sequence[int]) -> None:
        """Restore a state read with :meth:`getRngState` (seed first, then state)."""
        if not self.uses_rng:
            return
        self.rng.from_list(values)

    def setRandomSeed(self, seed: int) -> None:
        self.rng.reseed(seed)

    # -- running ----------------------------------------------------------------------

    def _split(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """View each input as ``[D, A, R, B, ...]`` (replica-indexed, docs/semantics.md S-13,
        S-26)."""
        o = self.options
        d, a, r = o.device_iterations, o.gradient_accumulation, o.replication_factor
        groups = o.input_groups
        out = []
        for x in inputs:
            x = x.to(self.torch_device, non_blocking=True)
            if x.dim() == 0:
                out.append(x.expand(d, a, r))
                continue
            b = x.shape[0] // (d * a * groups)
            x = x.reshape(d, a, groups, b, *x.shape[1:])
            if groups != r:
                g = o.input_group_size
                index = torch.tensor([j // g if o.input_group_type is not CommGroupType.Orthogonal
                                      else j % groups
                                      for j in range(r)], device=x.device)
                x = x.index_select(2, index)
            out.append(x)
        return out

    def _synthetic(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        return [torch.randn(x.shape, device=self.torch_device).to(x.dtype)
                if x.is_floating_point() else torch.zeros_like(x) for x in inputs]

    @staticmethod
    def _fresh(outs: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]
               ) -> List[torch.Tensor]:
        """``outs`` as tensors of their own (docs/semantics.md S-14 "fresh tensors"), dense and
        row-major as a device → host transfer writes them: an output sharing memory with one of
        ``sources`` (the device state and the inputs: a returned parameter or buffer, an input
        returned as is or as a view) is copied, so that writing to it changes neither the
        device weights nor the caller's input; an output in another layout (a compiled
        convolution's channels-last result, a transposed view) is made contiguous."""
        shared = {t.untyped_storage().data_ptr() for t in sources
                  if isinstance(t, torch.Tensor)}
        return [t.clone(memory_format=torch.contiguous_format)
                if t.untyped_storage().data_ptr() in shared else t.contiguous() for t in outs]

    def _finish(self, stacked: List[torch.Tensor]) -> List[torch.Tensor]:
        """Apply output modes and the 32-bit output rule to ``[D, A, R, ...]`` results."""
        o = self.options
        n_user = self.executable.num_user_outputs
        outs = []
        for t in stacked[:n_user]:
            t = reduce_output(t, o.output_mode, o.output_return_period)
            if t.dtype in DEVICE_DTYPES:
                t = t.to(DEVICE_DTYPES[t.dtype])
            if o.synthetic_data:
                t = torch.zeros_like(t)
            outs.append(t.to("cpu") if t.device.type != "cpu" else t)
        for anchor, t in zip(self.executable.activation_anchors, stacked[n_user:]):
            self.anchors[anchor.key] = reduce_output(t, anchor.output_mode,
                                                     anchor.return_period).cpu()
        return outs

    def _record_state_anchors(self, per_iteration: Dict[str, List[torch.Tensor]]) -> None:
        for anchor in self.executable.state_anchors:
            values = per_iteration.get(anchor.name)
            if not values:
                continue
            t = torch.stack(values)[:, None, None]
            self.anchors[anchor.key] = reduce_output(t, anchor.output_mode,
                                                      anchor.return_period).cpu()

    def run(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Run one host call's worth of device iterations.

        Args:
            inputs: the flat user inputs, each with a leading dimension of ``N × B``
                (or 0-d when ``N == 1``), already validated by the caller.

        Returns:
            The flat user outputs after the output mode (docs/semantics.md S-12) with 64-bit results
            returned as 32-bit (docs/semantics.md S-44).
        """
        if self.options.synthetic_data:
            inputs = self._synthetic(inputs)
        if self.auto is None:
            outs = self._run_all_or_nothing(inputs)
        else:
            def on(lowering: Lowering) -> List[torch.Tensor]:
                self._use(lowering)
                return self._run_all_or_nothing(inputs)
            outs = self.auto.run(on)
        # the counters' lists are built when read (most runs are never asked for them)
        self._last_run = (self.clock, time.perf_counter(), len(inputs), len(outs))
        self.runs += 1
        return outs

    @property
    def perf_counters(self) -> Dict[str, List[List[float]]]:
        """The last run's performance counters (docs/api-sections.md api §5.19):
        ``input``, ``input_complete``, ``output``, ``output_complete``, each a list per
        tensor of ``time.perf_counter()`` values (``[[]]`` before the first run)."""
        if self._last_run is not None:
            clock, done, num_inputs, num_outputs = self._last_run
            o = self.options
            self._perf_counters = clock.counters(num_inputs, num_outputs, returned_iterations(
                o.output_mode, o.output_return_period, o.device_iterations), done)
            self._last_run = None
        return self._perf_counters

    def _run_all_or_nothing(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        self.clock = IterationClock(self.options.device_iterations)
        if self._leaves_no_state:
            return self._run(inputs)
        # All or nothing (docs/semantics.md S-73): whatever ends a run early (an error, a
        # KeyboardInterrupt) leaves the device as it was before the run.
        mutable = self._mutable_tensors(inputs) if self.all_or_nothing else []
        snap = self._snapshot(mutable) if self.all_or_nothing else None
        try:
            if self.uses_rng:
                with self.rng.active():
                    outs = self._run(inputs)
            else:
                outs = self._run(inputs)
        except BaseException:
            if snap is not None:
                with deferred_interrupts():
                    self._restore(snap, mutable)
            raise
        return outs

    @functools.cached_property
    def _leaves_no_state(self) -> bool:
        """Whether a run changes nothing on the device that outlives it: inference that
        mutates no buffer or input, draws no random numbers and records no anchor (so an
        interrupted run has nothing to roll back, and none is snapshotted)."""
        g, exe = self.executable.graph, self.executable
        return not self.training and not g.mutated_buffers and not g.mutated_inputs and \
            not self.uses_rng and not exe.activation_anchors and not exe.state_anchors

    def _mutable_tensors(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The device tensors a run may write in place: buffers the graph mutates (every
        replica's copy) and user inputs it mutates; training adds trainable parameters
        and optimizer state (:meth:`TrainingSession._mutable_tensors`)."""
        g = self.executable.graph
        w = self.weights
        out = [bufs[i] for bufs in w.buffers for i, n in enumerate(g.buffers)
               if n in g.mutated_buffers]
        out.extend(inputs[i] for i in sorted(g.mutated_inputs) if i < len(inputs))
        return out

    def _snapshot(self, mutable: List[torch.Tensor]) -> Dict[str, object]:
        """Copy what a run changes into buffers kept from run to run (one ``memcpy``
        per mutable tensor; nothing is allocated after the first run)."""
        self._saved.take(mutable)
        return {"rng": None if self.rng.state is None else self.rng.state.clone(),
                "anchors": dict(self.anchors)}

    def _restore(self, snap: Dict[str, object], mutable: List[torch.Tensor]) -> None:
        self._saved.put_back(mutable)
        self.rng.state = snap["rng"]
        self.anchors = snap["anchors"]

    @abc.abstractmethod
    def _run(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Execute the device iterations of one run (inputs as given to :meth:`run`)."""


class InferenceSession(Session):
    """Runs an inference executable: ``D`` forward passes per replica per call."""

    def _run(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        o = self.options
        d, r = o.device_iterations, o.replication_factor
        gm = self._runner
        since = time.perf_counter()
        if d * r == 1 and self._staged is None:
            x = [t.to(self.torch_device) for t in inputs]
            state = self.weights.state(0)
            with torch.no_grad():
                outs = self._fresh(gm(*state, *x), [*state, *x])
            self.clock.mark(0, 1, since)
            return self._finish([t.detach()[None, None, None] for t in outs])
        if self._vectorized is not None:
            return self._run_vectorized(inputs)
        split = self._split(inputs)
        results: List[List[torch.Tensor]] = []
        with torch.no_grad():
            if self._staged is not None:
                results = [None] * (d * r)

                def done(i, rep, outs):
                    results[i * r + rep] = [t.detach().clone() for t in outs]
                self._staged.run([[[*self.weights.state(rep), *[t[i, 0, rep] for t in split]]
                                   for rep in range(r)] for i in range(d)], done)
                self.clock.mark(0, d, since)
            else:
                for i in range(d):
                    since = time.perf_counter()
                    for rep in range(r):
                        outs = gm(*self.weights.state(rep), *[t[i, 0, rep] for t in split])
                        results.append([t.detach().clone() for t in outs])
                    self.clock.mark(i, 1, since)
        stacked = [torch.stack([res[j] for res in results]).reshape(d, 1, r, *results[0][j].shape)
                   for j in range(len(results[0]))] if results else []
        return self._finish(stacked)

    def _run_vectorized(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The ``D × R`` micro-batches of a call through the vectorized graph,
        ``vectorized_slots`` at a time (all at once where they fit: the inputs viewed as
        ``[D·R, B, ...]`` directly, the results returned as ``OutputMode.All`` folds them
        when every output has that mode; the general split and output modes otherwise)."""
        o = self.options
        d, r = o.device_iterations, o.replication_factor
        n, c = d * r, self._vectorized_slots
        state = self.weights.state(0)
        if c >= n and o.input_groups == r:
            xs = [x.to(self.torch_device, non_blocking=True) for x in inputs]
            xs = [x.reshape(n, x.shape[0] // n, *x.shape[1:]) if x.dim() else x.expand(n)
                  for x in xs]
            since = time.perf_counter()
            with torch.no_grad():
                outs = self._vectorized(*state, *xs)
            self.clock.mark(0, d, since)
        else:
            xs = [t.reshape(n, *t.shape[3:]) for t in self._split(inputs)]
            chunks = []
            with torch.no_grad():
                for k in range(0, n, c):
                    since = time.perf_counter()
                    chunks.append(self._vectorized(*state, *[x[k:k + c] for x in xs]))
                    self.clock.mark(k // r, (k + c - 1) // r - k // r + 1, since)
            outs = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*chunks)]
        outs = self._fresh(outs, [*state, *xs])
        if self._folds_all and not any(t.dtype in DEVICE_DTYPES for t in outs):
            return [t.flatten(0, 1) if t.dim() > 1 else t for t in outs]
        return self._finish([t.reshape(d, 1, r, *t.shape[1:]) for t in outs])

    @functools.cached_property
    def _folds_all(self) -> bool:
        """Whether :meth:`_finish` of results ``[D, 1, R, B, ...]`` (none of a 64-bit dtype)
        only folds them into ``[D·R·B, ...]`` (``[D·R]`` for 0-d ones): every output in
        ``OutputMode.All``, no synthetic data, no activation anchors, host results."""
        o = self.options
        return o.output_mode is OutputMode.All and not o.synthetic_data and \
            not self.executable.activation_anchors and \
            torch.device(self.torch_device).type == "cpu"
