"""``poptorch.Options`` and its sub-groups (spec options.md, api §2.x, S-10…S-95).

Public names: :class:`Options`, :class:`TensorLocationSettings`,
:class:`ConfigFileError`. Behaviour follows PopTorch 3.x.

Storage model (options §1): every group except ``_Popart`` is a "safe dictionary"
(:class:`OptionsDict`) whose values are type-checked against the current value,
readable as attributes, and can be frozen.

For the executor:

* ``opts._freeze()`` / ``opts._unfreeze()`` (freeze/unfreeze ``opts`` and all its
  sub-groups), ``opts._is_frozen``; ``opts.clone()`` is an unfrozen deep copy.
* private flags: ``opts._execution_strategy``, ``opts._show_compilation_progress_bar``
  (bool), ``opts._relax_optimizer_attributes_checks`` (bool),
  ``opts._module_namescope_enabled`` (bool), ``opts._source_location_excludes`` (list).
* ``opts.toDict()`` contains ``compilation_progress_bar_fn`` (a callable
  ``(progress, total)``) when the progress bar is enabled.
"""
from __future__ import annotations

import copy
import enum
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from . import enums
from ._execution_strategy import (ParallelPhasedExecution, PipelinedExecution,
                                  SerialPhasedExecution, ShardedExecution)
from ._logging import logger

__all__ = ["Options", "TensorLocationSettings", "ConfigFileError"]

_FROZEN_MESSAGE = "Can't modify frozen Options"
_MACHINERY = ("_values", "_is_frozen", "_initialized")
_DEFAULT_SOURCE_LOCATION_EXCLUDES = [
    "install/poptorch", "site-packages/torch", "site-packages/poptorch"
]
_UINT64_MAX = 2**64 - 1


class ConfigFileError(Exception):
    """Raised by :meth:`Options.loadFromFile` when the file has a Python syntax
    error. Message: ``"<ErrorClass> at line <n> of <basename>: <detail>\\n> <line>"``
    where ``<n>`` counts only retained command lines. Same as PopTorch."""


class _OptionsMeta(type):
    """Marks an option group as fully constructed once ``__init__`` has returned
    (new private attributes are rejected afterwards)."""

    def __call__(cls, *args, **kwargs):
        obj = super().__call__(*args, **kwargs)
        object.__setattr__(obj, "_initialized", True)
        return obj


