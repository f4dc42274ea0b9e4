"""Execution strategies: stages, phases and how blocks map to them
(docs/api-sections.md api §9.5–§9.10, docs/semantics.md S-60, S-63…S-65).

Public names: :class:`Stage`, :class:`Phase`, :class:`PipelinedExecution`,
:class:`ShardedExecution`, :class:`SerialPhasedExecution`,
:class:`ParallelPhasedExecution`, and (re-exported from :mod:`poptorch._ops.blocks`) the
block annotations :class:`Block`, :func:`BeginBlock`, :func:`BlockFunction`,
:func:`removeBlocks` with the block-state helpers. Behaviour follows PopTorch 3.x.

Strategies derive the (stage, IPU) of a block with
``strategy._blockPlacement(user_id, ipu_id)`` after ``strategy._onStartCapture()``,
and the placement of every block of a capture with ``strategy._placements(history)``.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from popart_compiler.errors import py_error
from popart_compiler.passes.placement import Placement
from poptorch import enums
from poptorch._ops.blocks import (NO_ACTIVE_BLOCK, BeginBlock, Block, block_key,  # noqa: F401
                                  BlockFunction, BlockInfo, _begin_block_hooks,
                                  _BeginBlockFn, _BeginBlockHook, _end_block, _next_auto_id,
                                  _NoActiveBlock, _reset_block_state, _start_block, _state,
                                  _stop_block_tracking, block_capture, block_history,
                                  current_block, is_tracking_blocks, no_active_block,
                                  removeBlocks)

__all__ = [
    "Block", "BeginBlock", "BlockFunction", "removeBlocks", "Stage", "Phase",
    "PipelinedExecution", "ShardedExecution", "SerialPhasedExecution",
    "ParallelPhasedExecution",
]

# ---------------------------------------------------------------------------
# Stages and phases
# ---------------------------------------------------------------------------


class Stage:
    """A set of blocks that run on one IPU.

    Args:
        *block_ids (str): ids of the blocks in this stage.

    Members: ``blocks`` (tuple of ids), :meth:`ipu`.

    Raises:
        AssertionError: if a block id is not a ``str``. Same as PopTorch.
    """

    def __init__(self, *block_ids: str):
        for block in block_ids:
            if not isinstance(block, str):
                raise AssertionError(f"Block ID must be strings: got {block!r} "
                                     f"of type {type(block)}")
        self._blocks: Tuple[str, ...] = tuple(block_ids)
        self._ipu: Optional[int] = None
        self._stage_id: Optional[int] = None
        self._phase_id: Optional[int] = None

    @property
    def blocks(self) -> Tuple[str, ...]:
        """The block ids of this stage."""
        return self._blocks

    def ipu(self, ipu: int) -> "Stage":
        """Force the IPU of all the blocks of this stage (overrides their
        ``ipu_id``). Returns self. ``AssertionError`` if ``ipu`` is not an int."""
        if not isinstance(ipu, int):
            raise AssertionError(f"Stage.ipu: ipu must be an integer, got {type(ipu)}")
        self._ipu = ipu
        return self

    def __repr__(self) -> str:
        text = "Stage(" + ", ".join(repr(b) for b in self._blocks) + ")"
        if self._ipu is not None:
            text += f".ipu({self._ipu})"
        return text


class Phase:
    """A set of stages that run in parallel within phased execution.

    Args:
        *arg: either all :class:`Stage` objects, or all block-id strings (which
            then form **one** stage).

    Members: ``stages`` (list), :meth:`stage`, :meth:`ipus`.

    Raises:
        AssertionError: when the arguments mix stages and strings (or are of any
            other type). Same as PopTorch.
    """

    def __init__(self, *arg):
        if all(isinstance(a, Stage) for a in arg):
            self.stages: List[Stage] = list(arg)
        elif all(isinstance(a, str) for a in arg):
            self.stages = [Stage(*arg)]
        else:
            raise AssertionError("All arguments must either be block IDs (strings) or "
                                 f"Stages: {[type(a) for a in arg]}")

    def stage(self, idx: int) -> Stage:
        """The stage at position ``idx``.

        Raises:
            poptorch.Error: ``idx`` is not the index of one of the phase's stages.
        """
        if not isinstance(idx, int) or not 0 <= idx < len(self.stages):
            raise py_error(f"Stage {idx!r} does not exist: this phase has "
                           f"{len(self.stages)} stage(s), numbered from 0.")
        return self.stages[idx]

    def ipus(self, *ipus: int) -> None:
        """Assign one IPU per stage (in order). Returns ``None``.

        Raises:
            AssertionError: if the number of IPUs differs from the number of stages
                (or an IPU is not an int).
        """
        if len(ipus) != len(self.stages):
            raise AssertionError(f"Phase contains {len(self.stages)} stages but you "
                                 f"provided {len(ipus)} ipus")
        for stage, ipu in zip(self.stages, ipus):
            stage.ipu(ipu)

    def __repr__(self) -> str:
        return "Phase(" + ", ".join(repr(s) for s in self.stages) + ")"


def _to_stage(arg) -> Stage:
    if isinstance(arg, Stage):
        return arg
    if isinstance(arg, str):
        return Stage(arg)
    if isinstance(arg, (list, tuple, set, frozenset)) or (
            hasattr(arg, "__iter__") and not isinstance(arg, (dict, torch.Tensor))):
        return Stage(*arg)
    raise AssertionError(f"Invalid stage {arg!r}: each argument must be a "
                         "poptorch.Stage, a block id (str) or a list of block ids")


class _IExecutionStrategy:
    """Common base of the execution strategies: explicit stages, block → stage map
    and the (stage, IPU) derivation used at capture time."""

    _execution_mode = 0

    def __init__(self, stages: List[Stage], auto_stage: enums.AutoStage):
        self._stages = stages
        self._auto_stage = auto_stage
        self._block_map: Dict[str, Stage] = {}
        for stage_id, stage in enumerate(stages):
            stage._stage_id = stage_id
            for block in stage.blocks:
                if block in self._block_map:
                    raise AssertionError(f"{block} associated with more than one stage")
                self._block_map[block] = stage
        self._onStartCapture()

    # -- public ------------------------------------------------------------
    def stage(self, block_id: str) -> Stage:
        """The :class:`Stage` containing ``block_id``.

        Raises:
            AssertionError: "Unknown block <id>".
        """
        if block_id not in self._block_map:
            raise AssertionError(f"Unknown block {block_id}")
        return self._block_map[block_id]

    def backendOptions(self) -> Dict[str, Any]:
        """The backend values contributed to ``Options.toDict()``
        (docs/api-sections.md options §5)."""
        return {"execution_mode": self._execution_mode}

    # -- capture-time helpers ------------------------------------------------
    @property
    def _explicit(self) -> bool:
        return bool(self._block_map)

    def _onStartCapture(self) -> None:
        """Forget the stage ids derived during a previous capture."""
        self._auto_stage_ids: Dict[Any, int] = {}
        self._next_stage_id = 0

    def _stageId(self, user_id, ipu_id: Optional[int]) -> int:
        """The stage id of block ``user_id`` (started with ``ipu_id``).

        Raises:
            AssertionError: "Unknown Block '<id>' list of expected Blocks: [...]"
                with explicit stages; "...SameAsIpu was selected but no IPU was
                specified for block <id>" with ``AutoStage.SameAsIpu``.
        """
        if self._explicit:
            if user_id not in self._block_map:
                raise AssertionError(f"Unknown Block '{user_id}' list of expected "
                                     f"Blocks: {list(self._block_map)}")
            return self._block_map[user_id]._stage_id
        if self._auto_stage == enums.AutoStage.AutoIncrement:
            if user_id not in self._auto_stage_ids:
                self._auto_stage_ids[user_id] = self._next_stage_id
                self._next_stage_id += 1
            return self._auto_stage_ids[user_id]
        if ipu_id is None:
            raise AssertionError(f"AutoStage.{self._auto_stage.name} was selected but no IPU was "
                                 f"specified for block {user_id}")
        return ipu_id

    def _blockPlacement(self, user_id, ipu_id: Optional[int]) -> Tuple[int, int]:
        """``(stage_id, ipu)`` of block ``user_id``: the IPU is the stage's explicit
        :meth:`Stage.ipu`, else the block's ``ipu_id``, else the stage id
        (docs/semantics.md S-60)."""
        stage_id = self._stageId(user_id, ipu_id)
        stage = self._block_map.get(user_id)
        if stage is not None and stage._ipu is not None:
            return stage_id, stage._ipu
        if ipu_id is not None:
            return stage_id, ipu_id
        return stage_id, stage_id


    def _phaseOf(self, user_id) -> int:
        """Forward phase of block ``user_id`` (0 outside phased execution)."""
        return 0

    def _placements(self, history: List[BlockInfo]) -> Dict[str, Placement]:
        """Placement of every block started during a capture, in order of first use
        (call :meth:`_onStartCapture` first).

        Args:
            history: the ``(user_id, ipu_id)`` of every block start, in order.

        Raises:
            AssertionError: "Unknown Block ..." / "...SameAsIpu was selected but no IPU
                was specified for block <id>" (docs/api-sections.md api §9.7).
            poptorch.Error: an ``ipu_id`` that is not a non-negative int; one block id
                started with two different ``ipu_id``s outside phased execution (in a
                phased strategy each IPU's part gets its own key ``<id>@ipu<N>``, in the
                block's phase); explicit stages naming blocks the model never starts.
        """
        placements: Dict[str, Placement] = {}
        ipu_of: Dict[str, Optional[int]] = {}
        phased = isinstance(self, _IPhasedExecution)
        for index, (user_id, ipu_id) in enumerate(history):
            key = str(user_id)
            if phased:
                key = block_key((user_id, ipu_id), history[:index])
            if ipu_id is not None and (not isinstance(ipu_id, int) or isinstance(ipu_id, bool)
                                       or ipu_id < 0):
                raise py_error(f"Block '{key}' has ipu_id={ipu_id!r}: an IPU id must be a "
                               "non-negative integer. Change the ipu_id of this block.")
            if key in ipu_of:
                if ipu_of[key] != ipu_id:
                    raise py_error(
                        f"Block '{key}' is started on IPU {ipu_of[key]} and again on IPU "
                        f"{ipu_id}: a block id used twice is the same block, so both uses "
                        "must name the same IPU. Give each block its own user_id (or the "
                        "same ipu_id).")
                continue
            ipu_of[key] = ipu_id
            if key != str(user_id):  # the same phase and stage, on another IPU
                base = placements[str(user_id)]
                placements[key] = Placement(ipu_id, base.stage, base.phase)
                continue
            stage, ipu = self._blockPlacement(user_id, ipu_id)
            placements[key] = Placement(ipu, stage, self._phaseOf(user_id))
        unused = [b for b in self._block_map if b not in placements]
        if unused:
            raise py_error(
                f"Block(s) {unused} listed in {type(self).__name__} are never started by "
                f"the model (the model starts {list(placements)}). Make the strategy "
                "list exactly the blocks the model uses: check that the number of layers "
                "per IPU matches the model, and the block ids given to poptorch.BeginBlock "
                "/ poptorch.Block.")
        return placements


#: The base class of every execution strategy (PopTorch's ``_IExecutionStrategy``).
STRATEGY_BASE = _IExecutionStrategy


class PipelinedExecution(_IExecutionStrategy):
    """Pipelined execution over several IPUs (the default strategy).

    Args:
        *args: either a single :class:`poptorch.AutoStage` (default
            ``AutoStage.SameAsIpu``), or a sequence where each element is a
            :class:`Stage`, a block id (one-block stage) or an iterable of block
            ids; the position is the stage id.

    With no explicit stages the ``AutoStage`` policy derives stage ids at capture
    time (``SameAsIpu``: stage = the block's ``ipu_id``; ``AutoIncrement``: each new
    block gets the next stage id). Backend value ``execution_mode = 0``.

    Raises:
        AssertionError: "<block> associated with more than one stage" when a block
            is listed twice; an invalid element. Same as PopTorch.
    """

    _execution_mode = 0

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], enums.AutoStage):
            super().__init__([], args[0])
            return
        stages = []
        for arg in args:
            if isinstance(arg, enums.AutoStage):
                raise AssertionError("An AutoStage must be the only argument of "
                                     f"{type(self).__name__}")
            stages.append(_to_stage(arg))
        super().__init__(stages, enums.AutoStage.SameAsIpu)

    def __repr__(self) -> str:
        if self._stages:
            return f"{type(self).__name__}(" + ", ".join(map(repr, self._stages)) + ")"
        return f"{type(self).__name__}(AutoStage.{self._auto_stage.name})"


class ShardedExecution(PipelinedExecution):
    """Sharded execution: same arguments as :class:`PipelinedExecution`, but the
    stages run one after another with no pipelining. Backend value
    ``execution_mode = 1``."""

    _execution_mode = 1


def _to_phase(arg) -> Phase:
    if isinstance(arg, Phase):
        return arg
    if isinstance(arg, (list, tuple)):
        return Phase(*arg)
    return Phase(arg)


class _IPhasedExecution(_IExecutionStrategy):
    """Common base of :class:`SerialPhasedExecution` and
    :class:`ParallelPhasedExecution`."""

    _execution_mode = 2
    _serial = True

    def __init__(self, *phases):
        if not phases:
            raise AssertionError("There is currently no AutoStage for PhasedExecution, "
                                 "please explicitly specify the phases")
        self._phases: List[Phase] = [_to_phase(p) for p in phases]
        stages = []
        for phase_id, phase in enumerate(self._phases):
            for stage in phase.stages:
                stage._phase_id = phase_id
                stages.append(stage)
        super().__init__(stages, enums.AutoStage.SameAsIpu)
        self._separate_backward_phase = False
        self._tensors_liveness = enums.Liveness.AlwaysLive

    def phase(self, phase: int) -> Phase:
        """The :class:`Phase` at index ``phase``.

        Raises:
            AssertionError: unless ``phase`` is a non-negative int.
            poptorch.Error: ``phase`` is beyond the last phase.
        """
        if not isinstance(phase, int) or phase < 0:
            raise AssertionError("Phases are identified by non-negative integers, "
                                 f"got {phase!r}")
        if phase >= len(self._phases):
            raise py_error(f"Phase {phase} does not exist: {type(self).__name__} has "
                           f"{len(self._phases)} phase(s), numbered from 0. Pass one "
                           "poptorch.Phase per phase the model needs.")
        return self._phases[phase]

    def useSeparateBackwardPhase(self, use: bool = True):
        """Start the backward pass in a fresh phase (backward phase of forward phase
        ``p`` becomes ``2P - p`` instead of ``2(P-1) - p``). Returns self.
        ``AssertionError`` if ``use`` is not a bool."""
        if not isinstance(use, bool):
            raise AssertionError("useSeparateBackwardPhase: use must be a bool")
        self._separate_backward_phase = use
        return self

    def backendOptions(self) -> Dict[str, Any]:
        """``execution_mode = 2``, ``separate_backward_phase``, ``tensors_liveness``
        (int) and ``serial_phases_execution`` (docs/api-sections.md options §5)."""
        return {
            "execution_mode": self._execution_mode,
            "separate_backward_phase": self._separate_backward_phase,
            "tensors_liveness": int(self._tensors_liveness),
            "serial_phases_execution": self._serial,
        }

    # -- capture-time helpers ------------------------------------------------
    def _phaseId(self, user_id) -> int:
        """The forward phase of block ``user_id`` (``AssertionError`` if unknown)."""
        self._stageId(user_id, None)
        return self._block_map[user_id]._phase_id

    def _phaseOf(self, user_id) -> int:
        return self._phaseId(user_id)

    def _backwardPhase(self, phase: int) -> int:
        """Backward phase mirroring forward ``phase`` (docs/semantics.md S-65): ``2(P-1) - p`` by
        default, ``2P - p`` with :meth:`useSeparateBackwardPhase` (liveness-mode
        shifts are not applied here)."""
        num_phases = len(self._phases)
        if self._separate_backward_phase:
            return 2 * num_phases - phase
        return 2 * (num_phases - 1) - phase

    def __repr__(self) -> str:
        return f"{type(self).__name__}(" + ", ".join(map(repr, self._phases)) + ")"


class SerialPhasedExecution(_IPhasedExecution):
    """Phased execution where the phases run one after another on the same IPUs.

    Args:
        *phases: each a :class:`Phase`, a list of :class:`Stage`, a list of block
            ids (one stage), or a single item (treated as a one-element list).

    Backend values: ``execution_mode = 2``, ``separate_backward_phase``,
    ``tensors_liveness``, ``serial_phases_execution = True``.

    Raises:
        AssertionError: no phase given ("There is currently no AutoStage for
            PhasedExecution, please explicitly specify the phases"); a block in
            several stages. Same as PopTorch.
    """

    _serial = True

    def setTensorsLiveness(self, liveness: enums.Liveness):
        """Set the liveness of tensors between phases. Returns self.
        ``AssertionError`` if ``liveness`` is not a :class:`poptorch.Liveness`."""
        if not isinstance(liveness, enums.Liveness):
            raise AssertionError("liveness must be a poptorch.Liveness, got "
                                 f"{type(liveness)}")
        self._tensors_liveness = liveness
        return self


class ParallelPhasedExecution(_IPhasedExecution):
    """Phased execution where consecutive phases run in parallel (even phases on
    even IPUs, odd phases on odd IPUs, docs/semantics.md S-65). Same arguments and errors as
    :class:`SerialPhasedExecution`; backend ``serial_phases_execution = False``."""

    _serial = False

    def sendTensorsOffChipAfterFwd(self, off_chip: bool = True):
        """Liveness ``OffChipAfterFwd`` (``True``) or ``AlwaysLive`` (``False``).
        Returns self. ``AssertionError`` if ``off_chip`` is not a bool."""
        if not isinstance(off_chip, bool):
            raise AssertionError("sendTensorsOffChipAfterFwd: off_chip must be a bool")
        self._tensors_liveness = (enums.Liveness.OffChipAfterFwd if off_chip
                                  else enums.Liveness.AlwaysLive)
        return self


def _iter_begin_block_modules(module: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of every sub-module annotated with BeginBlock."""
    for name, m in module.named_modules():
        if _begin_block_hooks(m):
            yield name, m
