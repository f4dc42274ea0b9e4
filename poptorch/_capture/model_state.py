"""The model's host state around a capture: parameters and buffers must keep their
identity (docs/semantics.md S-5) and are put back if a capture fails, float64 weights
are held as float32 while capturing (S-44), the user's container attributes survive
``torch.export``, and plain tensor attributes are baked as constants with their values
from before the capture (S-1)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch

from popart_compiler.errors import py_error
from poptorch._logging import logger

__all__ = ["plain_tensor_attributes", "device_weights", "state_identity",
           "check_state_unchanged", "restore_state", "container_attributes",
           "restore_containers", "as_plain_module", "bake_constants"]

#: ``(parameters, buffers)`` by qualified name, as :func:`state_identity` returns them.
StateIdentity = Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]


def plain_tensor_attributes(model: torch.nn.Module) -> Dict[int, torch.Tensor]:
    """id → clone of every tensor attribute that is neither a parameter nor a buffer."""
    found = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                found[id(value)] = value.detach().clone()
    return found


@contextlib.contextmanager
def device_weights(model: torch.nn.Module) -> Iterator[None]:
    """Hold float64 parameters and buffers as float32 during capture (docs/semantics.md S-44)."""
    swapped: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for t in list(model.parameters()) + list(model.buffers()):
        if t.dtype == torch.float64 and all(t is not s for s, _ in swapped):
            swapped.append((t, t.data))
            t.data = t.data.float()
    if swapped:
        logger.warning("[DISPATCHER] Type coerced from Double to Float for %d model "
                       "tensor(s): the IPU has no 64-bit floating point type",
                       len(swapped))
    try:
        yield
    finally:
        for t, data in swapped:
            t.data = data


def state_identity(model: torch.nn.Module) -> StateIdentity:
    """The model's parameters and buffers by qualified name (duplicates kept)."""
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    buffers = {n: b for n, b in model.named_buffers(remove_duplicate=False)}
    return params, buffers


def check_state_unchanged(model: torch.nn.Module, before: StateIdentity) -> None:
    """docs/semantics.md S-5: parameters and buffers must be neither removed nor reassigned.

    Raises:
        poptorch.Error: a parameter or buffer of ``before`` was removed or reassigned
            (batch norms' buffers excepted).
    """
    params0, buffers0 = before
    params1, buffers1 = state_identity(model)
    bn_types = (torch.nn.modules.batchnorm._NormBase,)
    exempt = {name for name, m in model.named_modules() if isinstance(m, bn_types)}

    def owner(name):
        return name.rpartition(".")[0]

    for kind, old, new in (("Buffer", buffers0, buffers1), ("Parameter", params0, params1)):
        for name, tensor in old.items():
            if kind == "Buffer" and owner(name) in exempt:
                continue
            if name not in new:
                raise py_error(f"{kind} {name} is removed from the model when calling the "
                               "forward method.")
            if new[name] is not tensor:
                attr = name.rpartition(".")[2]
                raise py_error(
                    f"{kind} {name} is reassigned within the model when calling the forward "
                    f"method. This is not supported. Consider using self.{attr}.copy_(src) "
                    f"to copy data from a source tensor, where src is the name of the "
                    "source tensor.")


def restore_state(model: torch.nn.Module, before: StateIdentity) -> None:
    """Put the parameters and buffers of ``before`` back into the model."""
    params0, buffers0 = before
    for kind, table in (("_parameters", params0), ("_buffers", buffers0)):
        for name, tensor in table.items():
            path, _, attr = name.rpartition(".")
            module = model.get_submodule(path) if path else model
            getattr(module, kind)[attr] = tensor


#: Attributes every ``nn.Module`` has (its own bookkeeping, never the user's).
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def container_attributes(model: torch.nn.Module) -> List[Tuple[Dict[str, Any], str, Any]]:
    """``(vars(module), name, value)`` of every dict / list / set / tuple attribute of
    the user's modules."""
    found = []
    for module in model.modules():
        attrs = vars(module)
        for name, value in attrs.items():
            if name not in _MODULE_INTERNALS and isinstance(value, (dict, list, set, tuple)):
                found.append((attrs, name, value))
    return found


def restore_containers(found: List[Tuple[Dict[str, Any], str, Any]]) -> None:
    """Put back the user's container objects: ``torch.export`` rebuilds containers it
    traces through and writes the copies back into the module, after which edits the
    user makes to the original (``model.cfg["flag"] = True``) would not be seen."""
    for attrs, name, value in found:
        if name in attrs and attrs[name] is not value:
            attrs[name] = value


def as_plain_module(model: torch.nn.Module) -> Callable[[], None]:
    """``torch.export`` runs a ``torch.fx.GraphModule`` root with an fx Interpreter,
    bypassing the instance's ``forward`` that the capture installs: present such a
    root as a plain ``nn.Module`` while capturing (its generated ``forward``, bound
    beforehand, still runs). Returns the undo function."""
    if not isinstance(model, torch.fx.GraphModule):
        return lambda: None
    original = model.__class__
    model.__class__ = type("GraphModuleRoot", (torch.nn.Module,), {})

    def undo():
        model.__class__ = original
    return undo


def bake_constants(program, before: Dict[int, torch.Tensor]) -> None:
    """Constants hold their capture-time values (docs/semantics.md S-1): undo in-place updates made
    to plain tensor attributes while capturing, in the program's copies only.

    Args:
        program: the ``torch.export.ExportedProgram`` (its ``constants`` are replaced).
        before: :func:`plain_tensor_attributes` of the model before the capture.
    """
    for name, value in list(program.constants.items()):
        if isinstance(value, torch.Tensor) and id(value) in before:
            program.constants[name] = before[id(value)]
