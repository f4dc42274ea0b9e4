"""User-defined argument types (docs/api-sections.md api §2.10, §2.11)."""
from __future__ import annotations

import abc
from typing import Any, Dict, Iterator, Optional

import torch

from popart_compiler.errors import py_error

__all__ = ["ICustomArgParser", "registerCustomArgParser", "getCustomArgParser"]


class ICustomArgParser(abc.ABC):
    """Lets PopTorch pass and return objects of a user type.

    Subclasses implement :meth:`yieldTensors` and :meth:`reconstruct`; register an
    instance with :func:`registerCustomArgParser`. Same contract as PopTorch.
    """

    @abc.abstractmethod
    def yieldTensors(self, struct) -> Iterator[torch.Tensor]:
        """Yield every ``torch.Tensor`` inside ``struct`` in a deterministic order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure, tensor_iterator: Iterator[torch.Tensor]):
        """Return a new object shaped like ``original_structure`` whose tensors are taken,
        in :meth:`yieldTensors` order, from ``tensor_iterator``."""


_PARSERS: Dict[type, ICustomArgParser] = {}


def registerCustomArgParser(arg_data_type: type,
                            arg_parser: Optional[ICustomArgParser]) -> None:
    """Register (or replace) the parser for ``arg_data_type``; ``None`` removes it.

    Raises:
        poptorch.Error: "arg_parser must inherit from ICustomArgParser" if ``arg_parser``
            is neither ``None`` nor an :class:`ICustomArgParser` instance.
    """
    if arg_parser is None:
        _PARSERS.pop(arg_data_type, None)
        return
    if not isinstance(arg_parser, ICustomArgParser):
        raise py_error("arg_parser must inherit from ICustomArgParser")
    _PARSERS[arg_data_type] = arg_parser


def registered_parsers() -> Dict[type, ICustomArgParser]:
    """A copy of the registry: type → parser (the accessor hands them to its worker)."""
    return dict(_PARSERS)


def getCustomArgParser(obj: Any) -> Optional[ICustomArgParser]:
    """The parser registered for ``type(obj)`` (exact type first, then ``isinstance``)."""
    if not _PARSERS:
        return None
    parser = _PARSERS.get(type(obj))
    if parser is not None:
        return parser
    for t, p in _PARSERS.items():
        if isinstance(obj, t):
            return p
    return None
