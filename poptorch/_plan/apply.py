"""Applying a plan: the model's blocks, checkpoints and serialised projections, and the
options.

:func:`apply_to_model` removes the model's ``BeginBlock``\\ s (and those of an earlier
plan), starts one block at the first unit of every IPU (and at the head, on IPU 0),
puts a ``recomputationCheckpoint`` on the outputs of the layers the plan checkpoints
(the same forward hook as the planning capture's) and computes each vocabulary
projection with :class:`~poptorch._plan.capture.SerializedLinear` at the plan's factor.
:func:`apply_to_options` sets the execution strategy, gradient accumulation (or device
iterations), available memory proportions and optimizer-state location.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch.nn as nn

from poptorch._ops.blocks import BeginBlock, removeBlocks
from poptorch._options.execution_strategy import PipelinedExecution
from poptorch._options.groups import TensorLocationSettings
from poptorch._plan.capture import SerializedLinear, _swap, checkpoint_outputs
from poptorch.enums import AutoStage
from poptorch.options import Options

__all__ = ["apply_to_model", "apply_to_options"]

#: Attribute of a planned model holding the hooks its plan added.
_HANDLES = "_poptorch_plan_handles"


def apply_to_model(model: nn.Module, blocks: Sequence[Tuple[str, int]],
                   checkpointed: Sequence[str], serialization: Dict[str, int]) -> nn.Module:
    """Annotate ``model`` in place.

    Args:
        model: the model the plan was made for.
        blocks: ``(module path, ipu)`` of every block start, in order.
        checkpointed: paths of the layers whose outputs are checkpoints.
        serialization: vocabulary projection path → serialisation factor.

    Returns:
        ``model``.
    """
    for handle in getattr(model, _HANDLES, []):
        handle.remove()
    removeBlocks(model)
    for path, factor in serialization.items():
        module = model.get_submodule(path)
        if isinstance(module, SerializedLinear):
            module.factor = factor
        else:
            _swap(model, path, SerializedLinear(module, factor))
    handles: List = []
    for index, (path, ipu) in enumerate(blocks):
        BeginBlock(model.get_submodule(path), f"plan{index}", ipu_id=ipu)
    for path in checkpointed:
        handles.append(model.get_submodule(path).register_forward_hook(checkpoint_outputs()))
    object.__setattr__(model, _HANDLES, handles)
    return model


def apply_to_options(options: Options, training: bool, num_ipus: int,
                     micro_batches: int, proportions: Sequence[float],
                     optimizer_on_chip: Optional[bool]) -> Options:
    """Set the plan's options on ``options`` (returned)."""
    if num_ipus > 1:
        options.setExecutionStrategy(
            PipelinedExecution(AutoStage.AutoIncrement))
    if training:
        options.Training.gradientAccumulation(micro_batches)
    else:
        options.deviceIterations(micro_batches)
    options.setAvailableMemoryProportion({f"IPU{i}": p for i, p in enumerate(proportions)})
    if optimizer_on_chip is not None:
        options.TensorLocations.setOptimizerLocation(
            TensorLocationSettings().useOnChipStorage(optimizer_on_chip)
            .useReplicatedTensorSharding(options.replication_factor > 1))
    return options
