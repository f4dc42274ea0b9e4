"""The stage loop of a pipeline across processes (:mod:`popart_compiler.runtime.pipeline`):
this process's stage, driven micro-batch by micro-batch in PopART's order, its
activations and gradients travelling on ``torch.distributed`` (gloo on the CPU).

Training runs the 1F1B order of ``torch.distributed.pipelining.Schedule1F1B`` (stage
``s`` of ``P``: ``min(M, P − s)`` forwards, then one backward and one forward per step,
then the remaining backwards); inference runs the ``M`` forwards (GPipe without
backward). Micro-batches are processed in order in every stage, so gradients are
accumulated and buffers updated in the single process's order.

The loop drives the stages itself with ``isend`` / ``irecv`` instead of
``PipelineStage``: measured on the 2-stage bench MLP, that schedule cost about 0.85 ms
per micro-batch and stage on top of the transport (shape checks, per-tensor messages,
waits on its own sends before computing). Here, per micro-batch and boundary:

* the gradients flow back on a group of their own (``PipelineMesh.grad_group``):
  each direction of a boundary has its own connection;
* one message each way: every value crossing a boundary (activations; gradients of
  those that need one) is packed into one byte buffer when there are several, sent as
  it is (no copy) when there is one;
* receives are posted one micro-batch ahead, so a peer's send completes while this
  stage computes; sends are waited for only when their buffer is reused or at the end
  of the step;
* receive and pack buffers are reused once nothing refers to them any more (their
  micro-batch's backward has run and the sends that read them have completed).

:class:`ScheduleStats` says where the time went (compute, posting messages, waiting
for a peer); the bench prints it per stage.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from popart_compiler.errors import backend_error
from popart_compiler.runtime.device_state import DEVICE_DTYPES
from popart_compiler.runtime.pipeline_program import BoundaryValue
from popart_compiler.runtime.session import reduce_output
from popart_compiler.runtime.training import _AUTOGRAD_LOCK

__all__ = ["PipelineRunner", "ScheduleStats", "finished_shapes"]

_OPTION = "Options.Distributed.pipelineAcrossProcesses"
#: Byte alignment of each value inside a packed message (any dtype's view is valid).
_ALIGN = 64


@dataclasses.dataclass
class ScheduleStats:
    """Where this stage's time went in pipeline calls (wall-clock seconds, summed over
    calls).

    Attributes:
        micro_batches: micro-batches this stage ran.
        compute_s: forward and backward of the stage, gradient hand-over.
        compute_cpu_s: the CPU time of this thread in the same spans (``time.thread_time``:
            without the waits on other processes or the other threads' work).
        transfer_s: posting sends and receives, packing and unpacking messages.
        wait_s: waiting for a peer's activations or gradients, or for sends.
        update_s: weight updates (gradient sums, clipping, the optimizer step).
        outputs_s: the broadcast of the last stage's outputs.
        messages: messages sent.
        bytes_sent: bytes of activations and gradients sent.
        bytes_received: bytes of activations and gradients received.
    """
    micro_batches: int = 0
    compute_s: float = 0.0
    compute_cpu_s: float = 0.0
    transfer_s: float = 0.0
    wait_s: float = 0.0
    update_s: float = 0.0
    outputs_s: float = 0.0
    messages: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


class _Message:
    """The layout of what crosses one boundary for one micro-batch: one tensor as it
    is, or several packed into one ``uint8`` buffer (each at an aligned offset).

    Args:
        values: the values, in order (activations, or the gradients of those that
            need one: same shapes and dtypes).
        device: where the buffers live.
    """

    def __init__(self, values: Sequence[BoundaryValue], device: torch.device):
        self.specs = [(torch.Size(v.shape), v.dtype) for v in values]
        self.device = device
        self.offsets: List[int] = []
        offset = 0
        for shape, dtype in self.specs:
            self.offsets.append(offset)
            nbytes = shape.numel() * dtype.itemsize
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = offset
        self.single = len(self.specs) == 1
        self._free: List[Tuple[torch.Tensor, List[dist.Work]]] = []

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """A single tensor as it travels (gloo has no bool: its bytes)."""
        return t.view(torch.uint8) if t.dtype == torch.bool else t

    def empty(self) -> torch.Tensor:
        """A buffer to receive into: a reused one whose sends have completed, or a
        new one."""
        for k, (buf, works) in enumerate(self._free):
            if all(w.is_completed() for w in works):
                del self._free[k]
                return buf
        if self.single:
            shape, dtype = self.specs[0]
            return self._wire(torch.empty(shape, dtype=dtype, device=self.device))
        return torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)

    def retire(self, buf: torch.Tensor, works: Sequence[dist.Work] = ()) -> None:
        """``buf`` may be reused once ``works`` (sends that read it) have completed."""
        self._free.append((buf, list(works)))

    def pack(self, tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, bool]:
        """The buffer to send and whether it is a pack buffer of this message (to
        :meth:`retire` after the send) rather than the caller's tensor."""
        if self.single:
            return self._wire(tensors[0].detach()), False
        buf = self.empty()
        for t, offset, (shape, dtype) in zip(tensors, self.offsets, self.specs):
            nbytes = shape.numel() * dtype.itemsize
            buf[offset:offset + nbytes].copy_(
                t.detach().contiguous().reshape(-1).view(torch.uint8))
        return buf, True

    def unpack(self, buf: torch.Tensor) -> List[torch.Tensor]:
        """Views of ``buf`` with the values' shapes and dtypes (no copy)."""
        if self.single:  # a new alias: its requires_grad and .grad are this use's own
            return [buf.view(self.specs[0][1]) if buf.dtype != self.specs[0][1]
                    else buf.detach()]
        out = []
        for offset, (shape, dtype) in zip(self.offsets, self.specs):
            nbytes = shape.numel() * dtype.itemsize
            out.append(buf[offset:offset + nbytes].view(dtype).view(shape))
        return out


class _Link:
    """One direction of one boundary: messages of one layout to or from one peer of
    the pipeline group (its group rank: the peer's stage), posted on the group's
    ``ProcessGroup`` itself (``send`` / ``recv``: what ``dist.isend`` / ``dist.irecv``
    call, without their per-call checks)."""

    def __init__(self, message: _Message, peer: int, group, stats: ScheduleStats):
        self.message = message
        self.peer = peer
        self.group = group
        self.stats = stats
        self._posted: Optional[Tuple[dist.Work, torch.Tensor]] = None

    def post(self) -> None:
        """Post the receive of the next message."""
        buf = self.message.empty()
        self._posted = (self.group.recv([buf], self.peer, 0), buf)

    def reset(self) -> None:
        """Forget a posted receive (after a failed step)."""
        self._posted = None

    def receive(self) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Wait for the posted message: its buffer and its values."""
        if self._posted is None:
            self.post()
        work, buf = self._posted
        self._posted = None
        begin = time.perf_counter()
        work.wait()
        self.stats.wait_s += time.perf_counter() - begin
        self.stats.bytes_received += self.message.nbytes
        return buf, self.message.unpack(buf)

    def send(self, tensors: Sequence[torch.Tensor]) -> dist.Work:
        """Start sending ``tensors`` (returns at once)."""
        buf, owned = self.message.pack(tensors)
        work = self.group.send([buf], self.peer, 0)
        if owned:
            self.message.retire(buf, [work])
        self.stats.messages += 1
        self.stats.bytes_sent += self.message.nbytes
        return work


class PipelineRunner:
    """Runs this process's stage of a pipelined program (see the module's docstring).

    Args:
        session: the pipeline session (its weights, options, optimizer).
        layout: the program's layout over the processes
            (:class:`~popart_compiler.runtime.pipeline.PipelineLayout`).
        training: forward and backward (1F1B), else forward only.
    """

    def __init__(self, session, layout, training: bool):
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
        self.stats = ScheduleStats()
        device = torch.device(session.torch_device)
        group = layout.mesh.pp_group
        receives = self.program.receives[self.unit]
        sends = self.program.sends[self.unit]
        #: which received values get a gradient (sent back), which sent ones get one
        self._received_grad = [v.requires_grad and training for v in receives]
        self._sent_grad = [v.requires_grad and training for v in sends] \
            if not self.last else []
        self._act_in = _Link(_Message(receives, device), self.unit - 1, group, self.stats) \
            if receives else None
        self._act_out = _Link(_Message(sends, device), self.unit + 1, group, self.stats) \
            if sends and not self.last else None
        grads_in = [v for v, g in zip(sends, self._sent_grad) if g]
        grads_out = [v for v, g in zip(receives, self._received_grad) if g]
        back = layout.mesh.grad_group
        self._grad_in = _Link(_Message(grads_in, device), self.unit + 1, back,
                              self.stats) if grads_in else None
        self._grad_out = _Link(_Message(grads_out, device), self.unit - 1, back,
                               self.stats) if grads_out else None
        num_params = len(session.weights.params)
        self._grad_params = sorted(i for i in self.program.reads[self.unit]
                                   if i < num_params and session.weights.params[i].requires_grad)
        self._split: List[torch.Tensor] = []
        self._iteration = 0
        self._scale = 1.0
        self._results: List[Optional[List[torch.Tensor]]] = []
        self._error: Optional[BaseException] = None
        self._sends: List[dist.Work] = []
        #: per micro-batch in flight: received values, outputs, receive buffer, its
        #: forward send
        self._saved: Dict[int, Tuple[List[torch.Tensor], Tuple[torch.Tensor, ...],
                                     Optional[torch.Tensor], Optional[dist.Work]]] = {}

    # -- one micro-batch --------------------------------------------------------------

    def _slot(self, m: int) -> Tuple[int, int, int]:
        """``(device iteration, accumulation step, replica)`` of micro-batch ``m``."""
        step, rep = divmod(m, self.replicas)
        return (self._iteration, step, rep) if self.training else (step, 0, rep)

    def forward(self, received: Sequence[torch.Tensor], m: int) -> Tuple[torch.Tensor, ...]:
        """The stage's ops on micro-batch ``m`` (the last stage keeps its results)."""
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

    # -- the stage loop ---------------------------------------------------------------

    def _run_forward(self, m: int) -> None:
        stats = self.stats
        buf, received = None, []
        if self._act_in is not None:
            buf, received = self._act_in.receive()
            begin = time.perf_counter()
            if m + 1 < self.micro_batches:
                self._act_in.post()
            received = [t.requires_grad_() if g else t
                        for t, g in zip(received, self._received_grad)]
            stats.transfer_s += time.perf_counter() - begin
        begin, cpu = time.perf_counter(), time.thread_time()
        outs = self.forward(received, m)
        now = time.perf_counter()
        stats.compute_s += now - begin
        stats.compute_cpu_s += time.thread_time() - cpu
        work = None
        if self._act_out is not None:
            work = self._act_out.send(outs)
            self._sends.append(work)
            stats.transfer_s += time.perf_counter() - now
        if self.training:
            self._saved[m] = (received, outs, buf, work)
        elif buf is not None:
            self._act_in.message.retire(buf, [work] if work is not None else [])

    def _run_backward(self, m: int) -> None:
        stats = self.stats
        received, outs, buf, fwd_send = self._saved.pop(m)
        grad_buf = None
        if self.last:
            roots = [(outs[self.session.executable.loss_index] * self._scale).sum()]
            grads: List[Optional[torch.Tensor]] = [None]
        else:
            grad_buf, incoming = self._grad_in.receive()
            begin = time.perf_counter()
            if m + 1 < self.micro_batches:
                self._grad_in.post()
            stats.transfer_s += time.perf_counter() - begin
            sent = [t for t, g in zip(outs, self._sent_grad) if g]
            pairs = [(t, g) for t, g in zip(sent, incoming)
                     if t.requires_grad or t.grad_fn is not None]
            roots, grads = [t for t, _ in pairs], [g for _, g in pairs]
        begin, cpu = time.perf_counter(), time.thread_time()
        try:
            if roots:
                torch.autograd.backward(roots, grad_tensors=grads)
        except BaseException as e:
            self._error = e
            raise
        self._collect_gradients(m)
        now = time.perf_counter()
        stats.compute_s += now - begin
        stats.compute_cpu_s += time.thread_time() - cpu
        works = []
        if self._grad_out is not None:
            inputs = [t for t, g in zip(received, self._received_grad) if g]
            work = self._grad_out.send([t.grad if t.grad is not None else torch.zeros_like(t)
                                        for t in inputs])
            self._sends.append(work)
            works.append(work)
        if buf is not None:
            self._act_in.message.retire(buf, works + ([fwd_send] if fwd_send else []))
        if grad_buf is not None:
            self._grad_in.message.retire(grad_buf, works)
        stats.transfer_s += time.perf_counter() - now

    def _loop(self) -> None:
        m_total = self.micro_batches
        if not self.training:
            for m in range(m_total):
                self._run_forward(m)
            return
        warmup = min(m_total, self.program.num_units - self.unit)
        fwd = bwd = 0
        for _ in range(warmup):
            self._run_forward(fwd)
            fwd += 1
        while bwd < m_total:
            self._run_backward(bwd)
            bwd += 1
            if fwd < m_total:
                self._run_forward(fwd)
                fwd += 1

    def _wait_sends(self) -> None:
        begin = time.perf_counter()
        for work in self._sends:
            work.wait()
        self._sends = []
        self.stats.wait_s += time.perf_counter() - begin

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
        group = self.layout.group
        try:
            for link in (self._act_in, self._grad_in):
                if link is not None:  # the first messages can arrive while we compute
                    link.post()
            if self.training:
                with _AUTOGRAD_LOCK:
                    self._loop()
            else:
                with torch.no_grad():
                    self._loop()
            self._wait_sends()
            self.stats.micro_batches += self.micro_batches
        except BaseException as e:
            local, caught = self._error, e
            self._error = None
            self._saved.clear()
            self._sends = []
            for link in (self._act_in, self._grad_in):
                if link is not None:
                    link.reset()
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
        begin = time.perf_counter()
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
        self.stats.outputs_s += time.perf_counter() - begin
        return payload[:n_user]


def _reraise(e: BaseException):
    raise e


def finished_shapes(exe, options, shape: Tuple[int, int, int]
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
