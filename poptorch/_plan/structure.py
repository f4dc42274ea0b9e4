"""The structure the planner places: a model's repeated layers, the modules with
weights around them, and its vocabulary projections.

* **Repeated layers**: the children of ``nn.ModuleList`` / ``nn.Sequential``
  containers (children named ``0``, ``1``, ...), grouped by class; the class whose
  instances hold the most parameters (at least two instances, none inside another)
  gives the outer layers: BERT's ``BertLayer``, GPT-2's ``GPT2Block``, ResNet's
  bottlenecks, the ``nn.Linear`` layers of an MLP, a Swin's stages. Where those
  layers hold repeated modules of their own in containers (a Swin stage's blocks),
  the layers are the finer ones, at every depth, as long as the model's units stay
  within ``max_units`` (:data:`MAX_UNITS`): a finer class counts when its instances
  are modules with sub-modules (not a bare ``nn.Linear``), outnumber the layers and
  hold at least half of their parameters; a layer holding none of them stays a
  layer.
* **Other units**: the modules with parameters whose parent contains layers (or is
  the model itself) and that are not layers or containers of layers: embeddings,
  poolers, heads, a stem.
* **Vocabulary projections**: ``nn.Linear`` modules whose weight is an
  ``nn.Embedding``'s weight (a tied decoder or LM head) or with at least
  :data:`VOCABULARY` outputs; the planner may serialise them (Graphcore's
  ``embedding_serialization_factor``).
"""
from __future__ import annotations

from typing import Dict, List, Set, Tuple

import torch.nn as nn

from popart_compiler.errors import py_error

__all__ = ["repeated_layers", "unit_modules", "vocabulary_projections", "VOCABULARY",
           "SERIALIZATION_FACTORS", "MAX_UNITS"]

#: Outputs from which an untied ``nn.Linear`` counts as a vocabulary projection.
VOCABULARY = 16384
#: Serialisation factors tried for a vocabulary projection (those dividing its outputs).
SERIALIZATION_FACTORS = (1, 2, 4, 8, 16)
#: Most units the planner splits a model into when it descends into nested layers.
MAX_UNITS = 64


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _groups(model: nn.Module) -> Dict[type, List[Tuple[str, nn.Module]]]:
    """Class → ``(path, module)`` of the numbered children with parameters of every
    ``nn.ModuleList`` / ``nn.Sequential``, in module order."""
    groups: Dict[type, List[Tuple[str, nn.Module]]] = {}
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        for name, child in module.named_children():
            if name.isdigit() and _params(child):
                full = f"{path}.{name}" if path else name
                groups.setdefault(type(child), []).append((full, child))
    return groups


def _outer(members: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    """The members not nested in another member."""
    paths = [p for p, _ in members]
    return [(p, m) for p, m in members
            if not any(p != q and p.startswith(q + ".") for q in paths)]


def _inside(path: str, outer: str) -> bool:
    return path.startswith(outer + ".")


def _finer(groups, layers: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    """The layers one depth finer (module docstring), or ``[]``."""
    kinds = {type(m) for _, m in layers}
    size = sum(_params(m) for _, m in layers)
    best: List[Tuple[str, nn.Module]] = []
    best_size = 0
    for kind, members in groups.items():
        if kind in kinds:
            continue
        inner = _outer([(p, m) for p, m in members
                        if any(_inside(p, q) for q, _ in layers)
                        and any(True for _ in m.children())])
        inner_size = sum(_params(m) for _, m in inner)
        if len(inner) > len(layers) and 2 * inner_size >= size and inner_size > best_size:
            best, best_size = inner, inner_size
    if not best:
        return []
    kept = [(q, m) for q, m in layers if not any(_inside(p, q) for p, _ in best)]
    return best + kept


def repeated_layers(model: nn.Module, max_units: int = MAX_UNITS) -> List[str]:
    """Paths of the repeated layers of ``model``, in module order (module docstring).

    Args:
        model: the model.
        max_units: descend into nested layers only while the model's units
            (:func:`unit_modules`) stay at most this many.

    Raises:
        poptorch.Error: no container holds two modules of one class.
    """
    groups = _groups(model)
    best: List[Tuple[str, nn.Module]] = []
    best_size = 0
    for members in groups.values():
        outer = _outer(members)
        size = sum(_params(m) for _, m in outer)
        if len(outer) >= 2 and (size, len(outer)) > (best_size, len(best)):
            best, best_size = outer, size
    if not best:
        raise py_error(
            f"poptorch.plan found no repeated layers in {type(model).__name__}: it places "
            "the modules of a torch.nn.ModuleList or torch.nn.Sequential (two or more "
            "of one class, with parameters). Keep the model's layers in such a "
            "container.")
    while True:
        finer = _finer(groups, best)
        if not finer or len(unit_modules(model, [p for p, _ in finer])) > max_units:
            break
        best = finer
    order = {p: i for i, (p, _) in enumerate(model.named_modules())}
    return sorted((p for p, _ in best), key=order.__getitem__)


def unit_modules(model: nn.Module, layers: List[str]) -> List[str]:
    """Paths of every unit's module: the layers, and the modules with parameters whose
    parent is the model or an ancestor of a layer (in module order)."""
    ancestors: Set[str] = {""}
    for path in layers:
        parts = path.split(".")
        ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))
    layer_set = set(layers)
    result = []
    for path, module in model.named_modules():
        if not path or path in ancestors:
            continue
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if path in layer_set or (parent in ancestors and _params(module)):
            result.append(path)
    return result


def vocabulary_projections(model: nn.Module) -> Dict[str, Tuple[int, ...]]:
    """Path of each vocabulary projection → the serialisation factors it allows."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    result = {}
    for path, module in model.named_modules():
        if type(module) is not nn.Linear or not path:
            continue
        if id(module.weight) in tables or module.out_features >= VOCABULARY:
            result[path] = tuple(f for f in SERIALIZATION_FACTORS
                                 if module.out_features % f == 0)
    return result
