"""What the executable-cache workers (``cache_key_worker.py``,
``cache_key_attack_worker.py``) share: run every case of a table through a cached
``inferenceModel`` and record, per case, its output, plain PyTorch's, how many captures
it took and the cache's log lines, into a JSON result file."""
import contextlib
import json
import logging
import os
from typing import Callable, Dict

import torch

import poptorch
from poptorch._logging import logger


class Lines(logging.Handler):
    """Keeps the messages of poptorch's logger that speak of the cache."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        message = record.getMessage()
        if "cache" in message:
            self.lines.append(message)


def run_cases(cases: Dict[str, Callable[[], torch.nn.Module]], cache: str, result: str,
              x: torch.Tensor,
              setting: Callable[[str], Callable[[], None]] = lambda case: lambda: None):
    """Run each case's model (built after ``torch.manual_seed(0)``, in eval mode) with
    caching in ``cache/<case>``, under ``setting(case)`` (which returns its undo), and
    write the results to ``result``."""
    calls = []
    real = torch.export.export

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    torch.export.export = counting
    poptorch.setLogLevel("INFO")
    lines = Lines()
    logger.addHandler(lines)
    results = {}
    for case, build in cases.items():
        calls.clear()
        lines.lines = []
        torch.manual_seed(0)
        model = build().eval()
        undo = setting(case)
        with contextlib.ExitStack() as stack:
            stack.callback(undo)
            expected = model(x).detach()
            opts = poptorch.Options().enableExecutableCaching(os.path.join(cache, case))
            out = poptorch.inferenceModel(model, opts)(x)
        results[case] = {"out": out.detach().tolist(), "expected": expected.tolist(),
                         "captures": len(calls), "log": list(lines.lines)}
    with open(result, "w", encoding="utf-8") as f:
        json.dump(results, f)
