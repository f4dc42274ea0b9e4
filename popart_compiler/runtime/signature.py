"""What every process of a distributed run must agree on: a signature of the compiled
program and options, compared at compile
(:meth:`~popart_compiler.runtime.collectives.ProcessGroup.check_consistent`)."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from popart_compiler.enums import ReductionType

if TYPE_CHECKING:
    from popart_compiler.optim.description import OptimizerDescription
    from popart_compiler.stages import Executable

__all__ = ["program_signature", "signature_differences"]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor) or hasattr(value, "shape"):
        return f"{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return str(value)


def program_signature(executable: "Executable",
                      optimizer: Optional["OptimizerDescription"] = None) -> Dict[str, str]:
    """What every process of a distributed training run must agree on, as short
    strings: batching and reduction options, the micro-batch inputs, the parameters,
    the optimizer and a hash of the captured program."""
    o, g = executable.options, executable.graph
    sig = {
        "replicationFactor (local replicas)": str(o.replication_factor),
        "deviceIterations": str(o.device_iterations),
        "Training.gradientAccumulation": str(o.gradient_accumulation),
        "inputReplicaGrouping": f"{o.input_group_size} (type {o.input_group_type})",
        "accumulationAndReplicationReductionType": "Mean" if o.reduction_type is ReductionType.Mean
        else "Sum",
        "meanAccumulationAndReplicationReductionStrategy": str(o.mean_reduction_strategy),
        "broadcastBuffers": str(o.broadcast_buffers),
        "automatic loss scaling": str(o.auto_loss_scaling),
        "replica-grouped weights": str(sorted(
            (k, v.comm_group_type, v.shards) for k, v in o.replica_groupings.items())),
        "the model's program (sha256 of the captured graph)":
            hashlib.sha256(g.module.code.encode()).hexdigest()[:16],
    }
    for i, info in enumerate(g.user_inputs):
        sig[f"micro-batch input {i}"] = _describe(info) if info else "non-tensor"
    for i, (name, trainable) in enumerate(zip(g.parameters, g.trainable)):
        value = g.placeholders[i].meta.get("val")
        sig[f"parameter {name}"] = _describe(value) + ("" if trainable else " frozen")
    if optimizer is not None:
        sig["optimizer"] = " / ".join(optimizer.describe())
    return sig


def signature_differences(signatures: List[Dict[str, str]], shown: int = 8) -> List[str]:
    """What differs between process 0's signature (``signatures[0]``) and the first
    process whose signature differs: ``["<key> is <value> in process 0 but <value> in
    process <i>", ...]``, at most ``shown`` entries and a count of the rest; ``[]``
    when every process compiled the same program."""
    reference = signatures[0]
    for rank, other in enumerate(signatures[1:], start=1):
        differences = [f"{key} is {reference.get(key, 'absent')} in process 0 but "
                       f"{other.get(key, 'absent')} in process {rank}"
                       for key in sorted(set(reference) | set(other))
                       if reference.get(key, "absent") != other.get(key, "absent")]
        if differences:
            more = len(differences) - shown
            return differences[:shown] + ([f"... {more} more"] if more > 0 else [])
    return []
