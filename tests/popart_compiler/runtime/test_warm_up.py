"""popart_compiler/runtime/warm_up.py: the trial call that compiles inductor kernels
before the first run, and the auto backend's precompilation (a recording stand-in for
the compiled graph: no TorchInductor compilation here)."""
import dataclasses

import pytest
import torch
import torch.nn as nn

from popart_compiler import compiler
from popart_compiler.backends.auto import Lowering
from popart_compiler.errors import Error
from popart_compiler.ir import Graph
from popart_compiler.runtime.warm_up import precompile, warm_up
from popart_compiler.session_options import SessionOptions


class Recorder:
    """Stands in for a compiled graph: records each call's arguments; draws a random
    number (the warm-up must give the host's generator its state back)."""
    def __init__(self, error=None):
        self.calls, self.precompiled, self.error = [], [], error

    def __call__(self, *args):
        self.calls.append(args)
        torch.rand(1)
        if self.error:
            raise self.error
        return args[-1]

    def precompile(self, args, grad):
        self.precompiled.append((args, grad))


@pytest.fixture(scope="module")
def exe():
    torch.manual_seed(0)
    graph = Graph(torch.export.export(nn.Linear(4, 3), (torch.randn(2, 4),), strict=False))
    return compiler.compile(graph, SessionOptions(), False)


def _as(exe, runner, **options):
    # a stateful program: the warm-up calls the per-micro-batch runner
    return dataclasses.replace(exe, runner=runner, vectorized=None,
                               options=dataclasses.replace(exe.options, **options))


def test_the_inductor_backend_calls_the_graph_once_on_weights_and_zeros(exe):
    rec = Recorder()
    torch.manual_seed(3)
    warm_up(_as(exe, rec, backend="inductor"))
    after = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(2))  # the host generator is as it was
    (args,) = rec.calls
    weight, bias, x = args
    torch.testing.assert_close(weight, exe.graph.state_values()["weight"])
    assert bias.shape == (3,) and torch.equal(x, torch.zeros(2, 4))


@pytest.mark.parametrize("options", [dict(backend="eager"),
                                     dict(backend="inductor", fp_exceptions=True)])
def test_nothing_runs_without_kernels_to_compile(exe, options):
    rec = Recorder()
    warm_up(_as(exe, rec, **options))
    assert rec.calls == []


def test_a_compilation_error_is_raised(exe):
    rec = Recorder(error=RuntimeError("inductor failed"))
    with pytest.raises(RuntimeError, match="inductor failed"):
        warm_up(_as(exe, rec, backend="inductor"))


def test_precompile_passes_stand_ins_of_the_state_and_inputs(exe):
    rec = Recorder()
    state = [torch.ones(3, 4, requires_grad=True), torch.ones(3)]
    assert precompile(exe, Lowering("inductor", rec), state).runner is rec
    ((args, grad),) = rec.precompiled
    assert [tuple(a.shape) for a in args] == [(3, 4), (3,), (2, 4)]
    assert args[0].requires_grad and not args[1].requires_grad and grad is False
    assert rec.calls == []  # nothing ran
    unknown = dataclasses.replace(exe, graph=exe.graph)
    node = unknown.graph.placeholders[-1]
    val = node.meta.pop("val")
    try:
        with pytest.raises(Error, match="an input's shape is unknown"):
            precompile(unknown, Lowering("inductor", rec), state)
    finally:
        node.meta["val"] = val
