"""PopART's enums, by PopART's names and values, for the ``popart`` module.

PopTorch programs pass PopART enum values to ``Options._Popart.set`` as integers
(``int(popart.SubgraphCopyingStrategy.JustInTime)``); the compiler validates the
enum-valued backend options against these classes (:data:`OPTION_ENUMS`), so a value
accepted by PopART is accepted here and an out-of-range one is refused by name.
Values follow PopART 3.x's ``sessionoptions.hpp`` (the ``N`` count members are left
out: ``len(cls)`` is the count). Where PopART and PopTorch share a concept the class is
:mod:`popart_compiler.enums`' (one definition): ``DeviceConnectionType`` is
``ConnectionType``, ``CommGroupType.Ungrouped`` is ``CommGroupType.NoGrouping``, and
``VariableRetrievalMode`` has PopTorch's two members (PopART's ``AllReduceReplicas`` is
not offered).
"""
from __future__ import annotations

import enum
from typing import Dict, Type

from popart_compiler.enums import (CommGroupType, ConnectionType, MeanReductionStrategy,
                                   ReductionType, SyncPattern, VariableRetrievalMode)

__all__ = ["ENUMS", "OPTION_ENUMS"]


class AccumulateOuterFragmentSchedule(enum.IntEnum):
    Scheduler = 0
    Serial = 1
    OverlapCycleOptimized = 2
    OverlapMemoryOptimized = 3


class AutodiffStitchStrategy(enum.IntEnum):
    RecomputeMinimal = 0
    RecomputeAllNonInputs = 1
    AddFwdOutputs = 2
    SafeAddFwdOutputs = 3


class BatchSerializationBatchSchedule(enum.IntEnum):
    Scheduler = 0
    Isomorphic = 1
    OverlapOnIo = 2
    OverlapOnCompute = 3


class BatchSerializationMethod(enum.IntEnum):
    UnrollDynamic = 0
    UnrollStatic = 1
    Loop = 2


class BatchSerializationTransformContext(enum.IntEnum):
    Fwd = 0
    Bwd = 1


class ExecutionPhaseIOSchedule(enum.IntEnum):
    Preload = 0
    OnDemand = 1


class ExecutionPhaseSchedule(enum.IntEnum):
    Interleaving = 0
    Batch = 1
    BatchClusteredIO = 2


class GradientTensorTrackingMethod(enum.IntEnum):
    AllNonViewChangingGradientTensors = 0
    ConvAndMatmulGradients = 1
    GradientsOfUserSpecifiedTensors = 2


class Instrumentation(enum.IntEnum):
    Outer = 0
    Inner = 1


class IrSerializationFormat(enum.IntEnum):
    JSON = 0


# Their first member is PopART's ``None`` (reached as ``getattr(cls, "None")``).
MergeVarUpdateType = enum.IntEnum(
    "MergeVarUpdateType", [("None", 0), ("All", 1), ("AutoLoose", 2), ("AutoTight", 3)],
    module=__name__)
RecomputationType = enum.IntEnum(
    "RecomputationType", [("None", 0), ("Standard", 1), ("NormOnly", 2), ("Pipeline", 3),
                          ("RecomputeAll", 4)], module=__name__)


class SubgraphCopyingStrategy(enum.IntEnum):
    OnEnterAndExit = 0
    JustInTime = 1


class SyntheticDataMode(enum.IntEnum):
    Off = 0
    Zeros = 1
    RandomNormal = 2
    RandomUniform = 3


class VirtualGraphMode(enum.IntEnum):
    Off = 0
    Manual = 1
    Auto = 2
    ExecutionPhases = 3


class TensorStorage(enum.IntEnum):
    OnChip = 0
    OffChip = 1


class TileSet(enum.IntEnum):
    Compute = 0
    IO = 1


class ReplicatedTensorSharding(enum.IntEnum):
    Off = 0
    On = 1


class PatternsLevel(enum.IntEnum):
    NoPatterns = 0
    Minimal = 1
    Default = 2
    All = 3


#: Every PopART enum the ``popart`` module provides, by name.
ENUMS: Dict[str, Type[enum.IntEnum]] = {
    cls.__name__: cls for cls in (
        AccumulateOuterFragmentSchedule, AutodiffStitchStrategy,
        BatchSerializationBatchSchedule, BatchSerializationMethod,
        BatchSerializationTransformContext, ExecutionPhaseIOSchedule,
        ExecutionPhaseSchedule, GradientTensorTrackingMethod, Instrumentation,
        IrSerializationFormat, MergeVarUpdateType, RecomputationType,
        SubgraphCopyingStrategy, SyntheticDataMode, VirtualGraphMode,
        SyncPattern, TensorStorage, TileSet, ReplicatedTensorSharding, CommGroupType,
        VariableRetrievalMode, PatternsLevel, ReductionType, MeanReductionStrategy)}
ENUMS["DeviceConnectionType"] = ConnectionType

#: The enum-valued backend options (``Options._Popart.set`` keys) and their enum.
OPTION_ENUMS: Dict[str, Type[enum.IntEnum]] = {
    "accumulateOuterFragmentSettings.schedule": AccumulateOuterFragmentSchedule,
    "autodiffSettings.stitchStrategy": AutodiffStitchStrategy,
    "batchSerializationSettings.transformContext": BatchSerializationTransformContext,
    "batchSerializationSettings.method": BatchSerializationMethod,
    "batchSerializationSettings.batchSchedule": BatchSerializationBatchSchedule,
    "autoRecomputation": RecomputationType,
    "mergeVarUpdate": MergeVarUpdateType,
    "virtualGraphMode": VirtualGraphMode,
    "syntheticDataMode": SyntheticDataMode,
    "subgraphCopyingStrategy": SubgraphCopyingStrategy,
    "accumulationAndReplicationReductionType": ReductionType,
    "meanAccumulationAndReplicationReductionStrategy": MeanReductionStrategy,
    "automaticLossScalingSettings.gradientTensorTrackingMethod":
        GradientTensorTrackingMethod,
}
