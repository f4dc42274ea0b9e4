"""Helpers for tests (docs/api-sections.md api §11.2). Not imported by ``import poptorch``."""
import torch

__all__ = ["allclose"]


def allclose(ref, other) -> bool:
    """Recursive ``torch.allclose(other, ref)`` over tensors, tuples and lists.

    Tuples / lists must have the same type and length; other values are compared
    element-wise (the reference's type check is ineffective, and so is this one).
    """
    if isinstance(ref, torch.Tensor):
        return torch.allclose(other, ref)
    if isinstance(ref, (tuple, list)):
        if type(ref) is not type(other) or len(ref) != len(other):
            return False
        return all(allclose(r, o) for r, o in zip(ref, other))
    return ref == other
