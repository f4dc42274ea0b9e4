"""Activations, pipeline stash and backward working set of one IPU, stage by stage.

Follows PopART's pipelining (``transforms/pipeline.cpp``) and recomputation:

* Stages are the merged stages of :func:`~.op_costs.merge_stages`. With ``N``
  forward stages, forward stage ``k`` runs its backward ``2(N − 1 − k)`` pipeline
  cycles after its forward; what backward needs is stashed once per micro-batch in
  flight: ``2(N − 1 − k) + 1`` copies (PopART's stash size, restore stage − stash stage
  + 1), the last of which is restored in place. The last forward stage runs its
  backward in the same pipeline cycle (one stage: ``forward+backward``): nothing is
  stashed and nothing recomputed; its activations are live until its backward.
* With recomputation (``autoRecomputation``; PopTorch sets ``Pipeline`` for a
  pipeline over several IPUs, and honours ``recomputation_checkpoint`` marks only then)
  a stage keeps the tensors it receives (from another stage, or the host) and the
  checkpoints that later ops of the same stage read (a checkpoint only consumed by the
  next IPU spans one stage and is not stashed); backward recomputes each segment
  between checkpoints. Without recomputation every op output (and the stage's
  input) is kept.
* The backward of a segment needs its recomputed activations once, plus the gradients
  of the op being differentiated (incoming: its output's size; outgoing: its
  activation inputs'), for the op of the segment where they are largest.
* Only outputs backward reads count: those of ops that depend on a trainable weight and
  the inputs such ops read (``OpCost.saved``); ops PopART runs in place share their
  input's memory (``OpCost.memory_bytes``).
* Not pipelined (one stage, or sharded execution): each stage is stashed once (depth
  1) and recomputes as requested.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, FrozenSet, List, Sequence, Tuple

from popart_compiler.popart_enums import RecomputationType

__all__ = ["StageMemory", "stage_memory", "one_stage", "stage_input", "owners",
           "recomputation_active", "kept_for_backward", "RECOMPUTE_NONE",
           "RECOMPUTE_STANDARD", "RECOMPUTE_NORM_ONLY", "RECOMPUTE_PIPELINE",
           "RECOMPUTE_ALL"]

#: The ``autoRecomputation`` members (PopART's ``RecomputationType``, in value order).
RECOMPUTE_NONE, RECOMPUTE_STANDARD, RECOMPUTE_NORM_ONLY, RECOMPUTE_PIPELINE, \
    RECOMPUTE_ALL = RecomputationType


@dataclasses.dataclass
class StageMemory:
    """Training memory of one forward stage on its IPU (bytes, one micro-batch unless
    said otherwise).

    Attributes:
        stage: merged stage index.
        ipu: its IPU.
        depth: copies of ``saved`` held (micro-batches between its forward and its
            backward, + 1).
        saved: what backward needs of one micro-batch.
        working: the backward working set of its largest segment.
        recomputed: names of the forward ops its backward runs again.
    """
    stage: int
    ipu: int
    depth: int
    saved: float
    working: float
    recomputed: FrozenSet[str] = frozenset()

    @property
    def stash(self) -> float:
        """Bytes held for the other micro-batches in flight."""
        return self.saved * (self.depth - 1)


def recomputation_active(ops, auto_recomputation: int, training: bool,
                         pipeline: bool = True) -> bool:
    """Whether the program recomputes forward ops in backward: ``autoRecomputation``
    is on (PopTorch sets ``Pipeline`` for a pipeline over more than one IPU,
    :mod:`popart_compiler.implicit_defaults`); ``Pipeline`` acts only in a pipeline of
    several stages (``pipeline``). Without it PopART ignores
    ``recomputationCheckpoint`` marks and keeps every activation."""
    if auto_recomputation == RECOMPUTE_PIPELINE and not pipeline:
        return False
    return training and auto_recomputation != RECOMPUTE_NONE


def kept_for_backward(op, auto_recomputation: int, recomputing: bool) -> bool:
    """Whether ``op``'s output is stored for backward rather than recomputed.

    ``Pipeline`` and ``RecomputeAll`` recompute every op the user did not checkpoint
    (PopART's ``setRecomputation`` / ``annotateRecomputeAll``); ``Standard`` also
    keeps the outputs of matmuls and convolutions, ``NormOnly`` all but the norms."""
    if not recomputing:
        return True
    mode = auto_recomputation
    return op.checkpoint or (mode == RECOMPUTE_STANDARD and op.flops > 0) or \
        (mode == RECOMPUTE_NORM_ONLY and "norm" not in op.op)


def owners(ops) -> Dict[str, str]:
    """Op name → the op that allocated its buffer (views, checkpoint markers and
    in-place ops use their first input's)."""
    owner: Dict[str, str] = {}
    for op in ops:
        owner[op.name] = owner.get(op.inputs[0], op.inputs[0]) \
            if (op.view or op.inplace) and op.inputs else op.name
    return owner


def stage_input(ops, outside: Callable[[str], bool], user_inputs: Dict[str, int],
                sizes: Dict[str, int], owner: Dict[str, str]) -> float:
    """Bytes a stage of ``ops`` receives: user inputs, and the tensors ``outside(name)``
    says another stage produced (counted once per buffer, ``owner``)."""
    seen = set()
    total = 0.0
    for op in ops:
        for name in op.inputs:
            if name in user_inputs:
                key, size = name, user_inputs[name]
            elif outside(name):
                key = owner.get(name, name)
                size = sizes.get(key, 0)
            else:
                continue
            if key not in seen:
                seen.add(key)
                total += size
    return total


def _gradient_bytes(op) -> int:
    """Gradient buffers live while ``op`` is differentiated: its incoming gradient (its
    output's size) and the outgoing ones (its activation inputs)."""
    return op.out_bytes + op.in_bytes - op.weight_bytes


def _saved_and_working(ops, auto_recomputation: int, recompute: bool, received: float,
                       keep_tail: bool) -> Tuple[float, float, FrozenSet[str]]:
    """``(saved, working, recomputed op names)`` of one stage (module docstring).
    ``keep_tail``: the ops after the stage's last checkpoint keep their outputs (the
    last forward stage runs its backward in the same pipeline cycle)."""
    needed = [op for op in ops if not op.view and op.saved]
    grads = max((_gradient_bytes(op) for op in needed), default=0)
    if not recompute:
        return received + float(sum(op.memory_bytes for op in needed)), float(grads), \
            frozenset()
    owner = owners(ops)
    # buffers a later op of the stage reads (not counting the views and in-place ops
    # that take them over)
    read_in_stage = {owner.get(name, name) for op in ops if not op.view
                     for name in (op.inputs[1:] if op.inplace else op.inputs)}
    saved, worst = received, 0.0
    segment, largest, members = 0.0, 0.0, []
    recomputed: List[str] = []
    for op in needed:
        keep = kept_for_backward(op, auto_recomputation, True)
        if keep and (not op.checkpoint or op.name in read_in_stage):
            saved += op.memory_bytes
        if op.checkpoint:
            worst = max(worst, segment + largest)
            recomputed += members
            segment, largest, members = 0.0, 0.0, []
        elif not keep:
            segment += op.memory_bytes
            largest = max(largest, _gradient_bytes(op))
            members.append(op.name)
    if keep_tail:
        saved += segment
        worst = max(worst, largest)
    else:
        worst = max(worst, segment + largest)
        recomputed += members
    return saved, worst, frozenset(recomputed)


def one_stage(mine: Sequence, position: int, count: int, received: float,
              auto_recomputation: int, recomputing: bool, pipelined: bool,
              explicit: bool = False) -> StageMemory:
    """Training memory of one forward stage (module docstring).

    Args:
        mine: the stage's ops, in order.
        position / count: its index among the ``count`` merged forward stages.
        received: bytes it receives (:func:`stage_input`).
        auto_recomputation: the ``autoRecomputation`` option.
        recomputing: the program recomputes (:func:`recomputation_active`).
        pipelined: pipelined execution (else depth 1).
        explicit: ``explicitRecomputation``: a program that is not pipelined also
            recomputes the ops after its last checkpoint (PopART keeps them only with
            implicit recomputation, ``allCheckpointAfterLastCheckpoint``).
    """
    piped = pipelined and count > 1
    depth = 2 * (count - 1 - position) + 1 if piped else 1
    last = position == count - 1
    saved, working, recomputed = _saved_and_working(
        mine, auto_recomputation, recomputing, received,
        keep_tail=last and (piped or not explicit))
    return StageMemory(mine[0].stage, mine[0].ipu, depth, saved, working, recomputed)


def stage_memory(ops: Sequence, stages: Sequence, user_inputs: Dict[str, int],
                 auto_recomputation: int, pipelined: bool, explicit: bool = False
                 ) -> List[StageMemory]:
    """Training memory of every forward stage.

    Args:
        ops: all forward ops of the program (``OpCost``), with merged stages.
        stages: the merged ``(stage, ipu)`` list in pipeline order.
        user_inputs: user input name → bytes.
        auto_recomputation: the ``autoRecomputation`` option.
        pipelined: pipelined execution (else every stage has depth 1).
        explicit: ``explicitRecomputation`` (see :func:`one_stage`).
    """
    recomputing = recomputation_active(ops, auto_recomputation, True,
                                       pipelined and len(stages) > 1)
    producer = {op.name: op.stage for op in ops}
    sizes = {op.name: op.out_bytes for op in ops}
    owner = owners(ops)
    by_stage: Dict[int, list] = {}
    for op in ops:
        by_stage.setdefault(op.stage, []).append(op)
    result = []
    for k, (stage, _ipu) in enumerate(stages):
        mine = by_stage.get(stage, [])
        if not mine:
            continue
        received = stage_input(mine, lambda name, s=stage: producer.get(name, s) != s,
                               user_inputs, sizes, owner)
        result.append(one_stage(mine, k, len(stages), received, auto_recomputation,
                                recomputing, pipelined, explicit))
    return result
