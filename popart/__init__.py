"""PopART's Python names that PopTorch programs import (``import popart``).

PopTorch programs use PopART's enums to fill ``Options._Popart.set(...)``
(``int(popart.SubgraphCopyingStrategy.JustInTime)``, as optimum-graphcore does) and
some import the module without using it. This module provides those enums with
PopART's names and values (:mod:`popart_compiler.popart_enums`); importing it never
fails. PopART's graph-building and session API (``Builder``, ``InferenceSession``,
...) is not provided: using any other name raises :class:`NotProvidedError` naming it.
"""
from __future__ import annotations

from popart_compiler.errors import Error as _Error
from popart_compiler.popart_enums import ENUMS as _ENUMS

__version__ = "3.4.0"

globals().update(_ENUMS)

__all__ = sorted(_ENUMS) + ["NotProvidedError"]


class NotProvidedError(_Error, AttributeError):
    """A PopART API that this package does not provide was used.

    A ``poptorch.Error`` (type ``poptorch_py_error``) that is also an
    ``AttributeError``, so ``hasattr(popart, name)`` is ``False``.
    """


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(f"module 'popart' has no attribute {name!r}")
    raise NotProvidedError(
        f"popart.{name} is not provided: this PopTorch runs on a simulated IPU Model "
        "without PopART, and its 'popart' module only holds PopART's enums for "
        f"Options._Popart.set ({', '.join(sorted(_ENUMS))}). Build the model with "
        "PopTorch instead of PopART's API.")
