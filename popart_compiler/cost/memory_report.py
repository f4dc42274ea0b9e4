"""The out-of-memory report of the IPU Model: the text of the warning (or, in strict
mode, the error) for a program that does not fit, naming each IPU that does not fit,
the bytes needed and available, the largest categories and tensors, and the options
that would help."""
from __future__ import annotations

from typing import Optional, Sequence

from popart_compiler.cost.ipu_model import IpuTarget
from popart_compiler.cost.memory_model import IpuMemory, MemorySettings

__all__ = ["out_of_memory_message", "memory_problem"]


def _mb(size: float) -> str:
    return f"{size / 1e6:,.1f} MB"


def out_of_memory_message(memory: Sequence[IpuMemory], target: IpuTarget,
                          settings: MemorySettings, micro_batch: Optional[int] = None) -> str:
    """The text of the out-of-memory error for the IPUs that do not fit."""
    lines = []
    over = [m for m in memory if not m.fits]
    for m in over:
        ranked = sorted(m.categories.items(), key=lambda kv: -kv[1])
        consumers = ", ".join(f"{k} {_mb(v)}" for k, v in ranked[:4] if v > 0)
        tensors = ", ".join(f"{n} ({c}, {_mb(b)})" for n, c, b in m.largest[:3])
        lines.append(
            f"Out of memory on IPU {m.ipu}: the program needs {int(m.total):,} bytes "
            f"({_mb(m.total)}) but an IPU of the {target.name} IPU Model has "
            f"{m.capacity:,} bytes ({_mb(m.capacity)}: {target.tiles} tiles × "
            f"{target.sram_per_tile // 1024} KiB). Largest consumers: {consumers}. "
            f"Largest tensors: {tensors}.")
    worst = over[0].categories if over else {}
    helps = ["place the model on more IPUs (poptorch.BeginBlock / Block with "
             "Options.setExecutionStrategy)"]
    if settings.training and worst.get("activations", 0) + worst.get("pipeline stash", 0):
        helps.append("recomputation (poptorch.recomputationCheckpoint, or "
                     "Options._Popart.set(\"autoRecomputation\", 3))")
    if worst.get("optimizer state", 0) or worst.get("gradient accumulators", 0):
        helps.append("optimizer state and accumulators off chip (Options.TensorLocations."
                     "setOptimizerLocation(poptorch.TensorLocationSettings()."
                     "useOnChipStorage(False)), with useReplicatedTensorSharding(True) "
                     "when replicated)")
    if worst.get("temporaries", 0):
        helps.append("serialised matmuls (poptorch.serializedMatMul) or a lower "
                     "available memory proportion (Options.setAvailableMemoryProportion, "
                     "poptorch.set_available_memory)")
    if worst.get("activations", 0) or worst.get("pipeline stash", 0):
        helps.append("a smaller micro-batch" +
                     (f" (now {micro_batch})" if micro_batch else ""))
    lines.append("Options that would help: " + "; ".join(helps) + ".")
    return "\n".join(lines)


def memory_problem(memory: Sequence[IpuMemory], target: IpuTarget, settings: MemorySettings,
                   micro_batch: Optional[int] = None) -> Optional[str]:
    """The text of the out-of-memory report, or ``None`` when the program fits.

    An IPU whose on-chip total exceeds its capacity gives :func:`out_of_memory_message`;
    off-chip tensors beyond the target's streaming memory give the
    "Out of streaming memory" text.
    """
    if not all(m.fits for m in memory):
        return out_of_memory_message(memory, target, settings, micro_batch)
    off = sum(m.off_chip for m in memory)
    if off > target.streaming_memory_bytes * max(1, len(memory)):
        return (f"Out of streaming memory: {int(off):,} bytes are placed off chip but the "
                f"{target.name} IPU Model has {target.streaming_memory_bytes:,} bytes of "
                "streaming memory per IPU. Keep these tensors on chip "
                "(TensorLocationSettings().useOnChipStorage(True)).")
    return None
