"""The sub-groups of ``poptorch.Options`` (docs/api-sections.md options §4): ``_Popart``, ``Jit``,
``Training``, ``Precision``, ``TensorLocations`` (and :class:`TensorLocationSettings`),
``Distributed``. Behaviour follows PopTorch 3.x.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from poptorch import enums
from poptorch._options import environment as config
from poptorch._logging import logger
from poptorch._options.dict import (FROZEN_MESSAGE, OptionsDict, UnfrozenCopies, check_bool,
                                    check_int, check_type)

__all__ = ["TensorLocationSettings"]


class _PopartOptions(UnfrozenCopies):
    """Advanced backend options (``Options._Popart``, docs/api-sections.md options §4.6): a plain
    ``options`` dict accepting any key; keys are validated only at compile time.
    Default content: ``instrumentWithHardwareCycleCounter=False``,
    ``rearrangeAnchorsOnHost=False``. Behaviour follows PopTorch."""

    def __init__(self):
        object.__setattr__(self, "_is_frozen", False)
        object.__setattr__(self, "options", {})
        self.set("instrumentWithHardwareCycleCounter", False)
        self.set("rearrangeAnchorsOnHost", False)

    def _check_not_frozen(self) -> None:
        if self.__dict__.get("_is_frozen", False):
            raise AttributeError(FROZEN_MESSAGE)

    def _freeze(self) -> None:
        object.__setattr__(self, "_is_frozen", True)

    def _unfreeze(self) -> None:
        object.__setattr__(self, "_is_frozen", False)

    def __setattr__(self, name, value) -> None:
        self._check_not_frozen()
        object.__setattr__(self, name, value)

    def set(self, key: str, value: Any):
        """Store ``value`` (any type; checked at compile time) under ``key``.
        Returns self. ``AttributeError`` "Can't modify frozen Options" when frozen;
        ``AssertionError`` unless ``key`` is a str."""
        self._check_not_frozen()
        check_type("_Popart.set key", key, str)
        self.options[key] = value
        return self

    def setEngineOptions(self, engine_options: dict):
        """``set("engineOptions", engine_options)``. Returns self.
        ``AssertionError`` unless a dict."""
        check_type("setEngineOptions", engine_options, dict)
        return self.set("engineOptions", engine_options)

    def setPatterns(self, patterns: dict, level: int = 2):
        """Set the backend ``patterns`` dict and ``patterns_level``. Returns self.

        Raises:
            AssertionError: unless ``level`` is an int and ``patterns`` a dict.
        """
        if not isinstance(level, int):
            raise AssertionError("patterns level must be an int")
        if not isinstance(patterns, dict):
            raise AssertionError("patterns must be a dict of {pattern_name: enabled}")
        self.set("patterns_level", level)
        return self.set("patterns", patterns)

    def update(self, other: dict) -> dict:
        """Merge the options into ``other`` (``AssertionError`` "Can't merge
        dictionaries, they have some keys in common" on collision)."""
        if set(self.options).intersection(other):
            raise AssertionError("Can't merge dictionaries, they have some keys in common")
        other.update(self.options)
        return other

    def toDict(self) -> dict:
        """A (shallow) copy of the options."""
        return dict(self.options)

    def __repr__(self) -> str:
        return "_PopartOptions(" + ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + ")"


class _JitOptions(OptionsDict):
    """``Options.Jit`` (docs/api-sections.md options §4.5). Behaviour follows PopTorch."""

    def traceModel(self, trace_model: bool):
        """Deprecated: logs a warning. ``True`` → ``ValueError``
        "options.Jit.traceModel(True) is no longer supported"; ``False`` returns
        self. ``AssertionError`` unless a bool."""
        check_bool("Jit.traceModel", trace_model)
        logger.warning("options.Jit.traceModel is deprecated and will be removed in a "
                       "future release: the tracing frontend is no longer supported.")
        if trace_model:
            raise ValueError("options.Jit.traceModel(True) is no longer supported")
        return self


class _TrainingOptions(OptionsDict):
    """``Options.Training`` (docs/api-sections.md options §4.1). Behaviour follows PopTorch.

    Values: ``gradient_accumulation: int = 1``,
    ``accumulation_and_replication_reduction_type: ReductionType = Mean``,
    ``meanAccumulationAndReplicationReductionStrategy: MeanReductionStrategy = Post``.
    """

    _repr_excludes = ("_popart",)
    _int_ranges = {"gradient_accumulation": ("Training.gradientAccumulation", 1)}

    def __init__(self, popart_options: _PopartOptions):
        self._popart = popart_options
        super().__init__(
            gradient_accumulation=1,
            accumulation_and_replication_reduction_type=enums.ReductionType.Mean,
            meanAccumulationAndReplicationReductionStrategy=enums.MeanReductionStrategy.Post,
        )

    def gradientAccumulation(self, gradient_accumulation: int):
        """Micro-batches accumulated per weight update (``int`` ≥ 1, default 1, key
        ``gradient_accumulation``). Returns self. ``AssertionError`` on a non-int,
        ``ValueError`` below 1."""
        return self.set(gradient_accumulation=gradient_accumulation)

    def accumulationAndReplicationReductionType(self, reduction_type: enums.ReductionType):
        """Reduction of gradients over accumulation and replicas
        (``ReductionType.Sum`` or ``.Mean``, default ``Mean``, key
        ``accumulation_and_replication_reduction_type``). Returns self.

        Raises:
            ValueError: ``NoReduction`` or a non-enum value.
        """
        if not isinstance(reduction_type, enums.ReductionType) or reduction_type not in (
                enums.ReductionType.Sum, enums.ReductionType.Mean):
            raise ValueError("accumulationAndReplicationReductionType must be one of "
                             "poptorch.ReductionType.Sum or poptorch.ReductionType.Mean, "
                             f"got {reduction_type!r}")
        return self.set(accumulation_and_replication_reduction_type=reduction_type)

    def setMeanAccumulationAndReplicationReductionStrategy(
            self, mean_reduction_strategy: enums.MeanReductionStrategy):
        """When the ``Mean`` division happens (``MeanReductionStrategy``, default
        ``Post``, key ``meanAccumulationAndReplicationReductionStrategy``). Returns
        self. ``AssertionError`` if not a ``MeanReductionStrategy``."""
        return self.set(meanAccumulationAndReplicationReductionStrategy=mean_reduction_strategy)

    def setAutomaticLossScaling(self, enabled: bool):
        """Backend ``automaticLossScalingSettings.enabled``. Returns self.
        ``AssertionError`` unless a bool."""
        check_bool("Training.setAutomaticLossScaling", enabled)
        self._popart.set("automaticLossScalingSettings.enabled", enabled)
        return self

    def setConvolutionDithering(self, enabled: bool):
        """Backend ``convolutionOptions = {"enableConvDithering": enabled}``
        (replaces the whole dict; see ``Precision.setPartialsType``). Returns self.
        ``AssertionError`` unless a bool."""
        check_bool("Training.setConvolutionDithering", enabled)
        self._popart.set("convolutionOptions", {"enableConvDithering": enabled})
        return self


class _PrecisionOptions(OptionsDict):
    """``Options.Precision`` (docs/api-sections.md options §4.2): no values of its own, writes into
    ``_Popart``. Behaviour follows PopTorch."""

    _repr_excludes = ("_popart",)

    def __init__(self, popart_options: _PopartOptions):
        self._popart = popart_options
        super().__init__()

    def halfFloatCasting(self, half_float_casting):
        """Deprecated, no effect (upcasting to float is the only behaviour); logs a
        warning and returns self."""
        logger.warning("poptorch.Options.Precision.halfFloatCasting is deprecated and has "
                       "no effect: half values are now always upcast to float "
                       "(HalfUpcastToFloat is the only behaviour).")
        return self

    def runningStatisticsAlwaysFloat(self, value: bool):
        """Deprecated, no effect; logs a warning and returns self.
        ``ValueError`` if ``value`` is not a bool."""
        if not isinstance(value, bool):
            raise ValueError("runningStatisticsAlwaysFloat needs to be set to a bool")
        logger.warning("poptorch.Options.Precision.runningStatisticsAlwaysFloat is "
                       "deprecated and has no effect: running statistics follow the "
                       "type of the model.")
        return self

    def enableFloatingPointExceptions(self, enabled: bool):
        """Backend ``enableFloatingPointChecks`` (default off). Returns self.
        ``AssertionError`` "enableFloatingPointExceptions needs to be set to a
        bool"."""
        if not isinstance(enabled, bool):
            raise AssertionError("enableFloatingPointExceptions needs to be set to a bool")
        self._popart.set("enableFloatingPointChecks", enabled)
        return self

    def enableStochasticRounding(self, enabled: bool):
        """Backend ``enableStochasticRounding``. Returns self. ``AssertionError``
        unless a bool."""
        check_bool("Precision.enableStochasticRounding", enabled)
        self._popart.set("enableStochasticRounding", enabled)
        return self

    def setPartialsType(self, dtype: torch.dtype):
        """Backend ``partialsTypeMatMuls`` = ``"float"``/``"half"`` and
        ``convolutionOptions = {"partialsType": ...}`` (replaces the whole dict).
        Returns self.

        Raises:
            ValueError: unless ``dtype`` is ``torch.float``/``float32``/``half``/
                ``float16``.
        """
        if dtype in (torch.float, torch.float32):
            type_str = "float"
        elif dtype in (torch.half, torch.float16):
            type_str = "half"
        else:
            raise ValueError("parameter to setPartialsType should be either "
                             f"torch.float or torch.half, got {dtype!r}")
        self._popart.set("partialsTypeMatMuls", type_str)
        self._popart.set("convolutionOptions", {"partialsType": type_str})
        return self


class TensorLocationSettings(OptionsDict):
    """Settings of one tensor location (docs/api-sections.md options §4.3), passed to
    ``Options.TensorLocations.set<Kind>Location``. Chainable; performance hints
    only on the IPU Model. Behaviour follows PopTorch."""

    def minElementsForOffChip(self, min_elements: int):
        """Key ``minElementsForOffChip``. Returns self. ``AssertionError`` unless int,
        ``ValueError`` if negative."""
        if not isinstance(min_elements, int) or isinstance(min_elements, bool):
            raise AssertionError("minElementsForOffChip must be an integer")
        check_int("minElementsForOffChip", min_elements, 0)
        return self.createOrSet(minElementsForOffChip=min_elements)

    def minElementsForReplicatedTensorSharding(self, min_elements: int):
        """Key ``minElementsForReplicatedTensorSharding``. Returns self.
        ``AssertionError`` unless int, ``ValueError`` if negative."""
        if not isinstance(min_elements, int) or isinstance(min_elements, bool):
            raise AssertionError("minElementsForReplicatedTensorSharding must be an integer")
        check_int("minElementsForReplicatedTensorSharding", min_elements, 0)
        return self.createOrSet(minElementsForReplicatedTensorSharding=min_elements)

    def useOnChipStorage(self, use: Optional[bool] = True):
        """Key ``onChip`` = 0/1; ``None`` deletes the key. Returns self.
        ``AssertionError`` unless bool or None."""
        if use is None:
            self.deleteIfExists("onChip")
            return self
        if not isinstance(use, bool):
            raise AssertionError("useOnChipStorage must be set to True, False or None")
        return self.createOrSet(onChip=int(use))

    def useReplicatedTensorSharding(self, use: bool = True):
        """Key ``useReplicatedTensorSharding`` = 0/1. Returns self.
        ``AssertionError`` unless bool."""
        if not isinstance(use, bool):
            raise AssertionError("useReplicatedTensorSharding must be set to True or False")
        return self.createOrSet(useReplicatedTensorSharding=int(use))

    def useIOTilesToLoad(self, use: bool = True):
        """Key ``useIOTilesToLoad`` = 0/1. Returns self. ``AssertionError`` unless bool."""
        if not isinstance(use, bool):
            raise AssertionError("useIOTilesToLoad must be set to True or False")
        return self.createOrSet(useIOTilesToLoad=int(use))

    def useIOTilesToStore(self, use: bool = True):
        """Key ``useIOTilesToStore`` = 0/1. Returns self. ``AssertionError`` unless bool."""
        if not isinstance(use, bool):
            raise AssertionError("useIOTilesToStore must be set to True or False")
        return self.createOrSet(useIOTilesToStore=int(use))


class _TensorLocationOptions(OptionsDict):
    """``Options.TensorLocations`` (docs/api-sections.md options §4.3). Keys: ``numIOTiles``,
    ``location_activation``, ``location_weight``, ``location_optimizer``,
    ``location_accumulator`` (created on demand). Behaviour follows PopTorch."""

    def numIOTiles(self, num_tiles: int):
        """Number of IO tiles (key ``numIOTiles``). Returns self.
        ``AssertionError`` "numIOTiles must be an even number between 32 and 192."."""
        if (not isinstance(num_tiles, int) or num_tiles < 32 or num_tiles > 192
                or num_tiles % 2 != 0):
            raise AssertionError("numIOTiles must be an even number between 32 and 192.")
        return self.createOrSet(numIOTiles=num_tiles)

    def _setLocation(self, key: str, location):
        if not isinstance(location, TensorLocationSettings):
            raise AssertionError("location must be of type poptorch.TensorLocationSettings, "
                                 f"got {type(location)}")
        return self.createOrSet(**{key: location.toDict()})

    def setActivationLocation(self, location: TensorLocationSettings):
        """Key ``location_activation`` = ``location.toDict()``. Returns self.
        ``AssertionError`` unless a :class:`TensorLocationSettings`."""
        return self._setLocation("location_activation", location)

    def setWeightLocation(self, location: TensorLocationSettings):
        """Key ``location_weight`` = ``location.toDict()``. Returns self.
        ``AssertionError`` unless a :class:`TensorLocationSettings`."""
        return self._setLocation("location_weight", location)

    def setOptimizerLocation(self, location: TensorLocationSettings):
        """Key ``location_optimizer`` = ``location.toDict()``. Returns self.
        ``AssertionError`` unless a :class:`TensorLocationSettings`."""
        return self._setLocation("location_optimizer", location)

    def setAccumulatorLocation(self, location: TensorLocationSettings):
        """Key ``location_accumulator`` = ``location.toDict()``. Returns self.
        ``AssertionError`` unless a :class:`TensorLocationSettings`."""
        return self._setLocation("location_accumulator", location)


def _env_int(name: str, default: int) -> int:
    value = config.raw(name)
    if not value.strip():
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Distributed.setEnvVarNames: environment variable {name} must "
                         f"be an integer, got {value!r}") from None


