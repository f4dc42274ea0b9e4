"""Every process of a pipeline run across processes keeps the whole model's state
(:mod:`popart_compiler.runtime.pipeline`).

A stage updates only what it owns: the parameters it reads (the first stage that
reads a tied parameter publishes it; the others computed the same update), the
buffers it writes and the optimizer state of its parameters. After each run, every
stage *publishes* what it owns to the other processes of its pipeline: one
asynchronous ``broadcast`` per stage and dtype on a group of its own, so the copies
travel while the host does other work. A process waits for them (:meth:`settle`)
before anything reads or writes the state on the host side: ``copyWeightsToHost``
and implicit reads, ``readOptimizerState`` (checkpoints), host writes, and the next
run. Host reads are thus local: a script may save a checkpoint in one process only.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from popart_compiler.runtime.pipeline_mesh import PipelineMesh

__all__ = ["StatePublisher"]


class StatePublisher:
    """Publishes each stage's state to the other processes of its pipeline.

    Args:
        mesh: this process's place in the run.
        owned: for each stage, the tensors it owns, in the same order in every
            process (the live device tensors: the owner sends from them, the others
            receive into them).
        device: where the flat buffers go: the CPU for gloo, the session's CUDA
            device for NCCL.

    Attributes:
        stats: ``publications`` (runs published), ``bytes`` (sent or received by
            this process) and ``seconds`` spent waiting in :meth:`settle`.
    """

    def __init__(self, mesh: PipelineMesh, owned: List[List[torch.Tensor]], device: str):
        self.mesh = mesh
        self.owned = owned
        self.device = device
        self._pending: List[Tuple[Any, torch.Tensor, Optional[List[torch.Tensor]]]] = []
        self.stats: Dict[str, float] = {"publications": 0, "bytes": 0, "seconds": 0.0}

    def publish(self) -> None:
        """Start sending this stage's state and receiving the others' (returns at
        once; :meth:`settle` waits)."""
        self.settle()
        mesh = self.mesh
        if mesh.stages == 1:
            return
        for stage, tensors in enumerate(self.owned):
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for dtype, group in by_dtype.items():
                numel = sum(t.numel() for t in group)
                if stage == mesh.stage:
                    flat = torch.cat([t.detach().reshape(-1) for t in group]).to(self.device)
                    targets = None
                else:
                    flat = torch.empty(numel, dtype=dtype, device=self.device)
                    targets = group
                src = mesh.rank_of(stage)
                work = mesh.group.guard(
                    "publication of the stages' weights",
                    lambda flat=flat, src=src: dist.broadcast(
                        flat, src, group=mesh.sync_group, async_op=True))
                self._pending.append((work, flat, targets))
                self.stats["bytes"] += numel * flat.element_size()
        self.stats["publications"] += 1

    def settle(self) -> None:
        """Wait for the last publication and write what the other stages sent into
        this process's copies.

        Raises:
            Error: a peer failed or timed out.
        """
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        begin = time.perf_counter()
        for work, flat, targets in pending:
            self.mesh.group.guard("publication of the stages' weights", work.wait)
            if targets is None:
                continue
            offset = 0
            with torch.no_grad():
                for t in targets:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()
        self.stats["seconds"] += time.perf_counter() - begin
