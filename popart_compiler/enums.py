"""Every option enumeration, defined once: PopTorch's (re-exported by
:mod:`poptorch.enums` under the same names) and the compiler's own ``ExecutionMode``.

``poptorch`` hands options over as the integer values of these enums
(``OutputMode.EveryN`` is 1); :meth:`SessionOptions.from_dict
<popart_compiler.session_options.SessionOptions.from_dict>` turns them into members
once, and the compiler and runtime compare by name (``mode is OutputMode.EveryN``),
never by number. Names and values are PopTorch 3.4's (``tests/popart_compiler/
test_enums.py`` checks them), so a member compares equal to the integer a PopTorch
program passes. PopART's enums that PopTorch has no name for are in
:mod:`popart_compiler.popart_enums`, which reuses these classes where the two share a
concept (``ReductionType``, ``CommGroupType``, ``SyncPattern``, ...).
"""
from __future__ import annotations

import enum

__all__ = [
    "OutputMode", "ConnectionType", "ReductionType", "MeanReductionStrategy",
    "SyncPattern", "DataLoaderMode", "SharingStrategy", "HalfFloatCastingBehavior",
    "MatMulSerializationMode", "Liveness", "OverlapMode", "AutoStage",
    "MultiConvPlanType", "CommGroupType", "VariableRetrievalMode", "ExecutionMode",
]


class OutputMode(enum.IntEnum):
    """What an output or anchor returns for the ``D × A`` micro-batches of a call
    (PopART's ``AnchorReturnTypeId``; docs/semantics.md S-12). ``Default`` is ``poptorch.Options``'
    placeholder, resolved when a model is wrapped (``Final`` for training, ``All`` for
    inference) before the options reach the compiler, which refuses it."""
    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


class ConnectionType(enum.IntEnum):
    """When the device is attached (docs/semantics.md S-80); PopART's ``DeviceConnectionType``."""
    Always = 0
    OnDemand = 1
    Never = 2


class ReductionType(enum.IntEnum):
    """Reduction of gradients over accumulation steps and replicas (docs/semantics.md S-41)."""
    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(enum.IntEnum):
    """When the ``Mean`` reduction divides (docs/semantics.md S-41)."""
    Running = 0
    Post = 1
    PostAndLoss = 2


class SyncPattern(enum.IntEnum):
    """Host/device sync pattern (hardware only; stored, no effect on the IPU Model)."""
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class DataLoaderMode(enum.IntEnum):
    """How :class:`poptorch.DataLoader` loads data (docs/api-sections.md api §7)."""
    Sync = 0
    Async = 1
    AsyncRebatched = 2


class SharingStrategy(enum.IntEnum):
    """How the dataset reaches the asynchronous worker (docs/api-sections.md api §7.2)."""
    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3


class HalfFloatCastingBehavior(enum.IntEnum):
    """Deprecated; accepted and ignored."""
    FloatDowncastToHalf = 0
    HalfUpcastToFloat = 1
    Default = 2


class MatMulSerializationMode(enum.Enum):
    """Dimension along which :func:`poptorch.serializedMatMul` splits the product."""
    InputChannels = "input_channels"
    ReducingDim = "reducing_dim"
    OutputChannels = "output_channels"
    Disabled = "none"


class Liveness(enum.IntEnum):
    """Where tensors live between the phases of phased execution (docs/semantics.md S-65)."""
    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class OverlapMode(enum.Enum):
    """Host I/O / compute overlap of an input or output (docs/semantics.md S-66)."""
    NoOverlap = "no_overlap"
    OverlapAccumulationLoop = "overlap_accumulation_loop"
    OverlapDeviceIterationLoop = "overlap_device_iteration_loop"


class AutoStage(enum.IntEnum):
    """How pipeline stage ids are derived when none are given (docs/api-sections.md api §9.7)."""
    SameAsIpu = 0
    AutoIncrement = 1


class MultiConvPlanType(enum.IntEnum):
    """Planning of a multi-convolution."""
    Parallel = 0
    Serial = 1


class CommGroupType(enum.IntEnum):
    """How replicas are grouped (input groups docs/semantics.md S-26, replica-grouped weights
    docs/semantics.md S-27).

    ``Ungrouped`` is PopART's name for ``NoGrouping`` (an alias: the same member)."""
    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3
    Ungrouped = 3


class VariableRetrievalMode(enum.IntEnum):
    """How the host holds a replica-grouped weight (docs/semantics.md S-27). Value 1 is PopART's
    ``AllReduceReplicas``, which PopTorch does not offer."""
    OnePerGroup = 0
    AllReplicas = 2


class ExecutionMode(enum.IntEnum):
    """The execution strategy's mode (the ``execution_mode`` option that
    ``poptorch.PipelinedExecution``, ``ShardedExecution`` and ``PhasedExecution``
    set, docs/api-sections.md options §5)."""
    Pipelined = 0
    Sharded = 1
    Phased = 2
