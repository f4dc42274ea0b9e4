"""Context managers that annotate the ops created inside them
(docs/api-sections.md api §8.17–§8.19): ``NameScope`` (tensor names, docs/semantics.md S-16),
``Attribute`` (backend attributes) and ``MultiConv`` (convolutions planned together).

Annotations are written with ``torch.fx.traceback.annotate`` and land in
``node.meta["custom"]`` of every node captured inside the scope: ``"name_scope"``
(``"a/b"``) with ``"name_scopes"`` (each name and the sub-module depth it was entered
at, so tensor names interleave module paths and name scopes in order),
``"attributes"`` (the merged dict) and ``"multi_conv"`` (the MultiConv's settings plus
an ``"id"`` per ``with`` block). Outside a capture they change nothing.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from popart_compiler.ir import module_path_parts
from popart_compiler.errors import py_error
from poptorch import enums
from poptorch._impl import isRunningOnIpu

__all__ = ["NameScope", "Attribute", "MultiConv"]

_name_stack: List[Tuple[str, int]] = []
_attribute_stack: List[Dict[str, Dict[str, Any]]] = [{}]
_multi_conv_ids = itertools.count()
_multi_conv_stack: List[int] = []


def _module_depth() -> int:
    """Sub-module depth of the ``forward`` being captured (0: the model's own), read
    from the capture's module stack; 0 outside a capture."""
    stack = getattr(getattr(get_proxy_mode(), "tracer", None), "module_stack", None)
    if not stack:
        return 0
    path = str(list(stack.values())[-1][0])
    return len(module_path_parts(path.replace("_export_root", "", 1)))


class _Annotating:
    """Base of the scopes: ``__enter__`` pushes ``self._new_state()`` on the class's
    module-level ``_states`` stack, then enters
    ``torch.fx.traceback.annotate(self._annotation())``; ``__exit__`` undoes both."""

    _states: List[Any] = []

    def __init__(self) -> None:
        self._stack: List[contextlib.ExitStack] = []

    def _new_state(self) -> Any:
        raise AssertionError("subclasses define their state")

    def _annotation(self) -> Dict[str, Any]:
        raise AssertionError("subclasses define the annotation")

    def __enter__(self):
        self._states.append(self._new_state())
        stack = contextlib.ExitStack()
        stack.enter_context(fx_traceback.annotate(self._annotation()))
        self._stack.append(stack)
        return self

    def __exit__(self, *exc) -> bool:
        self._stack.pop().close()
        self._states.pop()
        return False


class NameScope(_Annotating):
    """Prefix the names of the ops created inside with ``name/`` (docs/api-sections.md api §8.18,
    docs/semantics.md S-16).

    Nested scopes concatenate (``outer/inner/``). Only tensor names change
    (``getTensorNames()``, anchors, ``_debugGetPopartIR()``).

    Raises:
        AssertionError: ``name`` is not a string.
    """

    def __init__(self, name: str):
        assert isinstance(name, str), "Parameter to NameScope must be a string"
        super().__init__()
        self.name = name

    _states = _name_stack

    def _new_state(self) -> Tuple[str, int]:
        return self.name, _module_depth()

    def _annotation(self) -> Dict[str, Any]:
        return {"name_scope": "/".join(name for name, _ in _name_stack),
                "name_scopes": [[name, depth] for name, depth in _name_stack]}


class Attribute(_Annotating):
    """Attach backend attributes to the ops created inside (docs/api-sections.md api §8.19).

    Each keyword is an attribute name whose value is a dict of string keys, e.g.
    ``Attribute(__outline={"layer": "embedding"})``. Nested scopes merge; leaving a
    scope restores the previous values. No numerical effect on the IPU Model; the
    merged dict is recorded on the nodes (``node.meta["custom"]["attributes"]``).

    Raises:
        AssertionError: a value that is not a dict with string keys.
    """

    def __init__(self, **kwargs: Dict[str, Any]):
        for name, value in kwargs.items():
            assert isinstance(value, dict) and all(isinstance(k, str) for k in value), \
                f"Attribute {name} must be a dict with string keys"
        super().__init__()
        self.attributes = kwargs

    _states = _attribute_stack

    def _new_state(self) -> Dict[str, Dict[str, Any]]:
        merged = {k: dict(v) for k, v in _attribute_stack[-1].items()}
        for name, value in self.attributes.items():
            merged.setdefault(name, {}).update(value)
        return merged

    def _annotation(self) -> Dict[str, Any]:
        return {"attributes": {k: dict(v) for k, v in _attribute_stack[-1].items()}}


def _float_list(value) -> Optional[List[float]]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, float)
                                                          for v in value):
        return list(value)
    return None


