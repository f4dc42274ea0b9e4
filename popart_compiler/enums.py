"""The compiler's enumerations (PopART's own: ``AnchorReturnTypeId``, ``ReductionType``,
``CommGroupType``, ...).

``poptorch`` hands options over as the integer values of its public enums
(``poptorch.OutputMode.EveryN`` is 1); :meth:`SessionOptions.from_dict
<popart_compiler.session_options.SessionOptions.from_dict>` turns them into these
classes once, and the compiler and runtime compare by name (``mode is
OutputMode.EveryN``), never by number. The values equal PopTorch's, so an ``IntEnum``
member still compares equal to the integer ``poptorch`` sent.
"""
from __future__ import annotations

import enum

__all__ = ["OutputMode", "ReductionType", "MeanReductionStrategy", "CommGroupType",
           "VariableRetrievalMode", "ConnectionType", "ExecutionMode", "Liveness"]


class OutputMode(enum.IntEnum):
    """What an output or anchor returns for the ``D × A`` micro-batches of a run
    (PopART's ``AnchorReturnTypeId``; spec S-12)."""
    Final = 0
    EveryN = 1
    All = 2
    Sum = 3


class ReductionType(enum.IntEnum):
    """Reduction of gradients over accumulation steps and replicas (S-41)."""
    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(enum.IntEnum):
    """When the ``Mean`` reduction divides (S-41)."""
    Running = 0
    Post = 1
    PostAndLoss = 2


class CommGroupType(enum.IntEnum):
    """How replicas are grouped (input groups S-26, replica-grouped weights S-27)."""
    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class VariableRetrievalMode(enum.IntEnum):
    """How the host holds a replica-grouped weight (S-27)."""
    OnePerGroup = 0
    AllReplicas = 2


class ConnectionType(enum.IntEnum):
    """When the device is attached (S-80)."""
    Always = 0
    OnDemand = 1
    Never = 2


class ExecutionMode(enum.IntEnum):
    """PopART's execution mode (the ``execution_mode`` option, options §5)."""
    Pipelined = 0
    Sharded = 1
    Phased = 2


class Liveness(enum.IntEnum):
    """Where tensors live between the phases of phased execution (S-65)."""
    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3
