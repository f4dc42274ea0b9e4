"""``python -m poptorch.plan MODULE:FACTORY --ipus N [--training|--inference]
[--batch B] [--micro-batch M ...] [--replicas R] [--target ipu21] [--report DIR]``

``FACTORY`` (a function or class in the importable module ``MODULE``, or in a file
``path/to/file.py``) is called without arguments and returns either the model, or a
tuple ``(model, example_inputs)`` / ``(model, example_inputs, options)`` /
``(model, example_inputs, options, optimizer)``; without example inputs the model's
``example_inputs()`` method is called. The plan is printed as a table, with the
optimum-graphcore ``IPUConfig`` fields, and the profile report of the chosen plan is
written into ``--report`` (default ``./plan_report``): ``profile.html`` and
``profile.json`` as ``Options.enableProfiling`` writes them.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import List, Optional

import torch

from popart_compiler.cost.profile_report import write_report
from popart_compiler.errors import Error, py_error
from poptorch._plan.api import plan
from poptorch.options import Options

__all__ = ["main", "load_factory"]

_TARGETS = {"ipu1": 1, "ipu2": 2, "ipu21": 21}


def load_factory(spec: str):
    """The object ``NAME`` of ``MODULE:NAME`` (``MODULE`` importable, or a ``.py`` file)."""
    if ":" not in spec:
        raise py_error(f"Expected MODULE:FACTORY, got {spec!r}")
    module_name, name = spec.rsplit(":", 1)
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        sys.path.insert(0, os.path.dirname(path))
        loaded = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(path))[0], path)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise py_error(f"{module_name} has no {name!r}")
    return getattr(module, name)


def _build(factory):
    made = factory()
    if isinstance(made, torch.nn.Module):
        made = (made,)
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


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line; returns the exit status (1 when nothing fits)."""
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
    parser.add_argument("--replicas", type=int, default=None, help="replication factor")
    parser.add_argument("--target", choices=sorted(_TARGETS), default=None,
                        help="offline IPU target (default: the options', else ipu2)")
    parser.add_argument("--report", default="plan_report",
                        help="directory of the chosen plan's profile report ('' : none)")
    parser.add_argument("--json", action="store_true", help="also print the plan as JSON")
    args = parser.parse_args(argv)
    model, inputs, options, optimizer = _build(load_factory(args.factory))
    options = options.clone() if options is not None else Options()
    if args.replicas is not None:
        options.replicationFactor(args.replicas)
    if args.target is not None:
        options.useOfflineIpuTarget(_TARGETS[args.target])
    try:
        result = plan(model, *inputs, options=options, optimizer=optimizer, ipus=args.ipus,
                      training=args.training, micro_batch=args.micro_batch,
                      global_batch=args.batch)
    except Error as error:
        print(error.message, file=sys.stderr)
        return 1
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
