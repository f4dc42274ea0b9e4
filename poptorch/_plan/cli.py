"""``python -m poptorch.plan MODULE:FACTORY --ipus N [--training|--inference]
[--batch B] [--micro-batch M ...] [--replicas R] [--target ipu21] [--report DIR]``

``FACTORY`` (a function or class in the importable module ``MODULE``, or in a file
``path/to/file.py``) is called without arguments and returns either the model, or a
tuple ``(model, example_inputs)`` / ``(model, example_inputs, options)`` /
``(model, example_inputs, options, optimizer)``; without example inputs the model's
``example_inputs()`` method is called. The plan is printed as a table, with the
optimum-graphcore ``IPUConfig`` fields, and the profile report of the chosen plan is
written into ``--report DIR`` (default ``./plan_report``; ``--report ''`` writes none):
``DIR/<model class>/profile.html`` and ``profile.json`` as ``Options.enableProfiling``
writes them. Errors (nothing fits, a bad argument, a factory that cannot be loaded)
print one line ``poptorch.Error: ...`` naming the flag (``--batch``, not
``global_batch``) and exit with status 1.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import sys
from typing import List, Optional

import torch

from popart_compiler.cost.profile_report import write_report
from popart_compiler.errors import Error, py_error
from poptorch._plan.api import plan
from poptorch.options import Options

__all__ = ["main", "load_factory", "for_the_command_line"]

_TARGETS = {"ipu1": 1, "ipu2": 2, "ipu21": 21}


#: ``poptorch.plan``'s arguments that are flags here: the command line shows errors with
#: the flag in place of the argument's name.
_FLAGS = {"global_batch": "--batch", "micro_batch": "--micro-batch", "ipus": "--ipus"}
_ARGUMENT = re.compile(r"\b(%s)\b=?" % "|".join(_FLAGS))


def for_the_command_line(message: str) -> str:
    """``message`` with :func:`~poptorch.plan`'s argument names (``global_batch`` or
    ``global_batch=``) replaced by their flags (``--batch``)."""
    return _ARGUMENT.sub(lambda m: _FLAGS[m.group(1)] + (" " if m.group(0).endswith("=")
                                                         else ""), message)


def _import(module_name: str):
    """The module ``module_name`` (importable, or a ``.py`` file)."""
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise py_error(f"No such file: {module_name} (MODULE of MODULE:FACTORY)")
        _on_path(os.path.dirname(path))
        loaded = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(path))[0], path)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
        return module
    _on_path(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ImportError as error:  # the module, or one it imports, is missing
        raise py_error(f"Cannot import {module_name} (MODULE of MODULE:FACTORY): {error}. "
                       "Give a module importable from the current directory or "
                       "PYTHONPATH, or a path/to/file.py") from error


def _on_path(directory: str) -> None:
    if directory not in sys.path:
        sys.path.insert(0, directory)


def load_factory(spec: str):
    """The callable ``NAME`` of ``MODULE:NAME`` (``MODULE`` importable, or a ``.py``
    file).

    Raises:
        Error: no ``:``; the module cannot be imported (or the file does not exist);
            it has no ``NAME``; ``NAME`` is not callable.
    """
    if ":" not in spec:
        raise py_error(f"Expected MODULE:FACTORY, got {spec!r}")
    module_name, name = spec.rsplit(":", 1)
    module = _import(module_name)
    if not hasattr(module, name):
        raise py_error(f"{module_name} has no {name!r} (FACTORY of MODULE:FACTORY)")
    factory = getattr(module, name)
    if not callable(factory):
        raise py_error(f"{spec} is a {type(factory).__name__}, not callable: FACTORY must be "
                       "a function or class that returns the model, or (model, "
                       "example_inputs[, options[, optimizer]])")
    return factory


def _build(factory, spec: str):
    made = factory()
    if isinstance(made, torch.nn.Module):
        made = (made,)
    if not isinstance(made, (tuple, list)) or not 1 <= len(made) <= 4 or \
            not isinstance(made[0], torch.nn.Module):
        raise py_error(f"{spec} returned {type(made).__name__}: it must return the model (a "
                       "torch.nn.Module), or (model, example_inputs[, options[, optimizer]])")
    model = made[0]
    inputs = made[1] if len(made) > 1 else None
    options = made[2] if len(made) > 2 else None
    optimizer = made[3] if len(made) > 3 else None
    if inputs is None:
        if not hasattr(model, "example_inputs"):
            raise py_error("The factory returned a model without example inputs: return "
                           "(model, example_inputs) or give the model example_inputs()")
        inputs = model.example_inputs()
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return model, tuple(inputs), options, optimizer


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m poptorch.plan",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("factory", help="MODULE:FACTORY returning the model (and inputs)")
    parser.add_argument("--ipus", type=int, default=1, help="IPUs per replica")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--training", dest="training", action="store_true", default=True,
                      help="plan training (the default)")
    mode.add_argument("--inference", dest="training", action="store_false")
    parser.add_argument("--batch", type=int, default=None,
                        help="global batch: samples per weight update of all replicas")
    parser.add_argument("--micro-batch", type=int, nargs="+", default=None,
                        help="micro-batch sizes to try (default: the inputs' batch)")
    parser.add_argument("--replicas", type=_positive, default=None,
                        help="replication factor")
    parser.add_argument("--target", choices=sorted(_TARGETS), default=None,
                        help="offline IPU target (default: the options', else ipu2)")
    parser.add_argument("--report", default="plan_report", metavar="DIR",
                        help="write the chosen plan's profile report into DIR/<model>/ "
                        "(default: %(default)s; --report '' writes none)")
    parser.add_argument("--json", action="store_true", help="also print the plan as JSON")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line; returns the exit status: 0, or 1 after printing one line
    ``poptorch.Error: ...`` to stderr (nothing fits, a bad argument, a factory that
    cannot be loaded). A bad flag exits with argparse's status 2."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except Error as error:
        print(f"poptorch.Error: {for_the_command_line(error.message)}", file=sys.stderr)
        return 1


def _run(args) -> int:
    model, inputs, options, optimizer = _build(load_factory(args.factory), args.factory)
    options = options.clone() if options is not None else Options()
    if args.replicas is not None:
        options.replicationFactor(args.replicas)
    if args.target is not None:
        options.useOfflineIpuTarget(_TARGETS[args.target])
    result = plan(model, *inputs, options=options, optimizer=optimizer, ipus=args.ipus,
                  training=args.training, micro_batch=args.micro_batch,
                  global_batch=args.batch)
    print(result.table())
    print("IPUConfig:", json.dumps(result.ipu_config()))
    if args.json:
        print(json.dumps({"units": result.units, "ipu_config": result.ipu_config(),
                          "estimate": result.estimate.summary()}, indent=1))
    if args.report:
        name = type(model).__name__
        write_report(os.path.join(args.report, name), result.estimate, name, args.training)
        print(f"profile report: {os.path.join(args.report, name, 'profile.html')}")
    return 0
