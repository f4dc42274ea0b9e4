"""Session options of the compiler and runtime (our PopART ``SessionOptions``).

``poptorch`` hands the compiler the flat dictionary built by ``Options.toDict()``;
:func:`SessionOptions.from_dict` validates the backend keys exactly as PopTorch's
backend does (docs/api-sections.md options §4.6: "Unknown <category> option <key>", "Unknown value
type <t> for option <key>") and extracts what the compiler and runtime act on.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, TypeVar

from popart_compiler import config
from popart_compiler.enums import (CommGroupType, ConnectionType, ExecutionMode, Liveness,
                                   MeanReductionStrategy, OutputMode, ReductionType,
                                   VariableRetrievalMode)
from popart_compiler.errors import backend_error
from popart_compiler.logging import logger
from popart_compiler.popart_enums import OPTION_ENUMS
from popart_compiler.popart_options import PopartOptions

__all__ = ["SessionOptions", "Anchor", "ReplicaGrouping", "StrategySettings",
           "engine_options", "ipu_model_env"]

_E = TypeVar("_E", bound=enum.IntEnum)


def _member(cls: Type[_E], value: Any, what: str) -> _E:
    """``cls(value)`` or the backend's error naming ``what``."""
    try:
        return cls(int(value))
    except (TypeError, ValueError):
        raise backend_error(f"Invalid {what} {value!r}: pick one of "
                            f"{', '.join(m.name for m in cls)}.") from None


def _output_mode(value: Any) -> OutputMode:
    """``OutputMode(value)``, refusing ``Default`` (``poptorch`` resolves it when a model
    is wrapped) with the backend's error."""
    mode = _member(OutputMode, value, "output mode")
    if mode is OutputMode.Default:
        raise backend_error("Invalid output mode Default: it is resolved when a model is "
                            "wrapped; pick one of Final, EveryN, All, Sum.")
    return mode

_BOOL_KEYS = frozenset("""
enableExplicitIR enableInplaceAmbiguityChecking enableLoadAndOffloadRNGState
batchSerializationSettings.concatOnVirtualGraphChange
batchSerializationSettings.concatOnExecutionPhaseChange
batchSerializationSettings.concatOnPipelineStageChange strictOpVersions opxAliasChecking
opxModifyChecking dotOpNames exportPoplarComputationGraph exportPoplarVertexGraph
separateCallOpPdfs enableOutlining enableOutliningCopyCostPruning rearrangeAnchorsOnHost
rearrangeStreamsOnHost enablePrefetchDatastreams enableNonStableSoftmax
enableReplicatedGraphs enableGradientAccumulation instrumentWithHardwareCycleCounter
enablePipelining disableGradAccumulationTensorStreams disableOptimizerStateTensorStreams
compileEngine constantWeights enableEngineCaching enableMergeExchange
enableFloatingPointChecks enableStochasticRounding ensureFp32LossScaleTensor
explicitRecomputation enableExplicitMainLoops useHostCopyOps aliasZeroCopy delayVarUpdates
enableFullyConnectedPass enableSerializedMatmuls enableStableNorm decomposeGradSum
enableDistributedReplicatedGraphs groupHostSync automaticLossScalingSettings.enabled
enableSupportedDataTypeCasting groupNormStridedChannelGrouping
scheduleNonWeightUpdateGradientConsumersEarly
replicatedCollectivesSettings.prepareScheduleForMergingCollectives
replicatedCollectivesSettings.mergeAllReduceCollectives
""".split())

_UINT64_KEYS = frozenset("""
executionPhaseSettings.phases executionPhaseSettings.stages batchSerializationSettings.factor
firstDotOp finalDotOp numIOTiles mergeVarUpdateMemThreshold looseThresholdAtPeak
accumulationFactor swapLimitScheduler globalReplicationFactor globalReplicaOffset
defaultBufferingDepth defaultPrefetchBufferingDepth compilationProgressTotal
transitiveClosureOptimizationThreshold automaticLossScalingSettings.updatePeriod
""".split())

