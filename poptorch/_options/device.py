"""The device, target and profiling setters of ``poptorch.Options``: which device a
program attaches to (the IPU Model or hardware, an IPU id, an offline target), when it
attaches, the host/device sync pattern, the IPU Model's strict memory, synthetic data,
the cycle counter and the profile report. Behaviour follows PopTorch 3.x
(docs/api-sections.md options §2; docs/semantics.md S-80…S-85).

:class:`DeviceOptions` is a mixin of :class:`poptorch.Options`: its methods store their
values through the options' own ``createOrSet`` / ``set`` and the ``_Popart`` group.
"""
from __future__ import annotations

import os
from typing import Optional

from poptorch import enums
from poptorch._logging import logger
from poptorch._options import environment as _env
from poptorch._options.dict import check_bool, check_int, check_type

__all__ = ["DeviceOptions"]


class DeviceOptions:
    """``poptorch.Options``' setters of the device, the target and profiling (a mixin:
    it holds no state of its own). Every setter returns the options (chainable)."""

    def useIpuModel(self, use_model: bool):
        """Use the IPU Model (``True``) or request hardware (key ``use_model``,
        created; overrides ``POPTORCH_IPU_MODEL``). Returns self. docs/semantics.md S-82.
        ``AssertionError`` unless a bool."""
        check_bool("useIpuModel", use_model)
        return self.createOrSet(use_model=use_model)

    def ipuModelStrictMemory(self, strict: bool = True):
        """Make a program that does not fit in the IPU Model's memory fail to compile
        (key ``ipu_model_strict_memory``, created), as it would on hardware.

        By default the IPU Model follows Poplar's IPU Model: a program that exceeds an
        IPU's memory is reported (a warning naming the IPU, the bytes needed and
        available and the largest categories; ``ipuModelEstimate()`` and the profile
        report hold the same figures with ``fits: False``) and still runs. With
        ``strict=True`` (or ``POPTORCH_IPU_MODEL_STRICT_MEMORY=1``) compilation raises
        ``poptorch.Error`` (``type == "poplar_out_of_memory"``) instead. The engine
        option ``debug.allowOutOfMemory`` (set by ``enableProfiling``) wins over both.
        Not a PopTorch option. Returns self. ``AssertionError`` unless a bool."""
        check_bool("ipuModelStrictMemory", strict)
        return self.createOrSet(ipu_model_strict_memory=strict)

    def connectionType(self, connection_type: enums.ConnectionType):
        """When to attach the device (key ``connection_type``, stored as int,
        default 0 = ``Always``). Returns self. ``AssertionError`` unless a
        ``ConnectionType``. docs/semantics.md S-80."""
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
        ``AssertionError`` if not an int; ``ValueError`` if negative. docs/semantics.md S-83."""
        if not isinstance(ipu_id, int) or isinstance(ipu_id, bool):
            raise AssertionError(f"ipu_id must be an integer, got {type(ipu_id)}")
        check_int("useIpuId", ipu_id, 0)
        return self.createOrSet(ipu_id=ipu_id)

    def useOfflineIpuTarget(self, ipu_version: int = 2):
        """Compile for an IPU without attaching (``connection_type = Never``, key
        ``ipu_version`` created: 1 = Mk1, 2 = Mk2, 21 = Mk2 with FP8). Returns self.
        docs/semantics.md S-81. ``ValueError`` for another version (``AssertionError`` if not an
        int)."""
        check_type("useOfflineIpuTarget", ipu_version, int)
        if ipu_version not in (1, 2, 21):
            raise ValueError("useOfflineIpuTarget: ipu_version must be 1 (Mk1), 2 (Mk2) "
                             f"or 21 (Mk2 with FP8), got {ipu_version}")
        self.connectionType(enums.ConnectionType.Never)
        return self.createOrSet(ipu_version=ipu_version)

    def enableStableNorm(self, enabled: bool):
        """Backend ``enableStableNorm``. Returns self. ``AssertionError`` unless a
        bool."""
        check_bool("enableStableNorm", enabled)
        self._popart.set("enableStableNorm", enabled)
        return self

    def enableSyntheticData(self, enabled: bool):
        """Backend ``syntheticDataMode`` = 2 if enabled else 0 (no host I/O). Returns
        self. docs/semantics.md S-84. ``AssertionError`` unless a bool."""
        check_bool("enableSyntheticData", enabled)
        self._popart.set("syntheticDataMode", 2 if enabled else 0)
        return self

    def logCycleCount(self, log_cycle_count: bool):
        """Backend ``instrumentWithHardwareCycleCounter`` (hardware only). Returns
        self. ``AssertionError`` unless a bool."""
        check_bool("logCycleCount", log_cycle_count)
        self._popart.set("instrumentWithHardwareCycleCounter", log_cycle_count)
        return self

    def enableProfiling(self, profile_dir: Optional[str] = None):
        """Merge ``debug.allowOutOfMemory="true"``, ``autoReport.directory=<dir or
        ".">`` and ``autoReport.all="true"`` into the backend ``engineOptions``.
        Warns if ``POPLAR_ENGINE_OPTIONS`` already sets one of them (the environment
        wins). Returns self. docs/semantics.md S-85. ``AssertionError`` unless a str, path or
        None."""
        check_type("enableProfiling", profile_dir, (str, os.PathLike, type(None)))
        env = _env.engine_options_text()
        for key in ("debug.allowOutOfMemory", "autoReport.directory", "autoReport.all"):
            if key in env:
                logger.warning("%s is already set in POPLAR_ENGINE_OPTIONS: the value from "
                               "the environment takes precedence over enableProfiling()",
                               key)
        engine_options = dict(self._popart.options.get("engineOptions", {}))
        engine_options.update({
            "debug.allowOutOfMemory": "true",
            "autoReport.directory": os.fspath(profile_dir) if profile_dir else ".",
            "autoReport.all": "true",
        })
        self._popart.setEngineOptions(engine_options)
        return self
