"""The IPU Model: the simulated target and its device.

The figures come from ``shared/spec/ipu-hardware.md``. The model executes programs with
PyTorch kernels (see :mod:`popart_compiler.session`); this module describes the target,
selects it the way PopTorch selects a device (spec S-64, S-81, S-82) and acquires it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .errors import backend_error
from .logging import logger

__all__ = ["IpuTarget", "TARGETS", "IpuModel", "MAX_IPUS", "SMALL_IPU_TILES",
           "acquire_device", "target_for"]

#: Tiles per IPU of the small IPU Model (``POPTORCH_SMALL_IPU_MODEL``, options.md §8).
SMALL_IPU_TILES = 4

#: Largest number of IPUs one process may request (S-64).
MAX_IPUS = 64


@dataclasses.dataclass(frozen=True)
class IpuTarget:
    """One IPU's public figures.

    Attributes:
        name: ``"ipu1"`` (GC2), ``"ipu2"`` (GC200) or ``"ipu21"`` (Bow).
        tiles: tiles per IPU.
        sram_per_tile: bytes of SRAM per tile.
        clock_hz: tile clock in Hz.
        fp16_flops: peak float16 FLOP/s of the AMP units with float16 partial sums
            (GC2's 124.5 TFLOP/s is also its float32-accumulate rate, see
            ``amp_units``).
        fp32_flops: peak float32 FLOP/s (the ipu2/ipu21 values are unverified).
        amp_units: AMP units per tile for float16 inputs and float16 partials (poplar
            ``Target::getFp16InFp16OutConvUnitsPerTile``: 8 on GC2, 16 on GC200 / Bow).
            Float32 partials are stored through the tile's 64-bit path, 2 per cycle,
            which limits them to ``AMP_PIPELINE_DEPTH × 2 = 8`` units (poplibs'
            convolution test tool derives the float-partials units this way): half
            the float16 rate on GC200 / Bow, the same rate on GC2.
        exchange_bytes_per_s: all-to-all exchange bandwidth inside one IPU (GC200's
            ≈ 8 TB/s, about 4 bytes per tile per cycle; the spec has no GC2 / Bow
            figure: Bow, the same tile design at a higher clock, is assumed to move
            the same bytes per cycle, 8 TB/s × 1.85 / 1.33; GC2 uses 8 TB/s).
        ipu_link_bytes_per_s: IPU-Link bandwidth of one IPU, all links together
            (GC200: 320 GB/s; Bow: 10 links × 512 Gb/s; GC2: GC200's, unverified).
        host_link_bytes_per_s: host link (PCIe Gen4 x16, 64 GB/s).
        streaming_bytes_per_s: streaming-memory (off-chip DRAM) bandwidth per IPU.
            Not in the spec: 20 GB/s is our assumption (DDR4 behind the gateway).
        streaming_memory_bytes: streaming memory per IPU (448 GB per IPU-M2000 and
            256 GB per Bow-2000, 4 IPUs each; GC2 cards have none).
    """
    name: str
    tiles: int
    sram_per_tile: int
    clock_hz: float
    fp16_flops: float
    fp32_flops: float
    exchange_bytes_per_s: float = 8e12
    ipu_link_bytes_per_s: float = 320e9
    host_link_bytes_per_s: float = 64e9
    streaming_bytes_per_s: float = 20e9
    streaming_memory_bytes: int = 112 * 10 ** 9
    amp_units: int = 16

    @property
    def memory_bytes(self) -> int:
        """On-chip memory of one IPU in bytes (``tiles × sram_per_tile``)."""
        return self.tiles * self.sram_per_tile


TARGETS = {
    "ipu1": IpuTarget("ipu1", 1216, 256 * 1024, 1.6e9, 124.5e12, 31.1e12,
                      streaming_memory_bytes=0, amp_units=8),
    "ipu2": IpuTarget("ipu2", 1472, 624 * 1024, 1.33e9, 250e12, 62.5e12),
    "ipu21": IpuTarget("ipu21", 1472, 624 * 1024, 1.85e9, 350e12, 87e12,
                       exchange_bytes_per_s=8e12 * 1.85 / 1.33,
                       ipu_link_bytes_per_s=10 * 512e9 / 8,
                       streaming_memory_bytes=64 * 10 ** 9),
}


def target_for(version: str = "ipu2", small: bool = False) -> IpuTarget:
    """The target of ``POPTORCH_IPU_MODEL_VERSION`` / ``useOfflineIpuTarget`` (S-82).

    Args:
        version: ``"ipu1"``, ``"ipu2"`` or ``"ipu21"``.
        small: the ``POPTORCH_SMALL_IPU_MODEL`` variant with :data:`SMALL_IPU_TILES`
            tiles per IPU (everything else unchanged).

    Raises:
        Error: an unknown version.
    """
    if version not in TARGETS:
        raise backend_error("Invalid IPU model version. Valid versions: ipu1, ipu2, ipu21.")
    target = TARGETS[version]
    if small:
        target = dataclasses.replace(target, name=f"{version} (small)", tiles=SMALL_IPU_TILES)
    return target


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
    """IPUs to reserve on hardware: a power of two (S-64; the IPU Model does not
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
    """Select and acquire the device, as PopTorch does (S-64, S-81, S-82).

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
            (physical IPUs or an offline target) needs one (S-64).

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
