"""The structure the planner places: a model's repeated layers, the modules with
weights around them, and its vocabulary projections.

* **Repeated layers**: the children of ``nn.ModuleList`` / ``nn.Sequential``
  containers (children named ``0``, ``1``, ...), grouped by class; the class whose
  instances hold the most parameters (at least two instances, none inside another)
  gives the layers: BERT's ``BertLayer``, GPT-2's ``GPT2Block``, ResNet's
  bottlenecks, the ``nn.Linear`` layers of an MLP.
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
           "SERIALIZATION_FACTORS"]

#: Outputs from which an untied ``nn.Linear`` counts as a vocabulary projection.
VOCABULARY = 16384
#: Serialisation factors tried for a vocabulary projection (those dividing its outputs).
SERIALIZATION_FACTORS = (1, 2, 4, 8, 16)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def repeated_layers(model: nn.Module) -> List[str]:
    """Paths of the repeated layers of ``model``, in module order.

    Raises:
        poptorch.Error: no container holds two modules of one class.
    """
    groups: Dict[type, List[Tuple[str, nn.Module]]] = {}
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        for name, child in module.named_children():
            if name.isdigit() and _params(child):
                full = f"{path}.{name}" if path else name
                groups.setdefault(type(child), []).append((full, child))
    best: List[str] = []
    best_size = 0
    for members in groups.values():
        paths = [p for p, _ in members]
        # instances nested in another instance of the class are not layers
        outer = [(p, m) for p, m in members
                 if not any(p != q and p.startswith(q + ".") for q in paths)]
        size = sum(_params(m) for _, m in outer)
        if len(outer) >= 2 and (size, len(outer)) > (best_size, len(best)):
            best, best_size = [p for p, _ in outer], size
    if not best:
        raise py_error(
            f"poptorch.plan found no repeated layers in {type(model).__name__}: it places "
            "the modules of a torch.nn.ModuleList or torch.nn.Sequential (two or more "
            "of one class, with parameters). Keep the model's layers in such a "
            "container.")
    return best


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
