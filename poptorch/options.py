"""``poptorch.Options``: the top-level options (docs/api-sections.md options §1–§9,
docs/api-sections.md api §2.x, docs/semantics.md S-10…S-95).

Public names: :class:`Options`, :class:`TensorLocationSettings`, :class:`ConfigFileError`.
Behaviour follows PopTorch 3.x. The storage (:class:`OptionsDict`, docs/api-sections.md options §1)
is in ``_options/dict.py``; the sub-groups (``Training``, ``Precision``, ``TensorLocations``,
``Distributed``, ``Jit``, ``_Popart``) in ``_options/groups.py``; ``loadFromFile`` / ``from_json``
in ``_options/loading.py``; the removed 2.4 names in ``_options/deprecated.py``; the
device, target and profiling setters (``useIpuModel`` ... ``enableProfiling``) in
``_options/device.py``.

For the executor: ``opts._freeze()`` / ``opts._unfreeze()`` (the options and all their
sub-groups), ``opts._is_frozen``; ``opts.clone()`` is an unfrozen deep copy; private flags
``_execution_strategy``, ``_show_compilation_progress_bar``,
``_relax_optimizer_attributes_checks``, ``_module_namescope_enabled`` (bools) and
``_source_location_excludes`` (list); ``opts.toDict()`` holds
``compilation_progress_bar_fn`` (a callable ``(progress, total)``) when the progress bar is on.
"""
from __future__ import annotations

import copy
import os
from typing import Dict, List, Optional

import torch

from poptorch import enums
from poptorch._executor.progress import ProgressBar
from poptorch._logging import logger
from poptorch._options import environment as _env
from poptorch._options.backend import _BackendOptions
from poptorch._options.deprecated import DeprecatedAnchorMode
from poptorch._options.device import DeviceOptions
from poptorch._options.dict import (OptionsDict, check_bool, check_proportion, check_strings,
                                    check_type)
from poptorch._options.execution_strategy import (ParallelPhasedExecution, PipelinedExecution,
                                                  SerialPhasedExecution, ShardedExecution)
from poptorch._options.groups import (TensorLocationSettings, _DistributedOptions, _JitOptions,
                                      _PopartOptions, _PrecisionOptions, _TensorLocationOptions,
                                      _TrainingOptions)
from poptorch._options.loading import ConfigFileError, apply_json, load_file

_DEFAULT_SOURCE_LOCATION_EXCLUDES = ["install/poptorch", "site-packages/torch",
                                     "site-packages/poptorch"]
_UINT64_MAX = 2**64 - 1


