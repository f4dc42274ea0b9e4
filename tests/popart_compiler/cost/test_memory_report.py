"""popart_compiler/cost/memory_report.py: the out-of-memory texts and which options
they suggest."""
from popart_compiler.cost.ipu_model import TARGETS
from popart_compiler.cost.memory_model import CATEGORIES, IpuMemory, MemorySettings
from popart_compiler.cost.memory_report import memory_problem, out_of_memory_message

IPU2 = TARGETS["ipu2"]


def _ipu(ipu, **categories):
    cats = {k: 0.0 for k in CATEGORIES}
    cats.update({k.replace("_", " "): v for k, v in categories.items()})
    return IpuMemory(ipu, 1000, cats, 0.0, [("big", "activations", 700.0)])


def test_a_program_that_fits_has_no_problem():
    assert memory_problem([_ipu(0, weights=900.0)], IPU2, MemorySettings()) is None


def test_the_message_names_the_ipu_sizes_and_largest_tensor():
    text = memory_problem([_ipu(0, weights=10.0), _ipu(1, activations=1500.0)], IPU2,
                          MemorySettings(training=True), micro_batch=8)
    first, helps = text.split("\n")
    assert first.startswith("Out of memory on IPU 1: the program needs 1,500 bytes")
    assert "has 1,000 bytes" in first and "1472 tiles × 624 KiB" in first
    assert "Largest tensors: big (activations, 0.0 MB)" in first
    assert "recomputation" in helps and "a smaller micro-batch (now 8)" in helps
    assert "off chip" not in helps


def test_optimizer_state_suggests_off_chip_storage():
    text = out_of_memory_message([_ipu(0, optimizer_state=2000.0)], IPU2, MemorySettings())
    assert "useOnChipStorage(False)" in text and "recomputation" not in text


def test_too_much_off_chip_is_out_of_streaming_memory():
    ipu1 = TARGETS["ipu1"]  # GC2: no streaming memory
    off = IpuMemory(0, 1000, {"weights": 1.0}, 5.0, [])
    assert memory_problem([off], ipu1, MemorySettings()).startswith(
        "Out of streaming memory: 5 bytes are placed off chip")
