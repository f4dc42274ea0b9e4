"""One process of the recorded-decision tests (``test_backend_auto_decisions.py``):
runs an ``auto`` inference model (an MLP 8-16-4, 4 device iterations) and prints one
JSON line: the backend chosen, the stand-in compilations, the calls run and the last
output.

TorchInductor's compilation is replaced by a stand-in that runs the graph as it is
(counted; graphs of prepacked kernels only are handed to it too instead of running
directly), so nothing here depends on the machine. ``decide``: the policy is
synchronous, hot after one call, and the timings say Inductor is twice as fast, so the
program is decided (and recorded) within a few calls. ``reuse``: the default policy
(which would not compile within the 2 calls run): only a recorded decision makes it
run Inductor.

Usage: ``python auto_decision_worker.py decide|reuse``
"""
import json
import sys

import torch

import poptorch
from popart_compiler.backends import auto, direct
from popart_compiler.backends import inductor as inductor_backend

COMPILED = []


def _stand_in(gm, example_inputs, *, random):  # pylint: disable=unused-argument
    COMPILED.append(gm)
    return gm


def main(mode: str) -> None:
    inductor_backend._inductor = _stand_in  # pylint: disable=protected-access
    direct.runner = lambda gm: None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    opts = poptorch.Options().deviceIterations(4)
    opts.Backend.compiler("auto")
    opts.showCompilationProgressBar(False)
    x = torch.randn(16, 8)
    if mode == "decide":
        settings = auto.policy(compile_seconds=0, hot_seconds=0, hot_calls=1, trials=2,
                               synchronous=True,
                               measure=lambda backend, s: {"eager": 2.0,
                                                           "inductor": 1.0}[backend])
        calls = 8
    else:
        settings = auto.policy()
        calls = 2
    with settings:
        wrapped = poptorch.inferenceModel(model, opts)
        for _ in range(calls):
            out = wrapped(x)
    chooser = wrapped._state.session.auto  # pylint: disable=protected-access
    print(json.dumps({"chosen": chooser.chosen, "compiled": len(COMPILED),
                      "calls": calls, "out": out.tolist()}))


if __name__ == "__main__":
    main(sys.argv[1])