class Options(DeprecatedAnchorMode, DeviceOptions, OptionsDict):
    """Configuration of ``trainingModel``, ``inferenceModel`` and ``DataLoader``
    (docs/api-sections.md options §1–§9). Behaviour follows PopTorch 3.x.

    Construction order (docs/api-sections.md options §2): sub-groups with their defaults
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
    ``model_name``, ``use_model``, ``ipu_id``, ``ipu_version``, ``ipu_model_strict_memory``.

    Most setters return self (chainable); ``anchorTensor`` returns ``None``.

    Every setter checks its arguments where they are set (issue: no error may wait
    for the first call): a wrong type raises ``AssertionError`` and a value out of
    range ``ValueError``, naming the setter and the allowed values. Integer keys with
    a range (``device_iterations``, ``replication_factor`` ≥ 1, ...) are checked
    however they are set (setter, attribute, ``set``, ``POPTORCH_DEFAULT_OPTIONS``).
    """

    _int_ranges = {"device_iterations": ("deviceIterations", 1),
                   "replication_factor": ("replicationFactor", 1),
                   "input_group_size": ("inputReplicaGrouping", 1),
                   "output_return_period": ("outputMode", 1),
                   "max_repeat_logs": ("maxRepeatLogs", 0)}

    def __init__(self, *, _environment: bool = True):
        # 1. Sub-groups. (_environment=False: built-in defaults only, without 5. and 6.)
        self._jit = _JitOptions()
        self._popart = _PopartOptions()
        self._training = _TrainingOptions(self._popart)
        self._precision = _PrecisionOptions(self._popart)
        self._distributed = _DistributedOptions()
        self._tensor_locations = _TensorLocationOptions()
        self._backend = _BackendOptions()
        # 2. Execution strategy.
        self._execution_strategy = PipelinedExecution()
        # 3. Private flags.
        self._relax_optimizer_attributes_checks = False
        self._show_compilation_progress_bar = True
        self._module_namescope_enabled = True
        self._source_location_excludes = list(_DEFAULT_SOURCE_LOCATION_EXCLUDES)
        # 4. Top-level values.
        super().__init__(
            device_iterations=1, log_dir=".", auto_round_num_ipus=False, anchored_tensors={},
            output_mode=enums.OutputMode.Default.value, output_return_period=1,
            replication_factor=1, input_group_size=1, input_cgt=enums.CommGroupType.Consecutive,
            broadcast_buffers=True, connection_type=enums.ConnectionType.Always.value,
            sync_pattern=enums.SyncPattern.Full.value, available_memory_proportion={},
            max_repeat_logs=4)
        # 5. Executable cache from the environment.
        cache_dir = _env.cache_dir() if _environment else ""
        if cache_dir:
            logger.info("POPTORCH_CACHE_DIR is set: setting cache path to %s", cache_dir)
            self.enableExecutableCaching(cache_dir)
        # 6. Default options from the environment.
        defaults = _env.default_options() if _environment else "{}"
        try:
            self.from_json(defaults)
        except (AssertionError, ValueError, AttributeError, TypeError) as err:
            # The built-in base class: subclasses such as json.JSONDecodeError take
            # other constructor arguments.
            kind = next(k for k in (AssertionError, ValueError, AttributeError, TypeError)
                        if isinstance(err, k))
            raise kind(f"POPTORCH_DEFAULT_OPTIONS={defaults!r}: {err}") from None

    # -- sub-groups --------------------------------------------------------------
    @property
    def Training(self) -> _TrainingOptions:
        """Training options (:class:`_TrainingOptions`, docs/api-sections.md options §4.1)."""
        return self._training

    @property
    def Precision(self) -> _PrecisionOptions:
        """Precision options (:class:`_PrecisionOptions`, docs/api-sections.md options §4.2)."""
        return self._precision

    @property
    def TensorLocations(self) -> _TensorLocationOptions:
        """Tensor location options (:class:`_TensorLocationOptions`,
        docs/api-sections.md options §4.3)."""
        return self._tensor_locations

    @property
    def Distributed(self) -> _DistributedOptions:
        """Multi-process options (:class:`_DistributedOptions`,
        docs/api-sections.md options §4.4)."""
        return self._distributed

    @property
    def Jit(self) -> _JitOptions:
        """Deprecated tracing options (:class:`_JitOptions`, docs/api-sections.md options §4.5)."""
        return self._jit

    @property
    def Backend(self) -> _BackendOptions:
        """Execution device and compiler of the IPU Model (``_BackendOptions``; our
        extension, ``docs/backends.md``)."""
        return self._backend

    @property
    def _Popart(self) -> _PopartOptions:
        """Backend options (:class:`_PopartOptions`, docs/api-sections.md options §4.6)."""
        return self._popart

    def _groups(self):
        return (self._jit, self._popart, self._training, self._precision,
                self._distributed, self._tensor_locations, self._backend)

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
        load_file(self, filepath)
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
        apply_json(self, string)
        return self

    # -- top-level setters ---------------------------------------------------------
    def deviceIterations(self, device_iterations: int):
        """Batches processed per call (``int`` ≥ 1, default 1, key
        ``device_iterations``). Returns self. docs/semantics.md S-10.

        Raises:
            AssertionError: not an int.
            ValueError: less than 1.
        """
        return self.set(device_iterations=device_iterations)

    def replicationFactor(self, replication_factor: int):
        """Local replicas per process (``int`` ≥ 1, default 1, key
        ``replication_factor``). Returns self. docs/semantics.md S-25.

        Raises:
            AssertionError: not an int.
            ValueError: less than 1.
        """
        return self.set(replication_factor=replication_factor)

    def inputReplicaGrouping(self, input_group_size: int,
                             input_group_type: enums.CommGroupType):
        """Replicas that receive the same input (keys ``input_group_size: int = 1``,
        ``input_cgt: CommGroupType = Consecutive``). ``NoGrouping`` forces size 1 and
        ``Consecutive``. Call ``replicationFactor`` first. Returns self. docs/semantics.md S-26.

        Raises:
            ValueError: ``All``; size greater than the replication factor; the
                replication factor not a multiple of the size.
            AssertionError: wrong argument types.
        """
        if not isinstance(input_group_type, enums.CommGroupType):
            raise AssertionError("input_group_type must be a poptorch.CommGroupType, got "
                                 f"{type(input_group_type)}")
        check_type("input_group_size", input_group_size, int)
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
        ``broadcast_buffers``). Returns self. docs/semantics.md S-36. ``AssertionError`` unless a
        bool."""
        return self.set(broadcast_buffers=broadcast_buffers)

    def outputMode(self, output_mode: enums.OutputMode,
                   output_return_period: Optional[int] = None):
        """What each output returns (key ``output_mode``, stored as the enum's
        integer value, default 4 = ``OutputMode.Default``; key
        ``output_return_period = output_return_period or 1``). A period given with
        a mode other than ``EveryN`` is ignored (info log). Returns self. docs/semantics.md S-12.

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
        (docs/semantics.md S-15). Stored in ``anchored_tensors[short_name] = [long_name, output_mode
        is None, output_mode, period]``; the period is forced to 1 unless the mode is ``EveryN``;
        ``None`` inherits the model's mode at wrap time. Not blocked by freezing. Returns ``None``.

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
            if not isinstance(output_return_period, int) or isinstance(
                    output_return_period, bool) or output_return_period <= 0:
                raise AssertionError("EveryN anchor must have output_return_period set "
                                     "to valid positive integer")
        else:
            output_return_period = 1
        self._values["anchored_tensors"][short_name] = [
            long_name, output_mode is None, output_mode, output_return_period
        ]

    def randomSeed(self, random_seed: int):
        """Seed of the device RNG (key ``random_seed``, created); also calls
        ``torch.manual_seed(random_seed)`` on the host. Returns self. docs/semantics.md S-95.

        Raises:
            AssertionError: not an int.
            ValueError: outside ``[-2^63, 2^64 - 1]`` (what ``torch.manual_seed``
                takes).
        """
        if not isinstance(random_seed, int) or isinstance(random_seed, bool):
            raise AssertionError("Random seed must be an integer, got "
                                 f"{type(random_seed)}")
        if not -2 ** 63 <= random_seed <= _UINT64_MAX:
            raise ValueError(f"randomSeed must be between -2**63 and 2**64 - 1, got "
                             f"{random_seed}")
        self.createOrSet(random_seed=random_seed)
        torch.manual_seed(random_seed)
        return self

    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True):
        """Round the number of IPUs up to a power of two on hardware (``bool``,
        default False, key ``auto_round_num_ipus``). Returns self. docs/semantics.md S-64.
        ``AssertionError`` unless a bool."""
        return self.set(auto_round_num_ipus=auto_round_num_ipus)

    def setExecutionStrategy(self, strategy):
        """Set the execution strategy (private ``_execution_strategy``; default
        ``PipelinedExecution()``). Returns self. docs/semantics.md S-60.

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
                ``{"IPU0": 0.5}``); a value that is not a number.
            ValueError: ``<n>`` is not a non-negative integer; a proportion outside
                ``[0, 1]``.
        """
        if not isinstance(available_memory_proportion, dict):
            raise AssertionError('Available memory proportion must be a dict of the form '
                                 '{"IPU0": 0.5}')
        actual = {}
        for key, proportion in available_memory_proportion.items():
            if not isinstance(key, str) or not key.startswith("IPU"):
                raise AssertionError(f"Invalid key {key!r}: available memory proportion "
                                     'must be set using the format {"IPU0": 0.5}')
            index = key[3:]
            if not index.isdigit():
                raise ValueError(f"Invalid key {key!r}: available memory proportion keys "
                                 'are "IPU<n>" with n a non-negative integer, e.g. '
                                 '{"IPU0": 0.5}')
            actual[int(index)] = check_proportion(
                f"setAvailableMemoryProportion[{key!r}]", proportion)
        return self.createOrSet(available_memory_proportion=actual)

    def logDir(self, log_dir: str):
        """Directory for backend log/report files (``str``, default ``"."``, key
        ``log_dir``). Returns self. ``AssertionError`` unless a str or path."""
        check_type("logDir", log_dir, (str, os.PathLike))
        return self.set(log_dir=str(log_dir))

    def maxRepeatLogs(self, max_lines: Optional[int]):
        """Repeated log messages shown before suppression (``int``, default 4, key
        ``max_repeat_logs``; ``None`` → 2^64−1, no suppression). Returns self.
        ``AssertionError`` unless an int or None; ``ValueError`` if negative."""
        return self.set(max_repeat_logs=_UINT64_MAX if max_lines is None else max_lines)

    def modelName(self, name: str):
        """Model name used as the profile sub-directory (key ``model_name``,
        created; default name ``"inference"``/``"training"``). Returns self.
        ``AssertionError`` unless a str."""
        check_type("modelName", name, str)
        return self.createOrSet(model_name=name)

    def enableExecutableCaching(self, path: Optional[str]):
        """Cache executables in ``path`` (``_Popart`` ``cachePath`` and
        ``enableEngineCaching=True``); ``None`` sets ``enableEngineCaching=False``.
        Returns self. docs/semantics.md S-61. ``AssertionError`` unless a str, path or None."""
        check_type("enableExecutableCaching", path, (str, os.PathLike, type(None)))
        if path is None:
            self._popart.set("enableEngineCaching", False)
        else:
            self._popart.set("cachePath", os.fspath(path))
            self._popart.set("enableEngineCaching", True)
        return self

    def disableModuleNamescope(self):
        """Stop prefixing op names with ``module/submodule/`` (private
        ``_module_namescope_enabled = False``). Returns self. docs/semantics.md S-16.
        ``AttributeError`` when frozen."""
        self._module_namescope_enabled = False
        return self

    def updatableNamedBuffers(self, buffers: List[str]):
        """Backend ``updatableNamedBuffers`` (enables ``copyNamedBuffersToDevice``).
        Returns self. ``AssertionError`` unless a list of str."""
        check_strings("updatableNamedBuffers", buffers)
        self._popart.set("updatableNamedBuffers", buffers)
        return self

    def showCompilationProgressBar(self, show: bool = True):
        """Draw a "Graph compilation" progress bar on stderr during compile (private
        ``_show_compilation_progress_bar``, default True). Returns self.
        ``AttributeError`` when frozen; ``AssertionError`` unless a bool."""
        check_bool("showCompilationProgressBar", show)
        self._show_compilation_progress_bar = show
        return self

    def relaxOptimizerAttributesChecks(self, relax: bool = True):
        """Turn warnings about unexpected optimizer attributes into debug messages
        (private ``_relax_optimizer_attributes_checks``, default False). Returns self.
        docs/semantics.md S-53. ``AttributeError`` when frozen; ``AssertionError`` unless a bool."""
        check_bool("relaxOptimizerAttributesChecks", relax)
        self._relax_optimizer_attributes_checks = relax
        return self

    def sourceLocationExcludes(self, excludes: List[str]):
        """Replace the path fragments skipped when attributing ops to source lines
        (private ``_source_location_excludes``). Returns self. ``AttributeError`` when
        frozen; ``AssertionError`` unless a list of str."""
        check_strings("sourceLocationExcludes", excludes)
        self._source_location_excludes = list(excludes)
        return self

    def appendToLocationExcludes(self, *excludes: str):
        """Append path fragments to the source-location excludes. Returns self.
        ``AttributeError`` when frozen; ``AssertionError`` unless each is a str."""
        check_strings("appendToLocationExcludes", list(excludes))
        self._source_location_excludes = self._source_location_excludes + list(excludes)
        return self

    # -- serialisation -------------------------------------------------------------
    def clone(self) -> "Options":
        """An unfrozen deep copy."""
        return copy.deepcopy(self)

    def toDict(self) -> dict:
        """The flat dictionary handed to the backend (docs/api-sections.md options §7.1): the
        execution strategy's values, ``_Popart`` options, top-level, ``Training``, ``Distributed``
        and ``TensorLocations`` values, plus ``compilation_progress_bar_fn`` (callable ``(progress,
        total)``) when the progress bar is enabled.

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
        out = self._backend.update(out)
        if self._show_compilation_progress_bar:
            out["compilation_progress_bar_fn"] = ProgressBar()
        return out

    def __repr__(self) -> str:
        parts = [f"{k}={v!r}" for k, v in self._values.items()]
        for name in sorted(("Backend", "Distributed", "Jit", "Precision", "TensorLocations",
                            "Training", "_Popart")):
            parts.append(f"{name}={getattr(self, name)!r}")
        return "Options(" + ", ".join(parts) + ")"