class OptionsDict(metaclass=_OptionsMeta):
    """A "safe dictionary" of option values (options §1). Behaviour follows PopTorch.

    * ``set(**kw)``: only existing keys; a new value must be an instance of the
      type of the current one (``AssertionError`` "Unexpected type <t> for option
      <k>. Expected <t0>"); unknown key → ``AssertionError`` "Invalid option <k>,
      valid options are <keys>".
    * Values are readable as attributes (unknown → ``AttributeError`` "Invalid
      attribute <k>."); assigning a public attribute is ``set``; creating a new
      private attribute after construction → ``AttributeError`` "Invalid private
      attribute <k>. Valid attributes: [...]".
    * ``obj("key")`` returns the value.
    * Frozen groups reject every mutation with ``AttributeError`` "Can't modify
      frozen Options"; ``copy.deepcopy`` returns an unfrozen copy; pickling keeps
      everything.
    """

    #: private attributes left out of ``repr`` (references to other groups)
    _repr_excludes: tuple = ()

    def __init__(self, **default_values):
        object.__setattr__(self, "_values", dict(default_values))
        object.__setattr__(self, "_is_frozen", False)

    # -- freezing ------------------------------------------------------------
    def _check_not_frozen(self) -> None:
        if self.__dict__.get("_is_frozen", False):
            raise AttributeError(_FROZEN_MESSAGE)

    def _freeze(self) -> None:
        """Reject every further mutation (``AttributeError`` "Can't modify frozen
        Options")."""
        object.__setattr__(self, "_is_frozen", True)

    def _unfreeze(self) -> None:
        """Allow mutations again."""
        object.__setattr__(self, "_is_frozen", False)

    # -- dictionary helpers ----------------------------------------------------
    def set(self, **kwargs):
        """Set existing options (type-checked, see class docstring). Returns self.

        Raises:
            AssertionError: unknown key or wrong type.
            AttributeError: "Can't modify frozen Options".
        """
        self._check_not_frozen()
        for option, value in kwargs.items():
            if option not in self._values:
                raise AssertionError(f"Invalid option {option}, valid options are "
                                     f"{list(self._values.keys())}")
            expected = type(self._values[option])
            if not isinstance(value, expected):
                raise AssertionError(f"Unexpected type {type(value)} for option "
                                     f"{option}. Expected {expected}")
        self._values.update(kwargs)
        return self

    def createOrSet(self, **kwargs):
        """Set options, creating the keys that do not exist yet (existing keys are
        type-checked like :meth:`set`). Returns self. ``AttributeError`` when frozen."""
        self._check_not_frozen()
        for option, value in kwargs.items():
            if option in self._values:
                self.set(**{option: value})
            else:
                self._values[option] = value
        return self

    def exists(self, option: str) -> bool:
        """``True`` if ``option`` is a key of this group."""
        return option in self._values

    def deleteIfExists(self, option: str) -> None:
        """Remove ``option`` if present. ``AttributeError`` when frozen."""
        self._check_not_frozen()
        self._values.pop(option, None)

    def update(self, other: dict) -> dict:
        """Merge this group's values into ``other`` and return it.

        Raises:
            AssertionError: "Can't merge dictionaries, they have some keys in
                common".
        """
        if set(self._values).intersection(other):
            raise AssertionError("Can't merge dictionaries, they have some keys in common")
        other.update(self._values)
        return other

    def toDict(self) -> dict:
        """A (shallow) copy of this group's values."""
        return self.update({})

    def __call__(self, option: str):
        if option not in self._values:
            raise AssertionError(f"Invalid option {option}, valid options are "
                                 f"{list(self._values.keys())}")
        return self._values[option]

    # -- attribute protocol ----------------------------------------------------
    def __getattr__(self, option: str):
        if option.startswith("__"):
            raise AttributeError(option)
        values = self.__dict__.get("_values")
        if values is not None and option in values:
            return values[option]
        raise AttributeError(f"Invalid attribute {option}.")

    def __setattr__(self, option: str, value: Any) -> None:
        if option.startswith("_"):
            self._check_not_frozen()
            if (self.__dict__.get("_initialized", False) and option not in self.__dict__
                    and not hasattr(type(self), option)):
                valid = [k for k in self.__dict__ if k.startswith("_") and k not in _MACHINERY]
                raise AttributeError(f"Invalid private attribute {option}. "
                                     f"Valid attributes: {valid}")
            object.__setattr__(self, option, value)
        else:
            self.set(**{option: value})

    # -- copying / pickling --------------------------------------------------
    def __deepcopy__(self, memo):
        result = type(self).__new__(type(self))
        memo[id(self)] = result
        for key, value in self.__dict__.items():
            object.__setattr__(result, key, copy.deepcopy(value, memo))
        object.__setattr__(result, "_is_frozen", False)
        return result

    def __getstate__(self):
        return dict(self.__dict__)

    def __setstate__(self, state):
        self.__dict__.update(state)

    # -- printing --------------------------------------------------------------
    def _private_items(self):
        return [(k, v) for k, v in self.__dict__.items()
                if k.startswith("_") and k not in _MACHINERY and k not in self._repr_excludes]

    def __repr__(self) -> str:
        items = list(self._values.items()) + self._private_items()
        return f"{type(self).__name__}(" + ", ".join(f"{k}={v!r}" for k, v in items) + ")"


