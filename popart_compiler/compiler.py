"""The compiler: a captured :class:`~popart_compiler.ir.Graph` plus
:class:`~popart_compiler.session_options.SessionOptions` → an :class:`Executable`.

It applies the IPU's rules (supported dtypes, 32-bit types, static shapes), checks the
execution strategy and the loss of training graphs, resolves anchors, places the graph
on the device and prepares the runners of the backend.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from . import backends, cost_model, inductor_backend, placement, steering
from .errors import backend_error
from .dropout import remove_dropout
from .ipu_model import target_for
from .ir import Graph, uses_random_numbers
from .logging import logger
from .placement import PlacementPlan, StrategySettings
from .profile_report import write_report
from .session_options import OUTPUT_MODES, Anchor, SessionOptions

__all__ = ["Compiler", "Executable", "UNSUPPORTED_DTYPES"]

#: dtypes the IPU cannot take as inputs (S-45), with the names PopTorch reports.
UNSUPPORTED_DTYPES = {
    torch.bfloat16: "BFloat16",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
    torch.complex32: "ComplexHalf",
}

_DEMOTE = {torch.float64: torch.float32}

#: Bytes the largest intermediate tensor of a vectorized inference call may take: about
#: a core's L2 cache. Batched kernels whose working set spills out of it get slower per
#: sample than a loop over micro-batches (measured on convolutions).
VECTORIZE_BUDGET = 2 * 1024 * 1024


@dataclasses.dataclass
class Executable:
    """A compiled program, ready to be loaded by a session.

    Attributes:
        graph: the captured graph (its module is the per-micro-batch runner).
        options: the session options it was compiled with.
        training: whether it trains.
        loss_index: index of the final loss among the user outputs (training).
        num_ipus: IPUs the program occupies (per replica × replicas).
        activation_anchors: anchors read from graph outputs appended after the user
            outputs, in order.
        state_anchors: anchors on weights, gradients, updated weights or optimizer state.
        vectorized: for stateless inference, the graph over ``vectorized_slots``
            micro-batches at once (a run calls it for each chunk of that many).
        vectorized_slots: micro-batches per call of ``vectorized``.
        tensor_names: every tensor name of the program (S-16).
        compile_seconds: wall-clock time of the compilation.
        placement: where each op runs (IPU, pipeline stage, phase; api §9); every
            node of ``module`` carries ``node.meta["placement"]``.
        runner: what runs one micro-batch (``module`` itself on the eager backend,
            its Inductor compilation on the inductor backend).
        stage_wrapper: turns a pipeline stage's submodule into its runner (``None``:
            call the submodule).
        estimate: the IPU Model's memory / cycle estimate (:mod:`.cost_model`).
    """
    graph: Graph
    options: SessionOptions
    training: bool
    loss_index: Optional[int]
    num_ipus: int
    activation_anchors: List[Anchor]
    state_anchors: List[Anchor]
    vectorized: Optional[Callable]
    tensor_names: List[str]
    compile_seconds: float = 0.0
    vectorized_slots: int = 1
    placement: Optional[PlacementPlan] = None
    runner: Optional[Callable] = None
    stage_wrapper: Optional[Callable[[fx.GraphModule], Callable]] = None
    estimate: Optional[cost_model.IpuEstimate] = None

    @property
    def module(self) -> fx.GraphModule:
        return self.graph.module

    @property
    def staged(self) -> bool:
        """The program has several stages (run with the stage schedule)."""
        return self.placement is not None and len(self.placement.stages) > 1

    def placement_summary(self, backward: bool = True) -> str:
        """The placement as a readable table: one row per (IPU, stage, phase) with the
        forward op count, the backward op count (training), and the number and bytes
        of the parameters updated there (spec api §9).

        Args:
            backward: training only: count the backward ops in the joint
                forward/backward graph (built with ``aot_export_joint_with_descriptors``
                for this report; about 0.1 s for a small model). ``False`` or a graph
                that cannot be differentiated ahead of time shows ``-``.
        """
        plan = self.placement or placement.plan_placement(
            self.module, self.graph.blocks, self.graph.parameters, StrategySettings(),
            self.training)
        joint = self.joint_graph() if self.training and backward else None
        return placement.placement_table(self.module, plan, self.graph.parameters, joint)

    def joint_graph(self) -> Optional[fx.GraphModule]:
        """The joint forward/backward graph of a training program with every node
        placed (:func:`placement.place_joint_graph`), or ``None`` when it cannot be
        built ahead of time. Only for reports: training runs autograd on ``module``."""
        if not self.training or self.placement is None:
            return None
        return placement.joint_graph(self.graph, self.placement)

    @property
    def num_user_outputs(self) -> int:
        return self.graph.num_user_outputs


def _replace_in(value, mapping):
    if isinstance(value, torch.dtype):
        return mapping.get(value, value)
    if isinstance(value, (list, tuple)):
        return type(value)(_replace_in(v, mapping) for v in value)
    return value


def _rewrite_args(gm: fx.GraphModule, mapping) -> bool:
    """Replace dtypes / devices in every node's arguments; True if anything changed."""
    changed = False
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            if node.op != "call_function":
                continue
            args = _replace_in(node.args, mapping)
            kwargs = {k: _replace_in(v, mapping) for k, v in node.kwargs.items()}
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = args, kwargs
                changed = True
        if changed:
            sub.recompile()
    return changed


