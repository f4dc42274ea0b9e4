"""``lower`` (runtime/lowering.py): what a session runs for a micro-batch, a pipeline
stage and a vectorized call on the chosen backend, built from the executable's plain
data. The executable is unchanged: Inductor compiles copies, lazily (nothing is
compiled here)."""
import dataclasses

import torch
import torch.fx as fx

from models import MLP, export
from popart_compiler import compiler
from popart_compiler.backends import inductor
from popart_compiler.backends.eager import FloatingPointChecker
from popart_compiler.runtime.lowering import Runners, lower
from popart_compiler.runtime.session import InferenceSession
from popart_compiler.session_options import SessionOptions


def lowered(options):
    exe = compiler.compile(export(MLP(), torch.randn(2, 4)), options, False)
    before = exe.module.code
    vectorized = exe.vectorized
    runners = lower(exe)
    assert isinstance(runners, Runners)
    assert exe.module.code == before and exe.vectorized is vectorized
    assert vectorized is None or isinstance(vectorized, fx.GraphModule)
    return exe, runners


def test_the_executable_is_plain_data():
    """No field of an executable is something a backend built to run."""
    exe, _ = lowered(SessionOptions(device_iterations=4, backend="inductor"))
    for field in dataclasses.fields(exe):
        value = getattr(exe, field.name)
        assert not isinstance(value, inductor._Compiled), field.name
        assert not callable(value) or isinstance(value, fx.GraphModule), field.name
    assert isinstance(exe.vectorized, fx.GraphModule)  # the uncompiled graph


def test_eager_runs_the_graph_module_itself():
    exe, runners = lowered(SessionOptions())
    lowering = runners.lowering
    assert lowering.name == "eager" and lowering.runner is exe.module
    assert runners.stage_runner is None and runners.alternative is None
    x = torch.randn(2, 4)
    state = [exe.graph.state_values()[n] for n in exe.graph.parameters]
    torch.testing.assert_close(lowering.runner(*state, x)[0], exe.module(*state, x)[0])


def test_eager_runs_the_vectorized_graph_itself():
    exe, runners = lowered(SessionOptions(device_iterations=4))
    assert runners.lowering.vectorized is exe.vectorized
    assert runners.lowering.vectorized_slots == exe.vectorized_slots == 4


def test_floating_point_exceptions_run_op_by_op(compiler_logs):
    exe, runners = lowered(SessionOptions(fp_exceptions=True))
    runner = runners.lowering.runner
    assert isinstance(runner.__self__, FloatingPointChecker)
    assert runner.__self__.module is exe.module
    assert isinstance(runners.stage_runner(exe.module).__self__, FloatingPointChecker)
    assert "Floating point exceptions are checked op by op" not in compiler_logs.text
    lowered(SessionOptions(fp_exceptions=True, backend="inductor"))
    assert "Floating point exceptions are checked op by op: the inductor compiler is " \
        "not used for this model." in compiler_logs.text


def test_inductor_compiles_copies_at_their_first_call():
    before = inductor.compile_count()
    exe, runners = lowered(SessionOptions(device_iterations=4, backend="inductor"))
    lowering = runners.lowering
    assert lowering.name == "inductor"
    assert isinstance(lowering.runner, inductor._Compiled)
    assert lowering.runner._gm is not exe.module
    assert isinstance(lowering.vectorized, inductor._Compiled)
    assert lowering.vectorized._gm is not exe.vectorized  # vectorize's graph is kept
    assert runners.stage_runner.func is inductor.compile_graph
    assert runners.stage_runner.keywords == {"random": False}
    assert inductor.compile_count() == before  # nothing compiled yet
    ops = {str(n.target) for n in lowering.runner._gm.graph.nodes
           if n.op == "call_function"}
    if torch.backends.mkldnn.is_available():  # on the CPU, inference: prepacked linears
        assert "popart_compiler.onednn_linear_packed.default" in ops
        assert "popart_compiler.onednn_linear.default" not in ops
    kept = {str(n.target) for n in exe.vectorized.graph.nodes if n.op == "call_function"}
    assert not any(op.startswith("popart_compiler.onednn") for op in kept)
    assert "aten.linear.default" in {str(n.target) for n in exe.module.graph.nodes}


def test_auto_has_the_inductor_alternative():
    exe, runners = lowered(SessionOptions(device_iterations=4, backend="auto"))
    assert runners.lowering.name == "eager" and runners.lowering.runner is exe.module
    assert runners.alternative is not None
    alternative = runners.alternative()  # built when the session asks for it
    assert alternative.name == "inductor" and alternative.vectorized_slots == 4
    assert isinstance(alternative.runner, inductor._Compiled)


def test_a_session_builds_its_runners_from_the_executable():
    exe = compiler.compile(export(MLP(), torch.randn(2, 4)),
                           SessionOptions(device_iterations=3), False)
    session = InferenceSession(exe)
    assert session.runners.lowering.runner is exe.module
    x = torch.randn(6, 4)
    state = [exe.graph.state_values()[n] for n in exe.graph.parameters]
    expected = torch.cat([exe.module(*state, x[i:i + 2])[0] for i in (0, 2, 4)])
    torch.testing.assert_close(session.run([x])[0], expected)
