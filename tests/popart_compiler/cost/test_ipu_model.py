"""popart_compiler/cost/ipu_model.py: the targets' figures and target_for()."""
import pytest

from popart_compiler.cost.ipu_model import SMALL_IPU_TILES, TARGETS, target_for
from popart_compiler.errors import Error


def test_gc200_memory_is_tiles_times_sram_per_tile():
    ipu2 = TARGETS["ipu2"]
    assert (ipu2.tiles, ipu2.sram_per_tile) == (1472, 624 * 1024)
    assert ipu2.memory_bytes == 1472 * 624 * 1024  # ~898 MiB
    assert TARGETS["ipu1"].memory_bytes == 1216 * 256 * 1024


def test_bow_differs_from_gc200_by_clock_and_links():
    ipu2, bow = TARGETS["ipu2"], TARGETS["ipu21"]
    assert bow.tiles == ipu2.tiles and bow.sram_per_tile == ipu2.sram_per_tile
    assert (bow.clock_hz, ipu2.clock_hz) == (1.85e9, 1.33e9)
    # the same exchange bytes per cycle at the higher clock
    assert bow.exchange_bytes_per_s / bow.clock_hz == pytest.approx(
        ipu2.exchange_bytes_per_s / ipu2.clock_hz)
    assert bow.ipu_link_bytes_per_s == 640e9 and TARGETS["ipu1"].streaming_memory_bytes == 0


def test_target_for_picks_a_version_and_the_small_model():
    assert target_for() is TARGETS["ipu2"]
    small = target_for("ipu21", small=True)
    assert small.tiles == SMALL_IPU_TILES == 4 and small.name == "ipu21 (small)"
    assert small.clock_hz == TARGETS["ipu21"].clock_hz
    with pytest.raises(Error, match="Invalid IPU model version. Valid versions: ipu1"):
        target_for("ipu3")