class _DistributedOptions(OptionsDict):
    """``Options.Distributed`` (docs/api-sections.md options §4.4): multi-process execution without
    PopRun. Values: ``distributed_process_id: int = 0``,
    ``num_distributed_processes: int = 1``, ``ipuof_configs: dict = {}``. The
    constructor reads ``OMPI_COMM_WORLD_SIZE`` / ``OMPI_COMM_WORLD_RANK`` (PopTorch),
    or, when those are unset, ``WORLD_SIZE`` / ``RANK`` as set by ``torchrun`` and
    ``poprun`` (an extension: processes started by ``torch.distributed.run`` configure
    themselves). Behaviour follows PopTorch otherwise, plus
    :meth:`pipelineAcrossProcesses` (not in PopTorch): keys
    ``pipeline_across_processes: bool`` (default ``POPTORCH_PIPELINE_ACROSS_PROCESSES``)
    and ``pipeline_stages: int = 0``."""

    _int_ranges = {"distributed_process_id": ("Distributed.configureProcessId", 0),
                   "num_distributed_processes": ("Distributed.configureProcessId", 1),
                   "pipeline_stages": ("Distributed.pipelineAcrossProcesses stages", 0)}

    def __init__(self):
        super().__init__(distributed_process_id=0, num_distributed_processes=1,
                         ipuof_configs={},
                         pipeline_across_processes=config.pipeline_across_processes(),
                         pipeline_stages=0)
        if config.text("OMPI_COMM_WORLD_SIZE") or not config.text("WORLD_SIZE"):
            self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
        else:
            self.setEnvVarNames("WORLD_SIZE", "RANK")

    def disable(self):
        """Reset to process 0 of 1. Returns self."""
        return self.configureProcessId(0, 1)

    def setEnvVarNames(self, var_num_processes: str, var_process_id: str):
        """Read the process id from the variable named ``var_process_id`` (0 when
        unset) and the count from ``var_num_processes`` (1 when unset), then call
        :meth:`configureProcessId`. Returns self. ``ValueError`` if a variable is
        not an integer; ``AssertionError`` unless both names are str."""
        check_type("Distributed.setEnvVarNames", var_num_processes, str)
        check_type("Distributed.setEnvVarNames", var_process_id, str)
        return self.configureProcessId(_env_int(var_process_id, 0),
                                       _env_int(var_num_processes, 1))

    def configureProcessId(self, process_id: int, num_processes: int):
        """Keys ``distributed_process_id`` and ``num_distributed_processes``.
        Returns self.

        Raises:
            AssertionError: non-int values.
            ValueError: ``num_processes < 1`` or ``process_id`` outside
                ``[0, num_processes)``; nothing is changed then.
        """
        ints = all(isinstance(v, int) for v in (process_id, num_processes))
        if ints:  # otherwise set() raises the type error
            check_int("Distributed.configureProcessId num_processes", int(num_processes), 1)
            check_int("Distributed.configureProcessId process_id", int(process_id), 0)
        if ints and process_id >= num_processes:
            raise ValueError(f"Distributed.configureProcessId: process_id must be in "
                             f"[0, {num_processes}) for {num_processes} processes, got "
                             f"{process_id}")
        return self.set(distributed_process_id=process_id,
                        num_distributed_processes=num_processes)

    def pipelineAcrossProcesses(self, enabled: bool = True, stages: Optional[int] = None):
        """Run each pipeline stage of a pipelined multi-IPU model in its own process
        (not in PopTorch; see docs/multi-ipu.md). Returns self.

        With ``PipelinedExecution`` over several IPUs, PopART's stages (consecutive
        stages on one IPU merged into one) become ``torch.distributed.pipelining``
        stages, one per process, and micro-batches flow between the processes (1F1B
        in training, GPipe-style in inference). Launch one process per stage, times
        the data-parallel replicas: ``torchrun --nproc-per-node 2 train.py`` for a
        2-stage model. Every process of a pipeline must run the same script on the
        same inputs (``poptorch.DataLoader`` partitions the data by pipeline replica).

        Args:
            enabled: turn the mode on or off (default: on; the option's default is
                ``POPTORCH_PIPELINE_ACROSS_PROCESSES``).
            stages: processes (merged pipeline stages) per pipeline replica; ``None``
                (default): all the processes form one pipeline. With more processes
                than stages, ``W / stages`` pipelines replicate the model (data
                parallel); say how many stages so that ``poptorch.DataLoader`` gives
                each pipeline its part of the data. The model's stage count is
                checked against it when it compiles.

        Raises:
            AssertionError: ``enabled`` is not a bool, ``stages`` not an int.
            ValueError: ``stages < 1``.
        """
        check_bool("Distributed.pipelineAcrossProcesses enabled", enabled)
        if stages is not None:
            check_int("Distributed.pipelineAcrossProcesses stages", stages, 1)
        return self.set(pipeline_across_processes=enabled,
                        pipeline_stages=0 if stages is None else stages)

    @property
    def pipelineProcessesPerReplica(self) -> int:
        """Processes of one pipeline replica: the declared ``stages``, else every
        process (1 without :meth:`pipelineAcrossProcesses`)."""
        if not self._values["pipeline_across_processes"]:
            return 1
        return self._values["pipeline_stages"] or self.numProcesses

    @property
    def processId(self) -> int:
        """Id of the current process."""
        return self._values["distributed_process_id"]

    @property
    def numProcesses(self) -> int:
        """Total number of processes."""
        return self._values["num_distributed_processes"]