_FLOAT_KEYS = frozenset("""
outlineSequenceBreakCost outlineThreshold timeLimitScheduler
automaticLossScalingSettings.thresholdUpperCountProportion
automaticLossScalingSettings.binEdgeLocation
""".split())

_STRING_KEYS = frozenset("""
logDir cachePath partialsTypeMatMuls customCodeletCompileFlags
serializedPoprithmsShiftGraphsDir kahnTieBreaker saveInitializersToFile
""".split())

_SET_KEYS = frozenset("""
accumulateOuterFragmentSettings.excludedVirtualGraphs dotChecks hardwareInstrumentations
customCodelets updatableNamedBuffers
""".split())

_MAP_KEYS = frozenset("engineOptions reportOptions convolutionOptions matmulOptions "
                      "lstmOptions gclOptions".split())

#: Keys the Python layer consumes itself (never validated as backend options).
_PYTHON_KEYS = frozenset({"anchored_tensors", "patterns_level", "patterns",
                          "compilation_progress_bar_fn", "available_memory_proportion"})

#: Top-level / sub-group keys of ``poptorch.Options`` that travel through ``toDict()``.
_POPTORCH_KEYS = frozenset("""
device_iterations replication_factor input_group_size input_cgt broadcast_buffers
output_mode output_return_period random_seed auto_round_num_ipus log_dir max_repeat_logs
model_name use_model ipu_model_strict_memory connection_type sync_pattern ipu_id ipu_version
gradient_accumulation accumulation_and_replication_reduction_type
meanAccumulationAndReplicationReductionStrategy distributed_process_id
num_distributed_processes ipuof_configs pipeline_across_processes pipeline_stages
execution_mode separate_backward_phase
tensors_liveness serial_phases_execution location_activation location_weight
location_optimizer location_accumulator numIOTiles execution_device compiler_backend
""".split())


def _validate(key: str, value: Any) -> None:
    """Raise the backend's error for an unknown key or an unsupported value type."""
    if key in _PYTHON_KEYS or key in _POPTORCH_KEYS or key.startswith("location_"):
        return
    if isinstance(value, bool):
        category, known = "bool", key in _BOOL_KEYS
    elif isinstance(value, float):
        category, known = "floating point", key in _FLOAT_KEYS
    elif isinstance(value, int):
        category, known = "uint64", key in _UINT64_KEYS or key in OPTION_ENUMS
        if key in OPTION_ENUMS:
            enum_cls = OPTION_ENUMS[key]
            if not 0 <= int(value) < len(enum_cls):
                raise backend_error(f"Value for {enum_cls.__name__} out of range")
    elif isinstance(value, str):
        category, known = "string", key in _STRING_KEYS
    elif isinstance(value, (list, tuple, set)):
        category, known = "set / vector", key in _SET_KEYS
    elif isinstance(value, dict):
        category, known = "map", key in _MAP_KEYS
    else:
        raise backend_error(f"Unknown value type {type(value)} for option {key}")
    if not known:
        raise backend_error(f"Unknown {category} option {key}")


@dataclasses.dataclass
class Anchor:
    """An internal tensor to return after every run (docs/semantics.md S-15).

    Attributes:
        name: the graph tensor name (docs/semantics.md S-16), e.g. ``"Gradient___fc.bias"``.
        output_mode: its :class:`~popart_compiler.enums.OutputMode`.
        return_period: the ``EveryN`` period (1 otherwise).
        key: the user's short name (defaults to ``name``).
    """
    name: str
    output_mode: OutputMode
    return_period: int = 1
    key: str = ""

    def __post_init__(self):
        self.output_mode = _output_mode(self.output_mode)
        if not self.key:
            self.key = self.name


