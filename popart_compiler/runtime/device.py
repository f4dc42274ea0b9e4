"""The IPU Model as a device: selected the way PopTorch selects a device (docs/semantics.md S-64,
S-81, S-82) and acquired; it executes programs with PyTorch kernels (see
:mod:`popart_compiler.runtime.session`)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from popart_compiler.cost.ipu_model import MAX_IPUS, SMALL_IPU_TILES, TARGETS, IpuTarget
from popart_compiler.errors import backend_error
from popart_compiler.logging import logger

__all__ = ["IpuModel", "acquire_device"]


@dataclasses.dataclass
class IpuModel:
    """An attached, simulated multi-IPU device.

    Attributes:
        target: the per-IPU description.
        num_ipus: IPUs of the device (IPUs per replica × replicas).
        small: the 4-tiles-per-IPU model of ``POPTORCH_SMALL_IPU_MODEL``.
        torch_device: where kernels run (``"cpu"`` or ``"cuda"``).
        device_id: the id reported in logs.
    """
    target: IpuTarget
    num_ipus: int = 1
    small: bool = False
    torch_device: str = "cpu"
    device_id: int = 0

    @property
    def tiles_per_ipu(self) -> int:
        return SMALL_IPU_TILES if self.small else self.target.tiles

    @property
    def memory_per_ipu(self) -> int:
        """Bytes of on-chip memory per IPU."""
        return self.tiles_per_ipu * self.target.sram_per_tile


def _round_num_ipus(num_ipus: int, auto_round: bool) -> int:
    """IPUs to reserve on hardware: a power of two (docs/semantics.md S-64; the IPU Model does not
    apply this rule)."""
    rounded = 1 << max(0, num_ipus - 1).bit_length()
    if rounded == num_ipus:
        return num_ipus
    if not auto_round:
        raise backend_error(
            f"The model requests {num_ipus} IPUs but the hardware target must reserve a "
            f"power of 2 IPUs: at least {rounded} IPUs must be reserved. Use a model "
            f"placed on {rounded} IPUs (or another power of two), or call "
            "poptorch.Options().autoRoundNumIPUs(True) to reserve the rounded-up number.")
    logger.warning("The model requests %d IPUs: reserving %d, the next power of 2 "
                   "(autoRoundNumIPUs).", num_ipus, rounded)
    return rounded


def acquire_device(num_ipus: int, version: str = "ipu2", *, use_ipu_model: bool = True,
                   explicit_model_request: Optional[bool] = None, small: bool = False,
                   offline: bool = False, ipu_id: Optional[int] = None,
                   torch_device: str = "cpu",
                   auto_round_num_ipus: bool = False) -> Optional[IpuModel]:
    """Select and acquire the device, as PopTorch does (docs/semantics.md S-64, S-81, S-82).

    Args:
        num_ipus: IPUs needed (per replica × replication factor).
        version: IPU Model version, ``"ipu1"``, ``"ipu2"`` or ``"ipu21"``.
        use_ipu_model: ``False`` asks for physical IPUs, which this machine never has.
        explicit_model_request: ``True`` when the IPU Model was explicitly requested
            (``useIpuModel(True)`` or ``POPTORCH_IPU_MODEL``); used for the offline check.
        small: use the 4-tile IPU Model.
        offline: ``ConnectionType.Never``: compile only, no device is returned.
        ipu_id: a specific device id (``Options.useIpuId``).
        torch_device: where the kernels run.
        auto_round_num_ipus: reserve the next power of two when a hardware target
            (physical IPUs or an offline target) needs one (docs/semantics.md S-64).

    Returns:
        The attached :class:`IpuModel`, or ``None`` for offline compilation.

    Raises:
        Error: more than 64 IPUs; offline compilation with the IPU Model explicitly
            requested; offline targeting of a specific id; a hardware target (physical
            IPUs, or an offline target) asked for a number of IPUs that is not a power
            of two without ``auto_round_num_ipus``; physical IPUs requested.
    """
    if num_ipus > MAX_IPUS:
        raise backend_error(
            f"Too many IPUs requested ({num_ipus}). Experiments that need more than "
            f"{MAX_IPUS} IPUs require distributed execution (Options.Distributed).")
    hardware = not use_ipu_model or (offline and not explicit_model_request)
    if hardware:
        num_ipus = _round_num_ipus(num_ipus, auto_round_num_ipus)
    if offline:
        if explicit_model_request:
            raise backend_error("ConnectionType.Never / poptorch.Options.useOfflineIpuTarget "
                                "not supported for the IPU model")
        if ipu_id is not None:
            raise backend_error("Offline compilation targeting a specific id not supported")
        return None
    if not use_ipu_model:
        raise backend_error(
            f"Failed to acquire {num_ipus} IPU(s)\nNo IPU detected in the system: this "
            "machine only has the IPU Model. Remove Options.useIpuModel(False) to run on it.")
    if version not in TARGETS:
        raise backend_error("Invalid IPU model version. Valid versions: ipu1, ipu2, ipu21.")
    device = IpuModel(TARGETS[version], num_ipus, small, torch_device,
                      ipu_id if ipu_id is not None else 0)
    logger.debug("Attached to IPU Model device %d (%s, %d IPU(s))", device.device_id,
                 version, num_ipus)
    return device
