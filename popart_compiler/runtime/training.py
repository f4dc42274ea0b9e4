"""The training session (our PopART ``TrainingSession``): per device iteration, ``A``
forward/backward micro-batches on each replica, the reduction of docs/semantics.md S-41, then one
optimizer step on the device weights (docs/semantics.md S-40…S-58)."""
from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Sequence

import torch

from popart_compiler.enums import MeanReductionStrategy, ReductionType
from popart_compiler.errors import backend_error
from popart_compiler.logging import logger
from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.optim.device_optimizer import DeviceOptimizer, StepSettings
from popart_compiler.runtime import collectives
from popart_compiler.runtime.device import IpuModel
from popart_compiler.runtime.lowering import Runners
from popart_compiler.runtime.session import Session
from popart_compiler.stages import Executable

__all__ = ["TrainingSession"]

#: One ``torch.autograd.grad`` at a time in the process: two training sessions running
#: backward in two threads at once can make torch's autograd engine fail ("A leaf node
#: was passed to _will_engine_execute_node ..."), seen on torch 2.13.
_AUTOGRAD_LOCK = threading.Lock()



def _dtype_name(dtype: torch.dtype) -> str:
    """``float32`` / ``float16`` for the optimizer log line."""
    return str(dtype).rpartition(".")[2]

