#!/usr/bin/env python3
"""Does TorchInductor's weight freezing pay for inference on this CPU? (issue 11, item 2)

Freezing (``torch._inductor.config.freezing``) folds the weights into the compiled
program as constants, which lets Inductor pre-pack them for oneDNN; the price is that
new weight values need a new compilation. The ``inductor`` backend keeps weights as
graph inputs (``copyWeightsToDevice`` never recompiles) and routes linear layers to
oneDNN unpacked (``popart_compiler/backends/inductor.py``). This bench measures, side by
side in one process, ``torch.compile`` of the models of ``bench/peers.py`` (combined
batch of deviceIterations 8) with and without freezing, and our inductor backend, and
prints time per call and the ratio to ``torch.compile`` without freezing.

Usage::

    python bench/freezing.py          # about a minute on 2 cores
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import poptorch  # noqa: E402  pylint: disable=wrong-import-position
from peers import MODELS, _opts  # noqa: E402  pylint: disable=wrong-import-position


def _median_ms(fn, repeats: int = 20) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    import torch._inductor.config as inductor_config  # pylint: disable=import-outside-toplevel
    torch.set_num_threads(1)
    poptorch.setLogLevel("ERR")
    print(f"torch {torch.__version__}, 1 thread, deviceIterations 8, median of 20 calls")
    print(f"{'model':6s} {'compile ms':>11s} {'frozen ms':>10s} {'ratio':>6s} "
          f"{'ours ms':>8s} {'ratio':>6s}")
    for key, (_, cls, mb, data, _) in MODELS.items():
        torch.manual_seed(0)
        model = cls().eval()
        x = data(mb * 8)
        with torch.no_grad():
            torch._dynamo.reset()
            plain = torch.compile(model)
            base = _median_ms(lambda: plain(x))
            torch._dynamo.reset()
            with inductor_config.patch(freezing=True):
                frozen = torch.compile(model)
                frozen_ms = _median_ms(lambda: frozen(x))
        ours = poptorch.inferenceModel(model, _opts("inductor"))
        ours_ms = _median_ms(lambda: ours(x))
        print(f"{key:6s} {base:11.2f} {frozen_ms:10.2f} {frozen_ms / base:6.2f} "
              f"{ours_ms:8.2f} {ours_ms / base:6.2f}", flush=True)


if __name__ == "__main__":
    main()
