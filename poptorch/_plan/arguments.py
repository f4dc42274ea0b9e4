"""The checks of :func:`poptorch.plan`'s arguments, all made before anything is captured.

Each bad value raises a ``poptorch.Error`` that names the argument (its Python name:
the command line shows its flag instead, see :mod:`.cli`), the values it takes and the
value given. Messages only name arguments as they were given or as what to change.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, List, Sequence, Tuple

import torch
import torch.nn as nn

from popart_compiler.errors import Error, py_error
from poptorch.options import Options

__all__ = ["bad_argument", "check_arguments", "micro_batches_to_try", "check_fits_units"]


def bad_argument(name: str, allowed: str, value: Any) -> Error:
    """``poptorch.plan: <name> must be <allowed>, got <value>``."""
    return py_error(f"poptorch.plan: {name} must be {allowed}, got {value!r}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _flag(name: str, value: Any, none: bool = False) -> None:
    if not (isinstance(value, bool) or (none and value is None)):
        raise bad_argument(name, "True or False" + (" or None" if none else ""), value)


def _proportions(value: Any) -> Tuple[float, ...]:
    allowed = "a non-empty list of proportions in (0, 1] (e.g. [0.1, 0.6])"
    values = list(value) if isinstance(value, Iterable) and \
        not isinstance(value, (str, bytes)) else []
    if not values or not all(not isinstance(p, bool) and isinstance(p, numbers.Real) and
                             0 < p <= 1 for p in values):
        raise bad_argument("available_memory_proportions", allowed,
                           values if values else value)
    return tuple(float(p) for p in values)


def micro_batches_to_try(micro_batch: Any, example_inputs: Sequence) -> List[int]:
    """The micro-batch sizes to try: ``micro_batch`` (an int or a non-empty sequence of
    ints ≥ 1), else the batch of the examples (the first dimension of the first tensor
    that has one)."""
    if micro_batch is None:
        for t in example_inputs:
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                return [int(t.shape[0])]
        raise py_error("poptorch.plan needs at least one tensor input with a batch "
                       "dimension (the first dimension of one micro-batch)")
    allowed = "a positive integer or a non-empty list of positive integers"
    sizes = [micro_batch] if not isinstance(micro_batch, (list, tuple, range)) \
        else list(micro_batch)
    if not sizes or not all(_positive_int(b) for b in sizes):
        raise bad_argument("micro_batch", allowed, micro_batch)
    return [int(b) for b in sizes]


def check_arguments(model: Any, example_inputs: Tuple, options: Any, optimizer: Any,
                    ipus: Any, training: Any, global_batch: Any,
                    available_memory_proportions: Any, serialize: Any,
                    recomputation: Any, head_on_first_ipu: Any,
                    optimizer_state_on_chip: Any, time_limit: Any) -> Tuple[float, ...]:
    """Check :func:`poptorch.plan`'s arguments (``micro_batch`` is checked by
    :func:`micro_batches_to_try`); returns the proportions as floats.

    Raises:
        Error: ``model`` not an ``nn.Module``; no example inputs; ``options`` not
            ``poptorch.Options``; ``optimizer`` not a ``torch.optim.Optimizer``;
            ``ipus`` / ``global_batch`` not positive integers; a flag not a bool;
            ``available_memory_proportions`` empty or a value outside ``(0, 1]``;
            ``time_limit`` not a non-negative number of seconds.
    """
    if not isinstance(model, nn.Module):
        raise bad_argument("model", "a torch.nn.Module (whose forward returns the loss "
                           "in training)", model)
    if not example_inputs:
        raise py_error("poptorch.plan needs the model's example inputs (one micro-batch): "
                       "poptorch.plan(model, *example_inputs, ...)")
    if options is not None and not isinstance(options, Options):
        raise bad_argument("options", "a poptorch.Options or None", options)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise bad_argument("optimizer", "a torch.optim.Optimizer (e.g. "
                           "poptorch.optim.Adam(model.parameters())) or None", optimizer)
    if not _positive_int(ipus):
        raise bad_argument("ipus", "a positive integer (IPUs per replica)", ipus)
    if global_batch is not None and not _positive_int(global_batch):
        raise bad_argument("global_batch", "a positive integer (samples per weight update "
                           "of all replicas)", global_batch)
    for name, value in (("training", training), ("serialize", serialize),
                        ("recomputation", recomputation),
                        ("head_on_first_ipu", head_on_first_ipu)):
        _flag(name, value)
    _flag("optimizer_state_on_chip", optimizer_state_on_chip, none=True)
    if isinstance(time_limit, bool) or not isinstance(time_limit, numbers.Real) or \
            math.isnan(time_limit) or time_limit < 0:
        raise bad_argument("time_limit", "a non-negative number of seconds", time_limit)
    return _proportions(available_memory_proportions)


def check_fits_units(model: nn.Module, ipus: int, unit_names: Sequence[str]) -> None:
    """Every IPU of a pipeline holds at least one unit: refuse more IPUs than units.

    Raises:
        Error: ``ipus`` exceeds the number of units (the message gives the units found
            and the most IPUs they allow).
    """
    n = len(unit_names)
    if ipus <= n:
        return
    shown = ", ".join(unit_names) if n <= 8 else \
        ", ".join(unit_names[:4]) + ", ..., " + ", ".join(unit_names[-2:])
    raise py_error(
        f"poptorch.plan: ipus is {ipus}, but {type(model).__name__} has only {n} units to "
        f"place ({shown}) and every IPU holds at least one, so they allow at most {n} "
        f"IPUs per replica. Use ipus <= {n}, or replicas (Options.replicationFactor) to "
        "use more IPUs.")