class MultiConv(_Annotating):
    """Convolutions executed inside ``with MultiConv():`` are planned together as one
    multi-convolution (docs/api-sections.md api §8.17). Performance only: the IPU Model evaluates
    each convolution exactly as PyTorch does and records the settings on their nodes.

    The setters return ``self`` (chainable) and must be called before entering.
    ``__enter__`` returns ``None``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._settings: Dict[str, Any] = {}

    def availableMemoryProportions(self, value) -> "MultiConv":
        """Float, or non-empty list/tuple of floats (one per convolution).

        Raises:
            AssertionError: "Invalid available memory proportion!".
        """
        values = _float_list(value)
        assert values is not None and all(0.0 < v <= 1.0 for v in values), \
            "Invalid available memory proportion!"
        self._settings["available_memory_proportions"] = values
        return self

    def partialsTypes(self, value) -> "MultiConv":
        """``torch.float`` / ``torch.half``, or a list of them.

        Raises:
            ValueError: any other partials type.
        """
        values = value if isinstance(value, (list, tuple)) else [value]
        names = {torch.float: "float", torch.half: "half"}  # as PopTorch: no strings
        if not values or any(not isinstance(v, torch.dtype) or v not in names
                             for v in values):
            raise ValueError(f"Invalid partials types: {value!r}. Use torch.float or "
                             "torch.half (or a list of them).")
        self._settings["partials_types"] = [names[v] for v in values]
        return self

    def enableConvDithering(self, value) -> "MultiConv":
        """Bool or list of bools (``None`` clears).

        Raises:
            ValueError: "value must be bool or list of bools".
        """
        if value is None:
            self._settings.pop("enable_conv_dithering", None)
            return self
        values = value if isinstance(value, (list, tuple)) else [value]
        if not values or not all(isinstance(v, bool) for v in values):
            raise ValueError("value must be bool or list of bools")
        self._settings["enable_conv_dithering"] = list(values)
        return self

    def planType(self, value) -> "MultiConv":
        """``MultiConvPlanType`` or ``None``.

        Raises:
            AssertionError: "Invalid plan type!".
        """
        assert value is None or isinstance(value, enums.MultiConvPlanType), \
            "Invalid plan type!"
        self._settings["plan_type"] = None if value is None else value.name
        return self

    def perConvReservedTiles(self, value: int) -> "MultiConv":
        """Tiles reserved per convolution (int).

        Raises:
            AssertionError: not an int.
        """
        assert isinstance(value, int) and not isinstance(value, bool), \
            "perConvReservedTiles must be an int"
        self._settings["per_conv_reserved_tiles"] = value
        return self

    def cycleBackOff(self, value: float) -> "MultiConv":
        """Cycle back-off proportion (float).

        Raises:
            AssertionError: not a float.
        """
        assert isinstance(value, float), "cycleBackOff must be a float"
        self._settings["cycle_back_off"] = value
        return self

    _states = _multi_conv_stack

    def _new_state(self) -> int:
        return next(_multi_conv_ids)

    def _annotation(self) -> Dict[str, Any]:
        return {"multi_conv": dict(self._settings, id=_multi_conv_stack[-1])}

    def __enter__(self) -> None:
        """Raises ``poptorch.Error`` "Nested poptorch.MultiConv is not supported." while
        a model is captured inside another MultiConv (as PopTorch)."""
        if _multi_conv_stack and isRunningOnIpu():
            raise py_error("Nested poptorch.MultiConv is not supported.")
        super().__enter__()

    def __exit__(self, *exc) -> bool:
        """Raises ``poptorch.Error`` "Unexpected end_multi_conv: ..." when a captured
        MultiConv scope contains no convolution (as PopTorch)."""
        ident = _multi_conv_stack[-1] if _multi_conv_stack else None
        super().__exit__(*exc)
        mode = get_proxy_mode()
        if exc[0] is None and isRunningOnIpu() and mode is not None and not any(
                "conv" in str(n.target) and ((n.meta.get("custom") or {}).get(
                    "multi_conv") or {}).get("id") == ident
                for n in mode.tracer.graph.nodes):
            raise py_error("Unexpected end_multi_conv: the poptorch.MultiConv scope "
                           "contains no convolution. Put the convolutions to plan "
                           "together inside it, or remove it.")
        return False
