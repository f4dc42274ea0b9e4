"""Batches combined along their first dimension (``poptorch._utils``'s helpers that
PopTorch Geometric's data loaders and PopTorch's tests use)."""
from __future__ import annotations

from typing import Any, Generator, Iterable, Iterator, List

import torch

from poptorch._capture.args import flatten, unflatten

__all__ = ["flattenTensorStructure", "reconstructTensorStructure",
           "combine_batch_tensors_gen", "combined_batch_generator"]


def flattenTensorStructure(structure: Any) -> List[torch.Tensor]:
    """The tensors of a (nested) tuple / list / dict / custom structure, in order."""
    tensors: List[torch.Tensor] = []
    flatten(structure, tensors)
    return tensors


def reconstructTensorStructure(structure: Any, values: Iterable[torch.Tensor]) -> Any:
    """``structure`` with its tensors replaced, in order, by ``values``."""
    spec = flatten(structure, [])
    return unflatten(spec, iter(values))


def combine_batch_tensors_gen(tensors: List[List[torch.Tensor]]
                              ) -> Generator[torch.Tensor, None, None]:
    """Concatenate batches along dimension 0.

    Args:
        tensors: ``tensors[b][i]`` is tensor ``i`` of batch ``b``; every batch has the
            same number of tensors.

    Yields:
        For each ``i``: ``torch.cat([tensors[0][i], tensors[1][i], ...])``.
    """
    for i in range(len(tensors[0])):
        yield torch.cat([batch[i] for batch in tensors])


def combined_batch_generator(batches: Iterator[Any], num_batches_to_combine: int,
                             drop_last: bool = True) -> Generator[Any, None, None]:
    """Combine every ``num_batches_to_combine`` consecutive batches of ``batches``
    into one (concatenated along dimension 0, same structure). A last, smaller group
    is yielded unless ``drop_last``."""
    group: List[List[torch.Tensor]] = []
    last = None
    for batch in batches:
        group.append(flattenTensorStructure(batch))
        last = batch
        if len(group) == num_batches_to_combine:
            yield reconstructTensorStructure(batch, combine_batch_tensors_gen(group))
            group = []
    if group and not drop_last:
        yield reconstructTensorStructure(last, combine_batch_tensors_gen(group))
