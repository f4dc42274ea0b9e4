"""``lower`` (passes/lower.py): what runs a micro-batch, a pipeline stage and a
vectorized call on the chosen backend. The graph is unchanged; Inductor compiles a copy,
lazily (nothing is compiled here)."""
import torch

from models import MLP, export
from popart_compiler.backends import inductor
from popart_compiler.backends.eager import FloatingPointChecker
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.lower import lower
from popart_compiler.passes.vectorize import vectorize
from popart_compiler.session_options import SessionOptions


def lowered(run_pass, options, vectorized=False):
    g = export(MLP(), torch.randn(2, 4))
    before = g.module.code
    c = Compilation(options, False)
    if vectorized:
        vectorize(g, c)
        assert c.vectorized is not None
    result = run_pass(lower, g, c)
    assert result.graph is g and result.changed is False and g.module.code == before
    return g, c


def test_eager_runs_the_graph_module_itself(run_pass):
    g, c = lowered(run_pass, SessionOptions())
    assert c.runner is g.module and c.stage_runner is None
    x = torch.randn(2, 4)
    state = [g.state_values()[n] for n in g.parameters]
    torch.testing.assert_close(c.runner(*state, x)[0], g.module(*state, x)[0])


def test_floating_point_exceptions_run_op_by_op(run_pass, compiler_logs):
    g, c = lowered(run_pass, SessionOptions(fp_exceptions=True))
    assert isinstance(c.runner.__self__, FloatingPointChecker)
    assert c.runner.__self__.module is g.module
    assert isinstance(c.stage_runner(g.module).__self__, FloatingPointChecker)
    assert "Floating point exceptions are checked op by op" not in compiler_logs.text
    lowered(run_pass, SessionOptions(fp_exceptions=True, backend="inductor"))
    assert "Floating point exceptions are checked op by op: the inductor compiler is " \
        "not used for this model." in compiler_logs.text


def test_inductor_compiles_a_copy_at_its_first_call(run_pass):
    before = inductor.compile_count()
    g, c = lowered(run_pass, SessionOptions(device_iterations=4, backend="inductor"),
                   vectorized=True)
    assert isinstance(c.runner, inductor._Compiled) and c.runner._gm is not g.module
    assert isinstance(c.vectorized, inductor._Compiled)
    assert c.stage_runner.func is inductor.compile_graph
    assert c.stage_runner.keywords == {"random": False}
    assert inductor.compile_count() == before  # nothing compiled yet
    ops = {str(n.target) for n in c.runner._gm.graph.nodes if n.op == "call_function"}
    if torch.backends.mkldnn.is_available():  # on the CPU, inference: prepacked linears
        assert "popart_compiler.onednn_linear_packed.default" in ops
        assert "popart_compiler.onednn_linear.default" not in ops
    assert "aten.linear.default" in {str(n.target) for n in g.module.graph.nodes}
