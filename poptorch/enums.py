"""PopTorch's enumerations (docs/api-sections.md api §4), under PopTorch's names and values.

Each is defined once, in :mod:`popart_compiler.enums`, and re-exported here: the
member a program passes to ``poptorch.Options`` is the one the compiler compares
against. Integer enums compare equal to ints.
"""
from popart_compiler.enums import (AutoStage, CommGroupType, ConnectionType,
                                   DataLoaderMode, HalfFloatCastingBehavior, Liveness,
                                   MatMulSerializationMode, MeanReductionStrategy,
                                   MultiConvPlanType, OutputMode, OverlapMode,
                                   ReductionType, SharingStrategy, SyncPattern,
                                   VariableRetrievalMode)

__all__ = [
    "OutputMode", "ConnectionType", "ReductionType", "MeanReductionStrategy",
    "SyncPattern", "DataLoaderMode", "SharingStrategy", "HalfFloatCastingBehavior",
    "MatMulSerializationMode", "Liveness", "OverlapMode", "AutoStage",
    "MultiConvPlanType", "CommGroupType", "VariableRetrievalMode",
]