class Compiler:
    """Compiles graphs for the IPU Model (our PopART ``Session`` preparation)."""

    @staticmethod
    def prepare(options: SessionOptions) -> None:
        """Start what a compilation with ``options`` can do before its graph is
        captured: on the CPU, the inductor backend's probe of the CPU
        (:func:`inductor_backend.start_probing_cpu`, in a background thread)."""
        if options.backend == "inductor" and options.device == "cpu" \
                and not options.fp_exceptions:
            inductor_backend.start_probing_cpu()

    @staticmethod
    def compile(graph: Graph, options: SessionOptions, training: bool,
                progress: Optional[Callable[[int, int], None]] = None,
                optimizer=None) -> Executable:
        """Compile ``graph``.

        Args:
            graph: the captured program (one micro-batch).
            options: session options (batching, output mode, anchors, ...).
            training: compile forward, backward and weight update.
            progress: called as ``progress(step, total)`` while compiling.
            optimizer: the ``OptimizerDescription`` of a training program (its state
                counts in the memory estimate).

        Raises:
            Error: unsupported input dtype or zero-sized tensor; output-mode period
                inconsistent with ``device_iterations``; gradient accumulation in
                inference; training graph without exactly one final, returned loss;
                the execution strategy's rules (S-60, S-63…S-65, see
                :func:`placement.plan_placement`);
                in-place buffer updates with replicas fed different data while
                ``broadcast_buffers`` is on; unknown anchor; a process id outside
                ``[0, num_processes)``; overlapped IO against S-66's rules; out of
                memory on an IPU (``type == "poplar_out_of_memory"``, unless the engine
                option ``debug.allowOutOfMemory`` is ``"true"``).
        """
        start = time.perf_counter()
        total = 6
        report = progress or (lambda step, total: None)
        report(0, total)
        Compiler._check_options(options, training)
        Compiler._check_inputs(graph)
        report(1, total)
        if _rewrite_args(graph.module, _DEMOTE):
            logger.warning("[DISPATCHER] Type coerced from Double to Float in the graph: "
                           "the IPU has no 64-bit floating point type")
        if options.device != "cpu":
            _rewrite_args(graph.module, {torch.device("cpu"): torch.device(options.device)})
        if not training and remove_dropout(graph.module):  # PopART's inference rule, S-34
            graph.random = uses_random_numbers(graph.module)
        report(2, total)
        loss_index = Compiler._check_loss(graph) if training else None
        Compiler._check_buffers(graph, options)
        Compiler._check_replica_groupings(graph, options)
        steering.check_overlapped_io(graph, options)
        steering.record_available_memory(graph)
        report(3, total)
        activation, state = Compiler._resolve_anchors(graph, options, training)
        plan = placement.plan_placement(
            graph.module, graph.blocks, graph.parameters,
            StrategySettings.from_raw(options.raw), training,
            device_iterations=options.device_iterations,
            gradient_accumulation=options.gradient_accumulation,
            replicas=options.replication_factor)
        report(4, total)
        vectorized, chunk = None, 1
        slots = options.device_iterations * options.replication_factor
        if (not training and slots > 1 and len(plan.stages) == 1 and not graph.mutated_buffers
                and not graph.mutated_inputs and not graph.mutated_constants
                and not options.synthetic_data and not options.fp_exceptions
                and not options.replica_groupings and graph.has_device_work()
                and not graph.runs_per_micro_batch()):
            # Inductor's fused kernels have no cache-size sweet spot: one call for all.
            chunk = slots if options.backend == "inductor" else Compiler._chunk(graph, slots)
            if chunk > 1:
                vectorized = Compiler._vectorize(graph, chunk, options.device)
        report(5, total)
        if not graph.has_device_work():
            logger.info("No IPUs are used by this model. This may lead to unexpected "
                        "behaviour.")
        names = Compiler._tensor_names(graph, training, options)
        exe = Executable(graph, options, training, loss_index,
                         num_ipus=plan.ipus_per_replica * options.replication_factor,
                         activation_anchors=activation, state_anchors=state,
                         vectorized=vectorized, tensor_names=names,
                         vectorized_slots=chunk if vectorized is not None else 1,
                         placement=plan)
        if options.backend == "inductor":
            Compiler._use_inductor(exe)
        if logger.isEnabledFor(logging.DEBUG):
            placement.log_placement(exe.placement_summary(backward=False))
        exe.estimate = Compiler._estimate(graph, options, training, optimizer)
        exe.compile_seconds = time.perf_counter() - start
        report(total, total)
        return exe

    @staticmethod
    def _estimate(graph: Graph, options: SessionOptions, training: bool, optimizer
                  ) -> cost_model.IpuEstimate:
        """Estimate memory and cycles, write the profile report when asked (S-85) and
        raise the out-of-memory error."""
        target = target_for(options.ipu_model_version, options.small_ipu_model)
        result = cost_model.estimate(graph, options, training, target, optimizer)
        directory = options.profile_dir(training)
        if directory is not None:
            write_report(directory, result, os.path.basename(directory), training)
        allow = options.engine_options.get("debug.allowOutOfMemory", "false").lower()
        cost_model.check(result, allow_out_of_memory=allow == "true")
        return result

    # -- checks -------------------------------------------------------------------

    @staticmethod
    def _use_inductor(exe: Executable) -> None:
        """Route the runners of ``exe`` through TorchInductor (compiled at first run).
        Floating-point exception checks (S-46) need the op-by-op interpreter, so they
        keep the eager runner."""
        if exe.options.fp_exceptions:
            logger.warning("Floating point exceptions are checked op by op: the inductor "
                           "compiler is not used for this model.")
            return
        random = exe.graph.random
        runner = exe.module
        if exe.options.device == "cpu":
            runner = inductor_backend.onednn_linear(copy.deepcopy(exe.module))
            if exe.vectorized is not None:
                inductor_backend.onednn_linear(exe.vectorized)
        exe.runner = inductor_backend.compile_graph(runner, random=random)
        exe.stage_wrapper = functools.partial(inductor_backend.compile_graph, random=random)
        if exe.vectorized is not None:
            exe.vectorized = inductor_backend.compile_graph(exe.vectorized, random=random)

    @staticmethod
    def _check_options(options: SessionOptions, training: bool) -> None:
        if options.output_mode not in OUTPUT_MODES:
            raise backend_error(f"Invalid output mode {options.output_mode}: pick one of "
                                "All, EveryN, Final, Sum.")
        if options.output_mode == 1:
            period, steps = options.output_return_period, options.device_iterations
            if period > steps:
                raise backend_error("Return period must be <= to the number of batches "
                                    f"per step ({period} > {steps}).")
            if steps % period:
                raise backend_error("Return period must be a factor of the number of "
                                    f"batches per step ({steps} % {period} != 0).")
        for anchor in options.anchors:
            if anchor.output_mode == 1 and (
                    anchor.return_period > options.device_iterations
                    or options.device_iterations % anchor.return_period):
                raise backend_error(
                    f"Return period of anchor {anchor.name} must be <= to and a factor of "
                    "the number of batches per step.")
        if not training and options.gradient_accumulation != 1:
            raise backend_error("Gradient accumulation must be 1 for an inference model.")
        if options.replication_factor < 1 or options.device_iterations < 1 \
                or options.gradient_accumulation < 1:
            raise backend_error("deviceIterations, replicationFactor and "
                                "gradientAccumulation must be positive integers.")
        if options.num_processes < 1 or not \
                0 <= options.process_id < options.num_processes:
            raise backend_error(
                f"Invalid distributed process {options.process_id} of "
                f"{options.num_processes}: Options.Distributed.configureProcessId(id, n) "
                "needs 0 <= id < n.")

    @staticmethod
    def _check_inputs(graph: Graph) -> None:
        """Input and output dtypes the IPU takes (S-45; complex values only inside the
        graph); no zero-sized user input or output (S-3)."""
        for node in graph.placeholders:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dtype in UNSUPPORTED_DTYPES:
                raise backend_error("Unsupported tensor input type from pytorch: "
                                    f"{UNSUPPORTED_DTYPES[val.dtype]}. Convert it with "
                                    ".float() or .half() before calling the model.")
        for info in graph.user_outputs:
            if info is not None and info.dtype in UNSUPPORTED_DTYPES:
                raise backend_error(
                    "Unsupported tensor output type: "
                    f"{UNSUPPORTED_DTYPES[info.dtype]}. The IPU has no complex or bfloat16 "
                    "types: complex values may only be intermediate results inside the "
                    "model (e.g. of torch.fft); return torch.view_as_real(x), x.real, "
                    "x.imag or x.abs() instead.")
        # Only the tensors the user passes or receives: intermediate values of a
        # decomposition (EmbeddingBag's offsets, an empty key/value cache that is
        # concatenated to) never reach the user and are computed as in PyTorch.
        for info in list(graph.user_inputs) + list(graph.user_outputs):
            if info is not None and 0 in info.shape:
                raise backend_error(f"Zero-sized tensors are unsupported (Got shape "
                                    f"{list(info.shape)})")

    @staticmethod
    def _check_loss(graph: Graph) -> int:
        finals = graph.final_losses()
        if not finals:
            raise backend_error(
                "Couldn't find a loss in graph! A training model must compute its loss "
                "with a PyTorch loss (e.g. torch.nn.functional.cross_entropy) or "
                "poptorch.identity_loss and return it from forward.")
        if len(finals) > 1:
            raise backend_error(
                "Multiple independent losses found in graph: "
                f"{', '.join(n.name for n in finals)}. Graph must have a single final "
                "loss: wrap the final combined loss in poptorch.identity_loss(loss, "
                "reduction=...).")
        outputs = graph.loss_outputs(finals[0])
        if len(outputs) > 1:
            raise backend_error(
                f"The model's forward returns {len(outputs)} different values computed "
                "from its final loss (outputs "
                f"{', '.join(str(i) for i in outputs)}): return the loss once, or wrap "
                "the value to back-propagate from in poptorch.identity_loss(loss, "
                "reduction=...).")
        if not outputs:
            raise backend_error(
                "The final loss must be returned by the model's forward (e.g. "
                "`return output, loss`).")
        return outputs[0]

    @staticmethod
    def _check_buffers(graph: Graph, options: SessionOptions) -> None:
        # S-36 compares the local replica count R (replicationFactor, S-28) with the
        # input groups, as PopTorch does under PopRun: each process keeps its own
        # buffers, which may drift apart between processes as they would in PopTorch.
        if (graph.mutated_buffers and options.broadcast_buffers
                and options.replication_factor > options.input_group_size):
            raise backend_error(
                "PopTorch does not support broadcasting buffers. If your model is able to "
                "tolerate buffers becoming out of sync between replicas, you can disable "
                "buffer broadcasting using poptorch.Options.broadcastBuffers(False). "
                f"Buffers modified in place: {sorted(graph.mutated_buffers)}.")

    @staticmethod
    def _check_replica_groupings(graph: Graph, options: SessionOptions) -> None:
        for name, grouping in options.replica_groupings.items():
            if name not in graph.parameters:
                raise backend_error(f"Per-replica weight {name} is not a parameter of the "
                                    "graph")
            grouping.validate(name, options.global_replicas)

    # -- anchors, names, vectorization ------------------------------------------------

    @staticmethod
    def _tensor_names(graph: Graph, training: bool, options: SessionOptions) -> List[str]:
        names = list(graph.parameters) + list(graph.buffers)
        if training and options.auto_loss_scaling:
            names += ["finalLossScale", "lossScaleUpdateFactor"]
        if training:
            for p, trainable in zip(graph.parameters, graph.trainable):
                if trainable:
                    names += [f"Gradient___{p}", f"UpdatedVar___{p}"]
        names += list(graph.activation_names())
        return names

    @staticmethod
    def _resolve_anchors(graph: Graph, options: SessionOptions, training: bool
                         ) -> Tuple[List[Anchor], List[Anchor]]:
        activation_names = graph.activation_names()
        activation: List[Anchor] = []
        state: List[Anchor] = []
        weights = set(graph.parameters) | set(graph.buffers)
        trainable = {p for p, t in zip(graph.parameters, graph.trainable) if t}
        new_outputs: List[fx.Node] = []
        for anchor in options.anchors:
            name = anchor.name
            prefix, _, base = name.partition("___")
            if name in weights or (training and base in trainable and prefix in (
                    "Gradient", "UpdatedVar", "Accl", "Accl1", "Accl2", "Accum", "Step")):
                state.append(anchor)
            elif training and options.auto_loss_scaling and name in (
                    "finalLossScale", "lossScaleUpdateFactor"):
                state.append(anchor)
            elif name in activation_names:
                activation.append(anchor)
                new_outputs.append(activation_names[name])
            else:
                raise backend_error(
                    f"Anchored tensor {name} not found in the graph. Valid names are listed "
                    "by PoplarExecutor.getTensorNames().")
        if new_outputs:
            out = next(n for n in reversed(graph.module.graph.nodes) if n.op == "output")
            out.args = (tuple(out.args[0]) + tuple(new_outputs),)
            graph.module.recompile()
        return activation, state

    @staticmethod
    def _chunk(graph: Graph, slots: int) -> int:
        """Micro-batches to run per vectorized call: the largest divisor of ``slots``
        keeping the largest intermediate tensor within :data:`VECTORIZE_BUDGET` bytes
        (batched kernels beyond the CPU caches get slower per sample than a loop)."""
        user_inputs = set(graph.placeholders[len(graph.placeholders) -
                                             graph.num_user_inputs:])
        largest = 1
        for node in graph.module.graph.nodes:
            if node.op not in ("call_function", "placeholder") or \
                    (node.op == "placeholder" and node not in user_inputs):
                continue  # weights are shared by the micro-batches of a call
            val = node.meta.get("val")
            values = val if isinstance(val, (list, tuple)) else [val]
            for v in values:
                if isinstance(v, torch.Tensor):
                    largest = max(largest, v.numel() * v.element_size())
        fit = max(1, VECTORIZE_BUDGET // largest)
        return max(c for c in range(1, slots + 1) if slots % c == 0 and c <= fit)

    @staticmethod
    def _vectorize(graph: Graph, slots: int, device: str) -> Optional[fx.GraphModule]:
        values = graph.state_values()
        names = graph.parameters + graph.buffers + graph.constants
        state = [values[n].detach().to(device) for n in names]
        state = [s.float() if s.dtype == torch.float64 else s for s in state]
        examples = []
        for info in graph.user_inputs:
            if info is None:
                return None
            examples.append(torch.empty(info.shape, dtype=info.dtype, device=device))
        return backends.vectorize(graph.module, state, examples, slots)


def output_names(graph: Graph) -> Dict[int, str]:
    """Graph node name of each user output (debugging aid)."""
    return {i: n.name for i, n in enumerate(graph.output_nodes) if n is not None}
