"""The IPU Model's FLOP count (popart_compiler/cost/op_costs.py) leaves other threads'
models alone.

It used torch's ``FlopCounterMode``, whose module tracker installs process-wide
``nn.Module`` hooks while it counts: a model running meanwhile in another thread got
gradient hooks on its tensors, and its ``torch.autograd.grad`` failed ("A leaf node was
passed to _will_engine_execute_node"). ``test_threads.py``'s two trainers in two threads
failed 2 runs in 8 that way (one compiling while the other trained).
"""
import threading

import torch
import torch.nn as nn
from torch.utils import flop_counter

from popart_compiler.cost import op_costs
from popart_compiler.ir import Graph


class _Product(nn.Module):
    def forward(self, x, weight):
        return x @ weight


def test_counting_flops_does_not_hook_modules_running_in_another_thread(monkeypatch):
    counting, trained = threading.Event(), threading.Event()
    errors = []

    def train_elsewhere():
        try:
            assert counting.wait(60)
            # as a training session runs a graph: the weights are inputs of the module
            weight = torch.randn(4, 1, requires_grad=True)
            loss = _Product()(torch.randn(2, 4), weight).sum()
            (grad,) = torch.autograd.grad(loss, [weight])
            assert grad.shape == (4, 1)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            trained.set()

    real = flop_counter.flop_registry[torch.ops.aten.mm]

    def slow_mm_formula(*args, **kwargs):
        counting.set()  # the other thread trains while this count is in progress
        assert trained.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.mm, slow_mm_formula)
    graph = Graph(torch.export.export(nn.Linear(4, 3, bias=False), (torch.randn(2, 4),),
                                      strict=False))
    node = next(n for n in graph.module.graph.nodes if n.op == "call_function"
                and "linear" in str(n.target))
    worker = threading.Thread(target=train_elsewhere)
    worker.start()
    flops = op_costs._flops(node)
    worker.join(60)
    assert not errors, errors
    assert flops == 2 * 2 * 4 * 3  # a [2, 4] x [4, 3] product