@dataclasses.dataclass
class ReplicaGrouping:
    """A weight that holds different values on different replica groups (docs/semantics.md S-27).

    Attributes:
        comm_group_type: ``All`` (one group), ``Consecutive`` (replica ``r`` in group
            ``r // shards``), ``Orthogonal`` (group ``r % (R / shards)``),
            ``NoGrouping`` (every replica its own group); an integer is converted.
        shards: replicas per group (ignored by All and NoGrouping).
        retrieval_mode: ``OnePerGroup`` (the host holds one value per group) or
            ``AllReplicas`` (one value per replica).
    """
    comm_group_type: CommGroupType
    shards: int
    retrieval_mode: VariableRetrievalMode = VariableRetrievalMode.OnePerGroup

    def __post_init__(self):
        # Out-of-range values are kept as given: validate() names them.
        if self.comm_group_type in set(CommGroupType):
            self.comm_group_type = CommGroupType(self.comm_group_type)
        if self.retrieval_mode in set(VariableRetrievalMode):
            self.retrieval_mode = VariableRetrievalMode(self.retrieval_mode)

    def validate(self, name: str, replicas: int) -> None:
        """Raise an ``Error`` if the grouping does not fit ``replicas`` replicas."""
        if not isinstance(self.comm_group_type, CommGroupType):
            raise backend_error(f"Invalid CommGroupType {self.comm_group_type} for "
                                f"per-replica weight {name}")
        if not isinstance(self.retrieval_mode, VariableRetrievalMode):
            raise backend_error(f"Invalid VariableRetrievalMode {self.retrieval_mode} "
                                f"for per-replica weight {name}")
        if self.comm_group_type in (CommGroupType.Consecutive, CommGroupType.Orthogonal):
            if self.shards < 1 or replicas % self.shards:
                raise backend_error(
                    f"Per-replica weight {name}: the replication factor ({replicas}) must "
                    f"be a multiple of the group size (shards={self.shards})")

    def num_groups(self, replicas: int) -> int:
        """Number of distinct values (groups) for ``replicas`` replicas."""
        if self.comm_group_type is CommGroupType.All:
            return 1
        if self.comm_group_type is CommGroupType.NoGrouping:
            return replicas
        return replicas // self.shards

    def groups(self, replicas: int) -> List[int]:
        """Group index of each replica."""
        n = self.num_groups(replicas)
        if self.comm_group_type is CommGroupType.All:
            return [0] * replicas
        if self.comm_group_type is CommGroupType.NoGrouping:
            return list(range(replicas))
        if self.comm_group_type is CommGroupType.Consecutive:
            return [r // self.shards for r in range(replicas)]
        return [r % n for r in range(replicas)]


@dataclasses.dataclass(frozen=True)
class StrategySettings:
    """The execution strategy as the compiler sees it (docs/api-sections.md api §9.7,
    docs/semantics.md S-63…S-65).

    Attributes:
        mode: pipelined, sharded or phased.
        serial_phases: phased execution runs phases one after another
            (``SerialPhasedExecution``) rather than in parallel.
        liveness: where tensors live between phases.
        separate_backward_phase: the backward pass starts in a fresh phase.
    """
    mode: ExecutionMode = ExecutionMode.Pipelined
    serial_phases: bool = True
    liveness: Liveness = Liveness.AlwaysLive
    separate_backward_phase: bool = False

    def __post_init__(self):
        object.__setattr__(self, "mode", _member(ExecutionMode, self.mode, "execution mode"))
        object.__setattr__(self, "liveness", _member(Liveness, self.liveness, "liveness"))

    @classmethod
    def from_raw(cls, raw: Dict) -> "StrategySettings":
        """Read the strategy from ``poptorch.Options().toDict()`` values."""
        return cls(_member(ExecutionMode, raw.get("execution_mode", 0), "execution mode"),
                   bool(raw.get("serial_phases_execution", True)),
                   _member(Liveness, raw.get("tensors_liveness", 0), "liveness"),
                   bool(raw.get("separate_backward_phase", False)))


#: The enum-valued fields of :class:`SessionOptions` (``output_mode``: :func:`_output_mode`).
_ENUM_FIELDS = {"input_group_type": CommGroupType, "reduction_type": ReductionType,
                "mean_reduction_strategy": MeanReductionStrategy,
                "connection_type": ConnectionType}


@dataclasses.dataclass
class SessionOptions:
    """What the compiler and runtime act on. Defaults are PopTorch's.

    Attributes:
        device_iterations: ``D``, device iterations per run (docs/semantics.md S-10).
        replication_factor: ``R``, local replicas.
        input_group_size: ``g``, replicas sharing one input stream (docs/semantics.md S-26).
        input_group_type: ``CommGroupType`` of the input grouping (``Consecutive`` or
            ``Orthogonal``).
        gradient_accumulation: ``A``, micro-batches per weight update (1 for inference).
        output_mode: ``OutputMode`` of the user outputs.
        output_return_period: the ``EveryN`` period.
        reduction_type: ``Sum`` or ``Mean`` (docs/semantics.md S-41).
        mean_reduction_strategy: ``Running``, ``Post`` or ``PostAndLoss``.
        broadcast_buffers: docs/semantics.md S-36.
        random_seed: seed of the device RNG, or ``None`` for an arbitrary one.
        synthetic_data: feed random inputs, return zero outputs (docs/semantics.md S-84).
        fp_exceptions: raise on non-finite results (docs/semantics.md S-46).
        auto_loss_scaling: automatic loss scaling (docs/semantics.md S-57), with its ``als_*``
            settings (``automaticLossScalingSettings.updatePeriod`` default 1,
            ``.thresholdUpperCountProportion`` default 1e-7, ``.binEdgeLocation`` default 0.125).
        replica_groupings: parameter name → :class:`ReplicaGrouping` (docs/semantics.md S-27).
        anchors: internal tensors returned after each run.
        num_processes: processes of a distributed run (docs/semantics.md S-28); the global
            replication factor is ``num_processes × replication_factor``.
        process_id: this process's index; it owns global replicas
            ``[process_id × R, (process_id + 1) × R)``.
        pipeline_across_processes: each merged pipeline stage runs in its own process
            (``Options.Distributed.pipelineAcrossProcesses``,
            :mod:`popart_compiler.runtime.pipeline`); ``num_processes`` and
            ``process_id`` are then those of the whole run, and a session replaces
            them by the pipeline replicas' count and index.
        pipeline_stages: processes per pipeline replica declared by the user (0: all
            the processes form one pipeline).
        device: ``"cpu"`` or ``"cuda"``: where the IPU Model's kernels run.
        backend: ``"eager"`` (FX graph run with PyTorch eager kernels),
            ``"inductor"`` (TorchInductor's ``compile_fx``, see
            :mod:`popart_compiler.backends.inductor`) or ``"auto"`` (eager, then the
            faster of the two: :mod:`popart_compiler.backends.auto`).
        ipu_model_version: ``"ipu1"``, ``"ipu2"`` or ``"ipu21"``.
        use_ipu_model: whether the IPU Model was selected (see ``IpuModel``).
        small_ipu_model: the 4-tile IPU Model of ``POPTORCH_SMALL_IPU_MODEL``.
        strict_memory: a program that does not fit in the IPU Model's memory fails
            to compile (``Options.ipuModelStrictMemory``, else
            ``POPTORCH_IPU_MODEL_STRICT_MEMORY``); otherwise it is reported and runs.
        connection_type: ``Always``, ``OnDemand`` or ``Never``.
        strategy: the execution strategy (pipelined, sharded, phased).
        popart: the PopART options the IPU Model's estimate and PopTorch's implicit
            defaults act on (:class:`~popart_compiler.popart_options.PopartOptions`,
            read from ``raw`` once by :meth:`from_dict`).
        raw: the validated option dictionary (engine options, the profile report).
    """
    device_iterations: int = 1
    replication_factor: int = 1
    input_group_size: int = 1
    input_group_type: CommGroupType = CommGroupType.Consecutive
    gradient_accumulation: int = 1
    output_mode: OutputMode = OutputMode.All
    output_return_period: int = 1
    reduction_type: ReductionType = ReductionType.Mean
    mean_reduction_strategy: MeanReductionStrategy = MeanReductionStrategy.Post
    broadcast_buffers: bool = True
    random_seed: Optional[int] = None
    synthetic_data: bool = False
    fp_exceptions: bool = False
    auto_loss_scaling: bool = False
    als_update_period: int = 1
    als_threshold: float = 1e-7
    als_bin_edge: float = 0.125
    replica_groupings: Dict[str, ReplicaGrouping] = dataclasses.field(default_factory=dict)
    anchors: List[Anchor] = dataclasses.field(default_factory=list)
    num_processes: int = 1
    process_id: int = 0
    pipeline_across_processes: bool = False
    pipeline_stages: int = 0
    device: str = "cpu"
    backend: str = "eager"
    ipu_model_version: str = "ipu2"
    use_ipu_model: bool = True
    small_ipu_model: bool = False
    strict_memory: bool = False
    connection_type: ConnectionType = ConnectionType.Always
    strategy: StrategySettings = dataclasses.field(default_factory=StrategySettings)
    progress_callback: Optional[Callable[[int, int], None]] = None
    popart: PopartOptions = dataclasses.field(default_factory=PopartOptions)
    raw: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        """Integer values of the enum fields (as ``poptorch`` passes them) become the
        compiler's enums."""
        for name, cls in _ENUM_FIELDS.items():
            setattr(self, name, _member(cls, getattr(self, name), name.replace("_", " ")))
        self.output_mode = _output_mode(self.output_mode)

    @property
    def backend_key(self) -> str:
        """``"<device>/<backend>"``, e.g. ``"cpu/eager"``: the part of an
        executable-cache key that names the backend (an executable compiled for one
        backend is never loaded for another)."""
        return f"{self.device}/{self.backend}"

    @property
    def input_groups(self) -> int:
        """``G = R / g``: distinct input streams across replicas."""
        return self.replication_factor // max(1, self.input_group_size)

    @property
    def global_replicas(self) -> int:
        """``R × num_processes``: replicas of all processes (docs/semantics.md S-28)."""
        return self.replication_factor * max(1, self.num_processes)

    @property
    def replica_offset(self) -> int:
        """Global index of this process's first replica."""
        return self.process_id * self.replication_factor

    @property
    def batch_factor(self) -> int:
        """``N = D × G × A``: combined batch / micro-batch (docs/semantics.md S-11)."""
        return self.device_iterations * self.input_groups * self.gradient_accumulation

    @property
    def engine_options(self) -> Dict[str, str]:
        """Poplar engine options: ``engineOptions`` merged with
        ``POPLAR_ENGINE_OPTIONS`` (the environment wins, docs/api-sections.md options §3 / §8)."""
        return engine_options(self.raw.get("engineOptions"))

    def profile_dir(self, training: bool) -> Optional[str]:
        """Where the profile report goes, ``<autoReport.directory>/<model name>``
        (docs/semantics.md S-85; the name defaults to ``"training"`` / ``"inference"``), or ``None``
        unless the engine option ``autoReport.all`` is ``"true"``.

        Raises:
            Error: the model name is not a plain name (a path separator, ``.`` or
                ``..``), so the report would land outside ``autoReport.directory``.
        """
        engine = self.engine_options
        if str(engine.get("autoReport.all", "false")).lower() != "true":
            return None
        name = str(self.raw.get("model_name") or ("training" if training else "inference"))
        if name in (".", "..") or any(sep and sep in name for sep in (os.sep, os.altsep)):
            raise backend_error(
                f"Options.modelName({name!r}) names the profile report's folder inside "
                "the report directory: give a plain name without path separators.")
        return os.path.join(str(engine.get("autoReport.directory", ".")), name)

    @classmethod
    def from_dict(cls, values: Dict[str, Any], anchors: Optional[List[Anchor]] = None,
                  **overrides) -> "SessionOptions":
        """Validate ``values`` (the output of ``poptorch.Options.toDict()``) and build
        the session options.

        Raises:
            Error: unknown backend option, unsupported value type or an enum value out
                of range (docs/api-sections.md options §4.6), or an invalid
                ``POPTORCH_IPU_MODEL_VERSION``.
        """
        for key, value in values.items():
            _validate(key, value)
            if key in _PYTHON_KEYS or callable(value):
                continue
            logger.debug("poptorch.Options set %s to value %s", key, _render(value))
        get = values.get
        version = config.ipu_model_version()
        if version not in ("ipu1", "ipu2", "ipu21"):
            raise backend_error("Invalid IPU model version. Valid versions: ipu1, ipu2, ipu21.")
        if int(get("connection_type", 0)) == ConnectionType.Never \
                and get("ipu_version") is not None:
            # useOfflineIpuTarget(ipu_version): 1 Mk1, 2 Mk2, 21 Bow
            # (docs/api-sections.md options §3)
            version = {1: "ipu1", 2: "ipu2", 21: "ipu21"}.get(int(get("ipu_version")),
                                                             version)
        opts = cls(
            device_iterations=int(get("device_iterations", 1)),
            replication_factor=int(get("replication_factor", 1)),
            input_group_size=int(get("input_group_size", 1)),
            input_group_type=_member(CommGroupType, get("input_cgt", 1), "input group type"),
            gradient_accumulation=int(get("gradient_accumulation", 1)),
            output_mode=_output_mode(get("output_mode", 2)),
            output_return_period=int(get("output_return_period", 1)),
            reduction_type=_member(ReductionType, get(
                "accumulation_and_replication_reduction_type", 1), "reduction type"),
            mean_reduction_strategy=_member(MeanReductionStrategy, get(
                "meanAccumulationAndReplicationReductionStrategy", 1),
                "mean reduction strategy"),
            broadcast_buffers=bool(get("broadcast_buffers", True)),
            random_seed=get("random_seed"),
            synthetic_data=int(get("syntheticDataMode", 0)) != 0,
            fp_exceptions=bool(get("enableFloatingPointChecks", False)),
            auto_loss_scaling=bool(get("automaticLossScalingSettings.enabled", False)),
            als_update_period=int(get("automaticLossScalingSettings.updatePeriod", 1)),
            als_threshold=float(get(
                "automaticLossScalingSettings.thresholdUpperCountProportion", 1e-7)),
            als_bin_edge=float(get("automaticLossScalingSettings.binEdgeLocation", 0.125)),
            anchors=list(anchors or []),
            num_processes=int(get("num_distributed_processes", 1)),
            process_id=int(get("distributed_process_id", 0)),
            pipeline_across_processes=bool(get("pipeline_across_processes", False)),
            pipeline_stages=int(get("pipeline_stages", 0) or 0),
            ipu_model_version=version,
            connection_type=_member(ConnectionType, get("connection_type", 0),
                                    "connection type"),
            strategy=StrategySettings.from_raw(values),
            strict_memory=bool(get("ipu_model_strict_memory", config.strict_memory())),
            device=str(get("execution_device", "cpu")),
            backend=str(get("compiler_backend", "eager")),
            progress_callback=get("compilation_progress_bar_fn"),
            popart=PopartOptions.from_raw(values),
            raw=dict(values),
        )
        for k, v in overrides.items():
            setattr(opts, k, v)
        if opts.device not in ("cpu", "cuda") or \
                opts.backend not in ("eager", "inductor", "auto"):
            raise backend_error(f"Unknown backend {opts.backend_key}: the execution device "
                                "must be cpu or cuda and the compiler eager, inductor or "
                                "auto.")
        return opts


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def engine_options(configured: Optional[Dict[str, Any]] = None) -> Dict[str, str]:
    """``configured`` engine options overridden by the JSON of
    ``POPLAR_ENGINE_OPTIONS``.

    Raises:
        Error: ``POPLAR_ENGINE_OPTIONS`` is not a JSON object.
    """
    merged = {str(k): str(v) for k, v in (configured or {}).items()}
    text = config.engine_options_text()
    if text:
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise backend_error(f"POPLAR_ENGINE_OPTIONS is not valid JSON ({exc}): give an "
                                "object such as '{\"autoReport.all\":\"true\"}'") from None
        if not isinstance(values, dict):
            raise backend_error("POPLAR_ENGINE_OPTIONS must be a JSON object such as "
                                "'{\"autoReport.all\":\"true\"}'")
        merged.update({str(k): str(v) for k, v in values.items()})
    return merged


def ipu_model_env() -> Tuple[bool, bool]:
    """``(POPTORCH_IPU_MODEL != 0, POPTORCH_SMALL_IPU_MODEL != 0)`` with integer parsing."""
    return config.ipu_model_flags()