class TrainingSession(Session):
    """Runs a training executable: per device iteration, ``A`` forward/backward
    micro-batches on each replica, the reduction of docs/semantics.md S-41, then one optimizer step.

    Gradients come from PyTorch autograd (``torch.autograd.grad`` of the loss times
    the loss scale, per micro-batch and replica); :class:`DeviceOptimizer` accumulates,
    reduces and applies them.

    Args:
        executable: a training executable.
        device: the attached IPU Model.
        optimizer: the optimizer to run on the device.

    Raises:
        Error: an invalid optimizer description.
    """

    training = True

    def __init__(self, executable: Executable, device: Optional[IpuModel],
                 optimizer: OptimizerDescription, runners: Optional[Runners] = None):
        super().__init__(executable, device, runners)
        g = executable.graph
        o = self.options
        #: the other processes of a multi-process run (docs/semantics.md S-28), ``None`` for one
        #: process
        self.process_group: Optional[collectives.ProcessGroup] = self._join_run(optimizer)
        all_reduce, sharing = self._gradient_sums()
        settings = StepSettings(
            accumulation=o.gradient_accumulation, replicas=o.replication_factor,
            global_replicas=o.global_replicas,
            mean=o.reduction_type is ReductionType.Mean,
            running=o.mean_reduction_strategy is MeanReductionStrategy.Running,
            replica_groups=self.weights.replica_groups(),
            auto_loss_scaling=o.auto_loss_scaling, als_update_period=o.als_update_period,
            als_threshold=o.als_threshold, als_bin_edge=o.als_bin_edge,
            foreach=o.backend == "inductor", all_reduce=all_reduce, sharing=sharing)
        self.optimizer = DeviceOptimizer(optimizer, g.parameters, self.weights.params,
                                         settings)
        self._log_optimizer(optimizer)

    def _join_run(self, optimizer: OptimizerDescription
                  ) -> Optional[collectives.ProcessGroup]:
        """A multi-process run: join the other processes and check that they compiled
        the same program (docs/semantics.md S-28). ``None`` for a single process."""
        o = self.options
        if o.num_processes <= 1:
            return None
        group = collectives.process_group(o.process_id, o.num_processes, self.torch_device)
        group.check_consistent(collectives.program_signature(self.executable, optimizer))
        return group

    def _gradient_sums(self):
        """``(all_reduce, sharing)`` of :class:`StepSettings`: how the gradients of a
        weight update are summed over the processes."""
        return (self.process_group.all_reduce_sum if self.process_group else None), None

    @staticmethod
    def _log_optimizer(description: OptimizerDescription) -> None:
        lines = description.describe()
        d = description
        first = d.velocity_accum_type if d.type == "SGD" else d.first_order_type
        # PopTorch's words: the storage types and the variant follow the values.
        logger.debug("Updating graph optimizer with %s, accumType=%s, "
                     "firstOrderMomentumAccumType=%s, secondOrderMomentumAccumType=%s, "
                     "useTfVariant=%d, maxGradNorm=%s", lines[0], _dtype_name(d.accum_type),
                     _dtype_name(first), _dtype_name(d.second_order_type),
                     d.use_tf_variant, d.max_grad_norm)
        for i, line in enumerate(lines[1:]):
            logger.debug("Updating group %d optimizer with %s", i, line)

    def _mutable_tensors(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        params = [p for p in self.weights.params if p.requires_grad]
        return params + super()._mutable_tensors(inputs) + self.optimizer.state_tensors()

    def _snapshot(self, mutable: List[torch.Tensor]) -> Dict[str, object]:
        snap = super()._snapshot(mutable)
        snap["optimizer"] = self.optimizer.snapshot(copy_state=False)
        return snap

    def _restore(self, snap: Dict[str, object], mutable: List[torch.Tensor]) -> None:
        super()._restore(snap, mutable)
        self.optimizer.restore(snap["optimizer"])

    def broadcast_state(self) -> None:
        """Multi-process run: overwrite this process's weights, buffers and optimizer
        state with process 0's, so that every process starts identical (docs/semantics.md S-28).
        Called once, after the host state was uploaded at the first compile; a no-op for a single
        process.

        Raises:
            Error: another process failed or timed out.
        """
        if self.process_group is None:
            return
        w = self.weights
        tensors = list(w.params) + [b for bufs in w.buffers for b in bufs
                                    if isinstance(b, torch.Tensor)]
        names = sorted(self.optimizer.state)
        tensors += [self.optimizer.state[k] for k in names]
        self.process_group.broadcast_(tensors, src=0)
        self.optimizer.note_state_written(names)

    def checkOptimizer(self, description: OptimizerDescription) -> None:
        """Raise if ``description`` cannot replace the compiled optimizer
        (docs/semantics.md S-52)."""
        self.optimizer.check_update(description)

    def setOptimizer(self, description: OptimizerDescription) -> None:
        """Apply new hyper-parameter values (``updateOptimizerFromHost``).

        Raises:
            Error: a change that needs recompilation (docs/semantics.md S-52); nothing changes then.
        """
        self.optimizer.update(description)
        self._log_optimizer(description)

    def _gradients(self, loss: torch.Tensor, wrt: List[torch.Tensor], scale: float,
                   inputs_finite: bool) -> List[Optional[torch.Tensor]]:
        seed = torch.full_like(loss, scale)
        with _AUTOGRAD_LOCK:
            grads = list(torch.autograd.grad(loss, wrt, seed, allow_unused=True))
        if self.options.fp_exceptions and inputs_finite and \
                bool(torch.isfinite(loss).all()):
            for g in grads:
                if g is not None and g.is_floating_point() and \
                        not bool(torch.isfinite(g).all()):
                    raise backend_error(
                        "Floating point exception: overflow in the backward pass (a "
                        "gradient is not finite although the loss is). Lower the loss "
                        "scaling or disable poptorch.Options().Precision."
                        "enableFloatingPointExceptions.",
                        type="poplar_application_runtime_error")
        return grads

    def _run(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        o = self.options
        d, a, r = o.device_iterations, o.gradient_accumulation, o.replication_factor
        exe = self.executable
        run = self._runner
        split = self._split(inputs)
        params = self.weights.params
        num_params = len(params)
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        loss_index = exe.loss_index
        opt = self.optimizer
        results: List[List[torch.Tensor]] = []
        state_anchor_names = {anc.name for anc in exe.state_anchors}
        per_iteration: Dict[str, List[torch.Tensor]] = {n: [] for n in state_anchor_names}
        for i in range(d):
            since = time.perf_counter()
            opt.begin_step()
            scale = opt.loss_scale
            if "finalLossScale" in per_iteration:
                per_iteration["finalLossScale"].append(torch.tensor(scale))

            def backward(step, rep, outs, state, xs):
                """Backward of one micro-batch, then accumulate its gradients."""
                loss = outs[loss_index]
                if trainable and loss.requires_grad:
                    finite = o.fp_exceptions and all(
                        bool(torch.isfinite(t).all()) for t in xs + state[:num_params]
                        if t.is_floating_point())
                    grads = self._gradients(loss, [state[j] for j in trainable], scale,
                                            finite)
                    full: List[Optional[torch.Tensor]] = [None] * num_params
                    for j, g in zip(trainable, grads):
                        full[j] = g
                    opt.accumulate(rep, step, full)
                # the optimizer step writes the weights in place: no output may see it
                return self._fresh([t.detach() for t in outs], [*state, *xs])

            if self._staged is not None:
                # Micro-batches flow through the stages in schedule order; each one's
                # backward runs as it leaves the last forward stage (docs/semantics.md S-63).
                args = [[[*self.weights.state(rep), *[t[i, step, rep] for t in split]]
                         for rep in range(r)] for step in range(a)]
                done: List[Optional[List[torch.Tensor]]] = [None] * (a * r)

                def finish(step, rep, outs):
                    state = args[step][rep][:len(args[step][rep]) - len(split)]
                    xs = args[step][rep][len(state):]
                    done[step * r + rep] = backward(step, rep, outs, state, xs)
                self._staged.run(args, finish)
                results.extend(done)
            else:
                for step in range(a):
                    for rep in range(r):
                        state = self.weights.state(rep)
                        xs = [t[i, step, rep] for t in split]
                        results.append(backward(step, rep, run(*state, *xs), state, xs))
            # no local may keep this update's gradients alive into the next micro-batch:
            # the next backward would then allocate beside them instead of reusing
            # their memory, and the allocator would hand it back to the OS every time
            # (page faults measured at ~20 % of an MLP's training time)
            self._collect_gradients(per_iteration, opt.finish_step(params))
            self._collect_state(per_iteration)
            self.clock.mark(i, 1, since)
        stacked = [torch.stack([res[j] for res in results]).reshape(d, a, r, *results[0][j].shape)
                   for j in range(len(results[0]))] if results else []
        self._record_state_anchors(per_iteration)
        return self._finish(stacked)

    def _collect_gradients(self, per_iteration: Dict[str, List[torch.Tensor]],
                           grads: List[Optional[torch.Tensor]]) -> None:
        """Record the anchored ``Gradient___<name>`` tensors of one weight update."""
        params = self.weights.params
        for name, g in zip(self.executable.graph.parameters, grads):
            key = f"Gradient___{name}"
            if key in per_iteration and g is not None:
                per_iteration[key].append(g.to(params[self.weights.index[name]].dtype))

    def _collect_state(self, per_iteration: Dict[str, List[torch.Tensor]]) -> None:
        if not per_iteration:
            return
        for name in per_iteration:
            prefix, _, base = name.partition("___")
            if prefix == "Gradient" or name == "finalLossScale":
                continue
            if name in self.optimizer.state:
                value = self.optimizer.state[name]
            elif prefix == "UpdatedVar":
                value = self.weights.read(base)
            else:
                value = self.weights.read(name) if name in self.weights.index else None
            if value is not None:
                per_iteration[name].append(value.detach().clone())

    # -- optimizer state ----------------------------------------------------------------

    def readOptimizerState(self) -> Dict[str, torch.Tensor]:
        """Optimizer-state tensors by PopART name (``ipu_state``, docs/semantics.md S-56)."""
        return {k: v.cpu() for k, v in self.optimizer.state_dict().items()}

    def checkOptimizerState(self, state: Dict[str, torch.Tensor]) -> None:
        """Validate optimizer-state tensors for :meth:`writeOptimizerState`.

        Raises:
            Error: not a dict of tensors, or a shape that differs from the device's.
        """
        self.optimizer.check_state(state)

    def writeOptimizerState(self, state: Dict[str, torch.Tensor]) -> None:
        """Write optimizer-state tensors (missing entries keep their device values).

        Raises:
            Error: see :meth:`checkOptimizerState`; nothing is written then.
        """
        self.optimizer.load_state_dict(state)

    def readOptimizerParams(self) -> Dict[str, torch.Tensor]:
        """Hyper-parameter tensors by PopART name (``ipu_param``, docs/semantics.md S-56)."""
        return self.optimizer.hyper_parameters()

    def writeOptimizerParams(self, params: Dict[str, torch.Tensor]) -> None:
        """Write hyper-parameter tensors by PopART name (``ipu_param``, docs/semantics.md
        S-56): the following weight updates use them until :meth:`setOptimizer` sends
        new values. Unknown names are ignored, missing ones keep their values.

        Raises:
            TypeError: a value is not a one-element tensor.
        """
        self.optimizer.write_hyper_parameters(params)