class _PopartOptions:
    """Advanced backend options (``Options._Popart``, options §4.6): a plain
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
            raise AttributeError(_FROZEN_MESSAGE)

    def _freeze(self) -> None:
        object.__setattr__(self, "_is_frozen", True)

    def _unfreeze(self) -> None:
        object.__setattr__(self, "_is_frozen", False)

    def __setattr__(self, name, value) -> None:
        self._check_not_frozen()
        object.__setattr__(self, name, value)

    def set(self, key: str, value: Any):
        """Store ``value`` (any type) under ``key``. Returns self.
        ``AttributeError`` "Can't modify frozen Options" when frozen."""
        self._check_not_frozen()
        self.options[key] = value
        return self

    def setEngineOptions(self, engine_options: dict):
        """``set("engineOptions", engine_options)``. Returns self."""
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

    def __deepcopy__(self, memo):
        result = type(self).__new__(type(self))
        memo[id(self)] = result
        for key, value in self.__dict__.items():
            object.__setattr__(result, key, copy.deepcopy(value, memo))
        object.__setattr__(result, "_is_frozen", False)
        return result

    def __getstate__(self):
        return dict(self.__dict__)

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return "_PopartOptions(" + ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + ")"


class _JitOptions(OptionsDict):
    """``Options.Jit`` (options §4.5). Behaviour follows PopTorch."""

    def traceModel(self, trace_model: bool):
        """Deprecated: logs a warning. ``True`` → ``ValueError``
        "options.Jit.traceModel(True) is no longer supported"; ``False`` returns
        self."""
        logger.warning("options.Jit.traceModel is deprecated and will be removed in a "
                       "future release: the tracing frontend is no longer supported.")
        if trace_model:
            raise ValueError("options.Jit.traceModel(True) is no longer supported")
        return self


class _TrainingOptions(OptionsDict):
    """``Options.Training`` (options §4.1). Behaviour follows PopTorch.

    Values: ``gradient_accumulation: int = 1``,
    ``accumulation_and_replication_reduction_type: ReductionType = Mean``,
    ``meanAccumulationAndReplicationReductionStrategy: MeanReductionStrategy = Post``.
    """

    _repr_excludes = ("_popart",)

    def __init__(self, popart_options: _PopartOptions):
        self._popart = popart_options
        super().__init__(
            gradient_accumulation=1,
            accumulation_and_replication_reduction_type=enums.ReductionType.Mean,
            meanAccumulationAndReplicationReductionStrategy=enums.MeanReductionStrategy.Post,
        )

    def gradientAccumulation(self, gradient_accumulation: int):
        """Micro-batches accumulated per weight update (``int``, default 1, key
        ``gradient_accumulation``). Returns self. ``AssertionError`` on a non-int."""
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
        """Backend ``automaticLossScalingSettings.enabled``. Returns self."""
        self._popart.set("automaticLossScalingSettings.enabled", enabled)
        return self

    def setConvolutionDithering(self, enabled: bool):
        """Backend ``convolutionOptions = {"enableConvDithering": enabled}``
        (replaces the whole dict; see ``Precision.setPartialsType``). Returns self."""
        self._popart.set("convolutionOptions", {"enableConvDithering": enabled})
        return self


class _PrecisionOptions(OptionsDict):
    """``Options.Precision`` (options §4.2): no values of its own, writes into
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
        """Backend ``enableStochasticRounding`` (no type check). Returns self."""
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
    """Settings of one tensor location (options §4.3), passed to
    ``Options.TensorLocations.set<Kind>Location``. Chainable; performance hints
    only on the IPU Model. Behaviour follows PopTorch."""

    def minElementsForOffChip(self, min_elements: int):
        """Key ``minElementsForOffChip``. Returns self. ``AssertionError`` unless int."""
        if not isinstance(min_elements, int):
            raise AssertionError("minElementsForOffChip must be an integer")
        return self.createOrSet(minElementsForOffChip=min_elements)

    def minElementsForReplicatedTensorSharding(self, min_elements: int):
        """Key ``minElementsForReplicatedTensorSharding``. Returns self.
        ``AssertionError`` unless int."""
        if not isinstance(min_elements, int):
            raise AssertionError("minElementsForReplicatedTensorSharding must be an integer")
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
    """``Options.TensorLocations`` (options §4.3). Keys: ``numIOTiles``,
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
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


class _DistributedOptions(OptionsDict):
    """``Options.Distributed`` (options §4.4): multi-process execution without
    PopRun. Values: ``distributed_process_id: int = 0``,
    ``num_distributed_processes: int = 1``, ``ipuof_configs: dict = {}``. The
    constructor reads ``OMPI_COMM_WORLD_SIZE`` / ``OMPI_COMM_WORLD_RANK``.
    Behaviour follows PopTorch."""

    def __init__(self):
        super().__init__(distributed_process_id=0, num_distributed_processes=1,
                         ipuof_configs={})
        self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")

    def disable(self):
        """Reset to process 0 of 1. Returns self."""
        return self.configureProcessId(0, 1)

    def setEnvVarNames(self, var_num_processes: str, var_process_id: str):
        """Read the process id from the variable named ``var_process_id`` (0 when
        unset) and the count from ``var_num_processes`` (1 when unset), then call
        :meth:`configureProcessId`. Returns self. ``ValueError`` if a variable is
        not an integer."""
        return self.configureProcessId(_env_int(var_process_id, 0),
                                       _env_int(var_num_processes, 1))

    def configureProcessId(self, process_id: int, num_processes: int):
        """Keys ``distributed_process_id`` and ``num_distributed_processes``.
        Returns self. ``AssertionError`` on non-int values."""
        return self.set(distributed_process_id=process_id,
                        num_distributed_processes=num_processes)

    @property
    def processId(self) -> int:
        """Id of the current process."""
        return self._values["distributed_process_id"]

    @property
    def numProcesses(self) -> int:
        """Total number of processes."""
        return self._values["num_distributed_processes"]


class _ProgressBar:
    """The ``compilation_progress_bar_fn`` of :meth:`Options.toDict`: a callable
    ``(progress, total)`` drawing a tqdm bar titled "Graph compilation" on stderr, which
    also times the compilation (``elapsed``, seconds, set when it reaches ``total`` or
    is closed).

    Args:
        show: draw the bar (``False``: only time the compilation).
    """

    def __init__(self, show: bool = True):
        self.show = show
        self._bar = None
        self.start = time.perf_counter()
        self.elapsed: Optional[float] = None

    def __call__(self, progress: int, total: int) -> None:
        if self.show and self._bar is None and self.elapsed is None:
            from tqdm import tqdm
            self._bar = tqdm(desc="Graph compilation", total=total, file=sys.stderr,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                             "{n}/{total} [{elapsed}<{remaining}]")
        if self._bar is not None and progress != self._bar.n:
            self._bar.n = progress
            self._bar.refresh()
        if progress >= total:
            self.close()

    def close(self) -> None:
        """Stop the timer and close the bar."""
        if self.elapsed is None:
            self.elapsed = time.perf_counter() - self.start
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _convert_json_value(value):
    """``"<EnumName>.<Member>"`` → the member of ``poptorch.enums.<EnumName>``."""
    if isinstance(value, str) and "." in value:
        enum_name, member = value.split(".", 1)
        enum_cls = getattr(enums, enum_name, None)
        if isinstance(enum_cls, type) and issubclass(enum_cls, enum.Enum):
            if member not in enum_cls.__members__:
                raise ValueError(f"{member} is not a member of poptorch.{enum_name}")
            return enum_cls[member]
    return value


class Options(OptionsDict):
    """Configuration of ``trainingModel``, ``inferenceModel`` and ``DataLoader``
    (spec options.md). Behaviour follows PopTorch 3.x.

    Construction order (options §2): sub-groups with their defaults
    (``Distributed`` reads ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``),
    execution strategy ``PipelinedExecution()``, private flags, top-level defaults,
    ``POPTORCH_CACHE_DIR`` (``enableExecutableCaching``), then
    ``from_json(POPTORCH_DEFAULT_OPTIONS)``.

    Top-level values (key: type = default): ``device_iterations: int = 1``,
    ``log_dir: str = "."``, ``auto_round_num_ipus: bool = False``,
    ``anchored_tensors: dict = {}``, ``output_mode: int = 4`` (``OutputMode.Default``),
    ``output_return_period: int = 1``, ``replication_factor: int = 1``,
    ``input_group_size: int = 1``, ``input_cgt: CommGroupType = Consecutive``,
    ``broadcast_buffers: bool = True``, ``connection_type: int = 0``,
    ``sync_pattern: int = 0``, ``available_memory_proportion: dict = {}``,
    ``max_repeat_logs: int = 4``; created on demand: ``random_seed``,
    ``model_name``, ``use_model``, ``ipu_id``, ``ipu_version``.

    Most setters return self (chainable); ``anchorTensor`` returns ``None``.
    """

    def __init__(self):
        # 1. Sub-groups.
        self._jit = _JitOptions()
        self._popart = _PopartOptions()
        self._training = _TrainingOptions(self._popart)
        self._precision = _PrecisionOptions(self._popart)
        self._distributed = _DistributedOptions()
        self._tensor_locations = _TensorLocationOptions()
        # 2. Execution strategy.
        self._execution_strategy = PipelinedExecution()
        # 3. Private flags.
        self._relax_optimizer_attributes_checks = False
        self._show_compilation_progress_bar = True
        self._module_namescope_enabled = True
        self._source_location_excludes = list(_DEFAULT_SOURCE_LOCATION_EXCLUDES)
        # 4. Top-level values.
        super().__init__(
            device_iterations=1,
            log_dir=".",
            auto_round_num_ipus=False,
            anchored_tensors={},
            output_mode=enums.OutputMode.Default.value,
            output_return_period=1,
            replication_factor=1,
            input_group_size=1,
            input_cgt=enums.CommGroupType.Consecutive,
            broadcast_buffers=True,
            connection_type=enums.ConnectionType.Always.value,
            sync_pattern=enums.SyncPattern.Full.value,
            available_memory_proportion={},
            max_repeat_logs=4,
        )
        # 5. Executable cache from the environment.
        cache_dir = os.environ.get("POPTORCH_CACHE_DIR", "")
        if cache_dir:
            logger.info("POPTORCH_CACHE_DIR is set: setting cache path to %s", cache_dir)
            self.enableExecutableCaching(cache_dir)
        # 6. Default options from the environment.
        self.from_json(os.environ.get("POPTORCH_DEFAULT_OPTIONS", "{}") or "{}")

    # -- sub-groups --------------------------------------------------------------
    @property
    def Training(self) -> _TrainingOptions:
        """Training options (:class:`_TrainingOptions`, options §4.1)."""
        return self._training

    @property
    def Precision(self) -> _PrecisionOptions:
        """Precision options (:class:`_PrecisionOptions`, options §4.2)."""
        return self._precision

    @property
    def TensorLocations(self) -> _TensorLocationOptions:
        """Tensor location options (:class:`_TensorLocationOptions`, options §4.3)."""
        return self._tensor_locations

    @property
    def Distributed(self) -> _DistributedOptions:
        """Multi-process options (:class:`_DistributedOptions`, options §4.4)."""
        return self._distributed

    @property
    def Jit(self) -> _JitOptions:
        """Deprecated tracing options (:class:`_JitOptions`, options §4.5)."""
        return self._jit

    @property
    def _Popart(self) -> _PopartOptions:
        """Advanced backend options (:class:`_PopartOptions`, options §4.6)."""
        return self._popart

    def _groups(self):
        return (self._jit, self._popart, self._training, self._precision,
                self._distributed, self._tensor_locations)

    def _freeze(self) -> None:
        """Freeze these options and all the sub-groups (``_Popart`` included)."""
        for group in self._groups():
            group._freeze()
        super()._freeze()

    def _unfreeze(self) -> None:
        """Unfreeze these options and all the sub-groups."""
        for group in self._groups():
            group._unfreeze()
        super()._unfreeze()

    # -- loading -----------------------------------------------------------------
    def loadFromFile(self, filepath: str):
        """Apply the setter calls of a text file (one per line, without the leading
        ``options.``; blank and ``#`` lines skipped). Calls accumulate. Returns self.

        Raises:
            ConfigFileError: on a Python syntax error:
                ``"<ErrorClass> at line <n> of <basename>: <detail>\\n> <line>"``
                where ``<n>`` counts only the retained command lines.
            Exception: any other error of a call propagates with its own type.
        """
        import poptorch  # pylint: disable=import-outside-toplevel

        commands = []
        with open(filepath, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                commands.append("options." + line)
        code = "\n".join(commands)
        try:
            compiled = compile(code, f"<options file {os.path.basename(filepath)}>", "exec")
        except SyntaxError as err:
            lineno = min(max(err.lineno or 1, 1), max(len(commands), 1))
            offending = commands[lineno - 1] if commands else ""
            raise ConfigFileError(f"{type(err).__name__} at line {lineno} of "
                                  f"{os.path.basename(filepath)}: {err.msg}\n> "
                                  f"{offending}") from None
        exec(compiled, {"poptorch": poptorch, "options": self})  # noqa: S102
        return self

    def from_json(self, string: str):
        """Apply a JSON object mapping dotted accessor paths (e.g.
        ``"Training.gradientAccumulation"``, ``"_Popart.set"``) to values: a list is
        splatted as positional arguments, any other value is a single argument;
        strings ``"<EnumName>.<Member>"`` naming a ``poptorch.enums`` enum are
        converted to the member. Returns self.

        Raises:
            ValueError: invalid JSON, not a JSON object, or an unknown enum member.
            AttributeError: an unknown accessor.
        """
        data = json.loads(string)
        if not isinstance(data, dict):
            raise ValueError("The JSON options must be an object mapping accessor paths "
                             f"to values, got {type(data).__name__}")
        for path, value in data.items():
            target = self
            for attr in path.split("."):
                target = getattr(target, attr)
            args = value if isinstance(value, list) else [value]
            target(*[_convert_json_value(a) for a in args])
        return self

    # -- top-level setters ---------------------------------------------------------
    def deviceIterations(self, device_iterations: int):
        """Batches processed per call (``int``, default 1, key
        ``device_iterations``). Returns self. ``AssertionError`` on a non-int. S-10."""
        return self.set(device_iterations=device_iterations)

    def replicationFactor(self, replication_factor: int):
        """Local replicas per process (``int``, default 1, key
        ``replication_factor``). Returns self. ``AssertionError`` on a non-int. S-25."""
        return self.set(replication_factor=replication_factor)

    def inputReplicaGrouping(self, input_group_size: int,
                             input_group_type: enums.CommGroupType):
        """Replicas that receive the same input (keys ``input_group_size: int = 1``,
        ``input_cgt: CommGroupType = Consecutive``). ``NoGrouping`` forces size 1 and
        ``Consecutive``. Call ``replicationFactor`` first. Returns self. S-26.

        Raises:
            ValueError: ``All``; size greater than the replication factor; the
                replication factor not a multiple of the size.
            AssertionError: wrong argument types.
        """
        if not isinstance(input_group_type, enums.CommGroupType):
            raise AssertionError("input_group_type must be a poptorch.CommGroupType, got "
                                 f"{type(input_group_type)}")
        if not isinstance(input_group_size, int):
            raise AssertionError("input_group_size must be an int, got "
                                 f"{type(input_group_size)}")
        if input_group_type == enums.CommGroupType.NoGrouping:
            input_group_size = 1
            input_group_type = enums.CommGroupType.Consecutive
        if input_group_type == enums.CommGroupType.All:
            raise ValueError("input_group_type cannot be All")
        replication_factor = self._values["replication_factor"]
        if input_group_size < 1:
            raise ValueError(f"input_group_size ({input_group_size}) must be positive")
        if input_group_size > replication_factor:
            raise ValueError(f"input_group_size ({input_group_size}) cannot be greater "
                             f"than the replication factor ({replication_factor})")
        if replication_factor % input_group_size != 0:
            raise ValueError(f"The replication factor ({replication_factor}) must be "
                             f"divisible by input_group_size ({input_group_size})")
        return self.set(input_group_size=input_group_size, input_cgt=input_group_type)

    def broadcastBuffers(self, broadcast_buffers: bool = True):
        """Broadcast buffers from replica 0 (``bool``, default True, key
        ``broadcast_buffers``). Returns self. S-36."""
        return self.set(broadcast_buffers=broadcast_buffers)

    def outputMode(self, output_mode: enums.OutputMode,
                   output_return_period: Optional[int] = None):
        """What each output returns (key ``output_mode``, stored as the enum's
        integer value, default 4 = ``OutputMode.Default``; key
        ``output_return_period = output_return_period or 1``). A period given with
        a mode other than ``EveryN`` is ignored (info log). Returns self. S-12.

        Raises:
            AssertionError: ``output_mode`` not an ``OutputMode``; "EveryN anchor
                must have output_return_period set to valid positive integer".
        """
        if not isinstance(output_mode, enums.OutputMode):
            raise AssertionError("output_mode must be a poptorch.OutputMode, got "
                                 f"{type(output_mode)}")
        if output_mode == enums.OutputMode.EveryN:
            if (not isinstance(output_return_period, int) or isinstance(
                    output_return_period, bool) or output_return_period <= 0):
                raise AssertionError("EveryN anchor must have output_return_period set "
                                     "to valid positive integer")
        elif output_return_period is not None:
            logger.info("Output return period argument ignored with output_mode set to %s",
                        output_mode)
        return self.set(output_mode=output_mode.value,
                        output_return_period=output_return_period or 1)

    def defaultOutputMode(self) -> bool:
        """``True`` iff the output mode is still ``OutputMode.Default``."""
        return self._values["output_mode"] == enums.OutputMode.Default

    def anchorTensor(self, short_name: str, long_name: str,
                     output_mode: Optional[enums.OutputMode] = None,
                     output_return_period: int = 1) -> None:
        """Make the internal tensor ``long_name`` retrievable as ``short_name``
        (S-15). Stored in ``anchored_tensors[short_name] = [long_name, output_mode is
        None, output_mode, period]``; the period is forced to 1 unless the mode is
        ``EveryN``; ``None`` inherits the model's mode at wrap time. Not blocked by
        freezing. Returns ``None``.

        Raises:
            AssertionError: names not strings; mode not an ``OutputMode``; ``EveryN``
                without a positive period.
        """
        if not isinstance(short_name, str) or not isinstance(long_name, str):
            raise AssertionError("anchorTensor: short_name and long_name must be strings")
        if output_mode is not None and not isinstance(output_mode, enums.OutputMode):
            raise AssertionError("output_mode must be a poptorch.OutputMode, got "
                                 f"{type(output_mode)}")
        if output_mode == enums.OutputMode.EveryN:
            if not isinstance(output_return_period, int) or output_return_period <= 0:
                raise AssertionError("EveryN anchor must have output_return_period set "
                                     "to valid positive integer")
        else:
            output_return_period = 1
        self._values["anchored_tensors"][short_name] = [
            long_name, output_mode is None, output_mode, output_return_period
        ]

    def randomSeed(self, random_seed: int):
        """Seed of the device RNG (key ``random_seed``, created); also calls
        ``torch.manual_seed(random_seed)`` on the host. Returns self. S-95.
        ``AssertionError`` if not an int."""
        if not isinstance(random_seed, int):
            raise AssertionError("Random seed must be an integer, got "
                                 f"{type(random_seed)}")
        self.createOrSet(random_seed=random_seed)
        torch.manual_seed(random_seed)
        return self

    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True):
        """Round the number of IPUs up to a power of two on hardware (``bool``,
        default False, key ``auto_round_num_ipus``). Returns self. S-64."""
        return self.set(auto_round_num_ipus=auto_round_num_ipus)

    def setExecutionStrategy(self, strategy):
        """Set the execution strategy (private ``_execution_strategy``; default
        ``PipelinedExecution()``). Returns self. S-60.

        Raises:
            AssertionError: unless a ``PipelinedExecution``, ``ShardedExecution``,
                ``SerialPhasedExecution`` or ``ParallelPhasedExecution``.
            AttributeError: "Can't modify frozen Options".
        """
        if not isinstance(strategy, (PipelinedExecution, ShardedExecution,
                                     SerialPhasedExecution, ParallelPhasedExecution)):
            raise AssertionError("strategy must be a poptorch.PipelinedExecution, "
                                 "poptorch.ShardedExecution, "
                                 "poptorch.SerialPhasedExecution or "
                                 f"poptorch.ParallelPhasedExecution, got {type(strategy)}")
        self._execution_strategy = strategy
        return self

    def setAvailableMemoryProportion(self, available_memory_proportion: Dict[str, float]):
        """Available memory proportion per IPU (key ``available_memory_proportion``
        stored as ``{ipu_index: float}``, default ``{}``). Returns self.

        Raises:
            AssertionError: a key not of the form ``"IPU<n>"`` (expected
                ``{"IPU0": 0.5}``).
            ValueError: ``<n>`` is not an integer.
        """
        if not isinstance(available_memory_proportion, dict):
            raise AssertionError('Available memory proportion must be a dict of the form '
                                 '{"IPU0": 0.5}')
        actual = {}
        for key, proportion in available_memory_proportion.items():
            if not isinstance(key, str) or not key.startswith("IPU"):
                raise AssertionError(f"Invalid key {key!r}: available memory proportion "
                                     'must be set using the format {"IPU0": 0.5}')
            actual[int(key[3:])] = proportion
        return self.createOrSet(available_memory_proportion=actual)

    def logDir(self, log_dir: str):
        """Directory for backend log/report files (``str``, default ``"."``, key
        ``log_dir``). Returns self."""
        return self.set(log_dir=log_dir)

    def maxRepeatLogs(self, max_lines: Optional[int]):
        """Repeated log messages shown before suppression (``int``, default 4, key
        ``max_repeat_logs``; ``None`` → 2^64−1, no suppression). Returns self."""
        return self.set(max_repeat_logs=_UINT64_MAX if max_lines is None else max_lines)

    def modelName(self, name: str):
        """Model name used as the profile sub-directory (key ``model_name``,
        created; default name ``"inference"``/``"training"``). Returns self."""
        return self.createOrSet(model_name=name)

    def enableExecutableCaching(self, path: Optional[str]):
        """Cache executables in ``path`` (``_Popart`` ``cachePath`` and
        ``enableEngineCaching=True``); ``None`` sets ``enableEngineCaching=False``.
        Returns self. S-61."""
        if path is None:
            self._popart.set("enableEngineCaching", False)
        else:
            self._popart.set("cachePath", path)
            self._popart.set("enableEngineCaching", True)
        return self

    def useIpuModel(self, use_model: bool):
        """Use the IPU Model (``True``) or request hardware (key ``use_model``,
        created; overrides ``POPTORCH_IPU_MODEL``). Returns self. S-82."""
        return self.createOrSet(use_model=use_model)

    def connectionType(self, connection_type: enums.ConnectionType):
        """When to attach the device (key ``connection_type``, stored as int,
        default 0 = ``Always``). Returns self. ``AssertionError`` unless a
        ``ConnectionType``. S-80."""
        if not isinstance(connection_type, enums.ConnectionType):
            raise AssertionError("connection_type must be a poptorch.ConnectionType, got "
                                 f"{type(connection_type)}")
        return self.set(connection_type=connection_type.value)

    def syncPattern(self, sync_pattern: enums.SyncPattern):
        """Host/device sync pattern (key ``sync_pattern``, stored as int, default 0 =
        ``Full``; no effect on the IPU Model). Returns self. ``AssertionError``
        unless a ``SyncPattern``."""
        if not isinstance(sync_pattern, enums.SyncPattern):
            raise AssertionError("sync_pattern must be a poptorch.SyncPattern, got "
                                 f"{type(sync_pattern)}")
        return self.set(sync_pattern=sync_pattern.value)

    def useIpuId(self, ipu_id: int):
        """Use this IPU id (key ``ipu_id``, created; hardware only). Returns self.
        ``AssertionError`` if not an int. S-83."""
        if not isinstance(ipu_id, int):
            raise AssertionError(f"ipu_id must be an integer, got {type(ipu_id)}")
        return self.createOrSet(ipu_id=ipu_id)

    def useOfflineIpuTarget(self, ipu_version: int = 2):
        """Compile for an IPU without attaching (``connection_type = Never``, key
        ``ipu_version`` created: 1 = Mk1, 2 = Mk2, 21 = Mk2 with FP8). Returns self.
        S-81."""
        self.connectionType(enums.ConnectionType.Never)
        return self.createOrSet(ipu_version=ipu_version)

    def enableStableNorm(self, enabled: bool):
        """Backend ``enableStableNorm``. Returns self."""
        self._popart.set("enableStableNorm", enabled)
        return self

    def enableSyntheticData(self, enabled: bool):
        """Backend ``syntheticDataMode`` = 2 if enabled else 0 (no host I/O). Returns
        self. S-84."""
        self._popart.set("syntheticDataMode", 2 if enabled else 0)
        return self

    def logCycleCount(self, log_cycle_count: bool):
        """Backend ``instrumentWithHardwareCycleCounter`` (hardware only). Returns
        self."""
        self._popart.set("instrumentWithHardwareCycleCounter", log_cycle_count)
        return self

    def enableProfiling(self, profile_dir: Optional[str] = None):
        """Merge ``debug.allowOutOfMemory="true"``, ``autoReport.directory=<dir or
        ".">`` and ``autoReport.all="true"`` into the backend ``engineOptions``.
        Warns if ``POPLAR_ENGINE_OPTIONS`` already sets one of them (the environment
        wins). Returns self. S-85."""
        env = os.environ.get("POPLAR_ENGINE_OPTIONS", "")
        for key in ("debug.allowOutOfMemory", "autoReport.directory", "autoReport.all"):
            if key in env:
                logger.warning("%s is already set in POPLAR_ENGINE_OPTIONS: the value from "
                               "the environment takes precedence over enableProfiling()",
                               key)
        engine_options = dict(self._popart.options.get("engineOptions", {}))
        engine_options.update({
            "debug.allowOutOfMemory": "true",
            "autoReport.directory": profile_dir or ".",
            "autoReport.all": "true",
        })
        self._popart.setEngineOptions(engine_options)
        return self

    def disableModuleNamescope(self):
        """Stop prefixing op names with ``module/submodule/`` (private
        ``_module_namescope_enabled = False``). Returns self. S-16.
        ``AttributeError`` when frozen."""
        self._module_namescope_enabled = False
        return self

    def updatableNamedBuffers(self, buffers: List[str]):
        """Backend ``updatableNamedBuffers`` (enables ``copyNamedBuffersToDevice``).
        Returns self."""
        self._popart.set("updatableNamedBuffers", buffers)
        return self

    def showCompilationProgressBar(self, show: bool = True):
        """Draw a "Graph compilation" progress bar on stderr during compile (private
        ``_show_compilation_progress_bar``, default True). Returns self.
        ``AttributeError`` when frozen."""
        self._show_compilation_progress_bar = bool(show)
        return self

    def relaxOptimizerAttributesChecks(self, relax: bool = True):
        """Turn warnings about unexpected optimizer attributes into debug messages
        (private ``_relax_optimizer_attributes_checks``, default False). Returns self.
        S-53. ``AttributeError`` when frozen."""
        self._relax_optimizer_attributes_checks = bool(relax)
        return self

    def sourceLocationExcludes(self, excludes: List[str]):
        """Replace the path fragments skipped when attributing ops to source lines
        (private ``_source_location_excludes``). Returns self. ``AttributeError`` when
        frozen."""
        self._source_location_excludes = list(excludes)
        return self

    def appendToLocationExcludes(self, *excludes: str):
        """Append path fragments to the source-location excludes. Returns self.
        ``AttributeError`` when frozen."""
        self._source_location_excludes = self._source_location_excludes + list(excludes)
        return self

    # -- deprecated shims (options §9) ----------------------------------------------
    def anchorMode(self, anchor_mode, anchor_return_period: Optional[int] = None):
        """Removed in 2.5; compatibility shim forwarding to :meth:`outputMode`
        (accepts an ``OutputMode``, an enum member with the same name, or its int
        value) with a deprecation warning. Returns self."""
        logger.warning("poptorch.Options.anchorMode is deprecated since version 2.4 and "
                       "was removed in 2.5. Use outputMode instead.")
        if not isinstance(anchor_mode, enums.OutputMode):
            if isinstance(anchor_mode, enum.Enum):
                anchor_mode = enums.OutputMode[anchor_mode.name]
            elif isinstance(anchor_mode, int):
                anchor_mode = enums.OutputMode(anchor_mode)
        return self.outputMode(anchor_mode, anchor_return_period)

    def defaultAnchorMode(self) -> bool:
        """Removed in 2.5; compatibility shim for :meth:`defaultOutputMode` with a
        deprecation warning."""
        logger.warning("poptorch.Options.defaultAnchorMode is deprecated since version "
                       "2.4 and was removed in 2.5. Use defaultOutputMode instead.")
        return self.defaultOutputMode()

    # -- serialisation -------------------------------------------------------------
    def clone(self) -> "Options":
        """An unfrozen deep copy."""
        return copy.deepcopy(self)

    def toDict(self) -> dict:
        """The flat dictionary handed to the backend (options §7.1): the execution
        strategy's values, ``_Popart`` options, top-level, ``Training``,
        ``Distributed`` and ``TensorLocations`` values, plus
        ``compilation_progress_bar_fn`` (callable ``(progress, total)``) when the
        progress bar is enabled.

        Raises:
            AssertionError: "An output mode must be picked before serialisation";
                "Can't merge dictionaries, they have some keys in common".
        """
        if self.defaultOutputMode():
            raise AssertionError("An output mode must be picked before serialisation")
        out = dict(self._execution_strategy.backendOptions())
        out = self._popart.update(out)
        out = self.update(out)
        out = self._training.update(out)
        out = self._distributed.update(out)
        out = self._tensor_locations.update(out)
        if self._show_compilation_progress_bar:
            out["compilation_progress_bar_fn"] = _ProgressBar()
        return out

    def __repr__(self) -> str:
        parts = [f"{k}={v!r}" for k, v in self._values.items()]
        for name in sorted(("Distributed", "Jit", "Precision", "TensorLocations",
                            "Training", "_Popart")):
            parts.append(f"{name}={getattr(self, name)!r}")
        return "Options(" + ", ".join(parts) + ")"
