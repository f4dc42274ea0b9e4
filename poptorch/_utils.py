"""PopTorch's ``_utils`` names that its clients import (PopTorch Geometric's loaders:
``combine_batch_tensors_gen``); the helpers live in
:mod:`poptorch._compat.tensor_structures`."""
from poptorch._compat.tensor_structures import (  # noqa: F401
    combine_batch_tensors_gen, combined_batch_generator, flattenTensorStructure,
    reconstructTensorStructure)

__all__ = ["combine_batch_tensors_gen", "combined_batch_generator",
           "flattenTensorStructure", "reconstructTensorStructure"]
