"""PopTorch enumerations (spec api §4). Integer enums compare equal to ints."""
import enum

__all__ = [
    "OutputMode", "ConnectionType", "ReductionType", "MeanReductionStrategy",
    "SyncPattern", "DataLoaderMode", "SharingStrategy", "HalfFloatCastingBehavior",
    "MatMulSerializationMode", "Liveness", "OverlapMode", "AutoStage",
    "MultiConvPlanType", "CommGroupType", "VariableRetrievalMode",
]


class OutputMode(enum.IntEnum):
    """What each output returns for the ``D × A`` micro-batches of a call (S-12)."""
    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


class ConnectionType(enum.IntEnum):
    """When the device is attached (S-80)."""
    Always = 0
    OnDemand = 1
    Never = 2


class ReductionType(enum.IntEnum):
    """Reduction of gradients over accumulation and replicas (S-41)."""
    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(enum.IntEnum):
    """When the ``Mean`` division happens (S-41)."""
    Running = 0
    Post = 1
    PostAndLoss = 2


class SyncPattern(enum.IntEnum):
    """Host/device sync pattern (hardware only; stored, no effect on the IPU Model)."""
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class DataLoaderMode(enum.IntEnum):
    """How :class:`poptorch.DataLoader` loads data (api §7)."""
    Sync = 0
    Async = 1
    AsyncRebatched = 2


class SharingStrategy(enum.IntEnum):
    """How the dataset reaches the asynchronous worker (api §7.2)."""
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
    """Tensor liveness between phases of phased execution."""
    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class OverlapMode(enum.Enum):
    """Host I/O / compute overlap of an input or output (S-66)."""
    NoOverlap = "no_overlap"
    OverlapAccumulationLoop = "overlap_accumulation_loop"
    OverlapDeviceIterationLoop = "overlap_device_iteration_loop"


class AutoStage(enum.IntEnum):
    """How pipeline stage ids are derived when none are given (api §9.7)."""
    SameAsIpu = 0
    AutoIncrement = 1


class MultiConvPlanType(enum.IntEnum):
    """Planning of a multi-convolution."""
    Parallel = 0
    Serial = 1


class CommGroupType(enum.IntEnum):
    """Replica grouping type (S-26, S-27)."""
    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class VariableRetrievalMode(enum.IntEnum):
    """How replica-grouped weights come back to the host (S-27)."""
    OnePerGroup = 0
    AllReplicas = 2
