"""The IPU Model's targets: the public figures of each IPU version (GC2, GC200, Bow) that
the memory and cycle estimates are built from (``shared/docs/ipu-hardware.md``; which
figures are published, estimated or fitted is said beside each). The simulated device
is :mod:`popart_compiler.runtime.device`.
"""
from __future__ import annotations

import dataclasses

from popart_compiler.errors import backend_error

__all__ = ["IpuTarget", "TARGETS", "MAX_IPUS", "SMALL_IPU_TILES", "target_for"]

#: Tiles per IPU of the small IPU Model (``POPTORCH_SMALL_IPU_MODEL``,
#: docs/api-sections.md options §8).
SMALL_IPU_TILES = 4

#: Largest number of IPUs one process may request (docs/semantics.md S-64).
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
            ≈ 8 TB/s, about 4 bytes per tile per cycle; no published GC2 / Bow
            figure: Bow, the same tile design at a higher clock, is assumed to move
            the same bytes per cycle, 8 TB/s × 1.85 / 1.33; GC2 uses 8 TB/s).
        ipu_link_bytes_per_s: IPU-Link bandwidth of one IPU, all links together
            (GC200: 320 GB/s; Bow: 10 links × 512 Gb/s; GC2: GC200's, unverified).
        host_link_bytes_per_s: host link (PCIe Gen4 x16, 64 GB/s).
        streaming_bytes_per_s: streaming-memory (off-chip DRAM) bandwidth per IPU.
            No published figure: 20 GB/s is our assumption (DDR4 behind the gateway).
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
    """The target of ``POPTORCH_IPU_MODEL_VERSION`` / ``useOfflineIpuTarget``
    (docs/semantics.md S-82).

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
