"""``verify`` (popart_compiler/verify.py) accepts the graphs the compiler makes and
rejects each malformed one with its message; ``compile()`` runs it after every pass
when ``POPTORCH_VERIFY=1`` and names the pass that broke the graph; an exception raised
in a pass carries a note naming the pass; ``Graph`` and ``Executable`` print themselves
(``as_text()``)."""
import dataclasses

import pytest
import torch

from models import MLP, Classifier, export
from popart_compiler import compiler
from popart_compiler.enums import OutputMode
from popart_compiler.errors import Error
from popart_compiler.passes.base import Compilation, Pass, PassResult
from popart_compiler.passes.placement import place
from popart_compiler.session_options import Anchor, SessionOptions
from popart_compiler.verify import verify


def graph():
    return export(MLP(), torch.randn(2, 4))


def node(g, name):
    return next(n for n in g.module.graph.nodes if n.name == name)


def rejected(g, c=None, after="", match=""):
    with pytest.raises(Error, match=match) as info:
        verify(g, c, after)
    assert info.value.type == "poptorch_verify_error"
    return str(info.value)


def test_a_captured_graph_and_a_compiled_one_pass():
    g = graph()
    verify(g)
    verify(g, Compilation(SessionOptions(), False))
    exe = compiler.compile(g, SessionOptions(anchors=[Anchor("Relu:0", OutputMode.All)]),
                           False)
    c = Compilation(exe.options, False, activation_anchors=exe.activation_anchors,
                    placement=exe.placement)
    verify(exe.graph, c)


def test_fx_lint_failure():
    g = graph()
    node(g, "linear").prepend(node(g, "relu"))  # relu now comes before its input
    rejected(g, after="bad_pass", match=r"Graph verification failed after pass bad_pass: "
                                        r"fx lint: Argument 'linear' of Node 'relu' was "
                                        r"used before it has been defined")


def test_placeholder_order():
    g = graph()
    first = g.placeholders[0]
    node(g, "x").append(first)  # the first weight after the user input
    rejected(g, match="the placeholders differ from the graph's recorded order")


def test_placeholder_count():
    g = graph()
    g.parameters.append("fc3.weight")
    rejected(g, match=r"5 placeholders for 6 parameters, buffers, constants and inputs")


def test_output_count_against_the_anchors():
    g = graph()
    out = g.output_node
    out.args = (tuple(out.args[0]) + (node(g, "relu"),),)
    verify(g)  # without a compilation, extra outputs count as anchors
    c = Compilation(SessionOptions(), False)
    rejected(g, c, match="2 outputs for 1 user outputs and 0 anchors")
    verify(g, dataclasses.replace(c, activation_anchors=[Anchor("Relu:0", OutputMode.All)]))


def test_user_outputs_differ_from_the_recorded_ones():
    g = graph()
    g.output_node.args = ((node(g, "relu"),),)
    rejected(g, match="the user outputs differ from the graph's recorded output nodes")


def test_node_without_meta_val():
    g = graph()
    del node(g, "relu").meta["val"]
    rejected(g, match=r"call_function relu has no meta\['val'\]")
    g = graph()
    del g.placeholders[1].meta["val"]
    rejected(g, match=r"placeholder p_fc1_bias has no meta\['val'\]")


def test_op_without_placement_after_placement():
    g = graph()
    c = Compilation(SessionOptions(), False)
    verify(g, c)  # not placed yet: no placement needed
    c = place(g, c).compilation
    verify(g, c)
    del node(g, "linear_1").meta["placement"]
    rejected(g, c, after="place", match=r"after pass place: op linear_1 has no placement")


def _drops_the_meta(graph, c):
    del next(n for n in graph.module.graph.nodes if n.name == "relu").meta["val"]
    return PassResult(graph, True)


def test_compile_names_the_pass_that_broke_the_graph(monkeypatch):
    monkeypatch.setenv("POPTORCH_VERIFY", "1")
    passes = list(compiler.PASSES[:3]) + [Pass.of(_drops_the_meta)] + \
        list(compiler.PASSES[3:])
    with pytest.raises(Error, match=r"Graph verification failed after pass "
                                    r"_drops_the_meta: call_function relu has no "
                                    r"meta\['val'\]") as info:
        compiler.compile(graph(), SessionOptions(), False, passes=passes)
    assert info.value.type == "poptorch_verify_error"
    assert info.value.__notes__ == ["(in compiler pass _drops_the_meta)"]
    monkeypatch.setenv("POPTORCH_VERIFY", "0")  # unchecked: the broken graph compiles
    exe = compiler.compile(graph(), SessionOptions(), False, passes=passes)
    assert ("_drops_the_meta", True) in exe.passes


def _fails(graph, c):
    raise KeyError("boom")


def test_an_exception_in_a_pass_names_the_pass():
    with pytest.raises(KeyError, match="boom") as info:
        compiler.compile(graph(), SessionOptions(), False,
                         passes=[compiler.PASSES[0], Pass.of(_fails)])
    assert info.value.__notes__ == ["(in compiler pass _fails)"]
    with pytest.raises(Error, match="Couldn't find a loss in graph!") as info:
        compiler.compile(graph(), SessionOptions(), True)
    assert info.value.__notes__ == ["(in compiler pass check_loss)"]


def test_graph_as_text():
    g = export(Classifier(), torch.randn(2, 6), torch.tensor([1, 3]))
    text = g.as_text().splitlines()
    assert text[0] == "graph(4 parameters, 0 buffers, 0 constants, 2 inputs):"
    assert text[1] == "  %p_fc1_weight : [num_users=1] = placeholder[target=p_fc1_weight]"
    assert text[6] == "  %t : [num_users=1] = placeholder[target=t]"
    assert text[7].startswith("  fc1/Linear:0: %linear : [num_users=1] = call_function"
                              "[target=torch.ops.aten.linear.default](args = (%x, "
                              "%p_fc1_weight, %p_fc1_bias)")
    assert text[-2].startswith("  CrossEntropyLoss:0: %cross_entropy_loss")
    assert text[-1] == "  return (linear_1, cross_entropy_loss)"
    assert "@ ipu" not in g.as_text()
    place(g, Compilation(SessionOptions(), True))
    assert text[7] + "  @ ipu 0 stage 0 phase 0" in g.as_text().splitlines()


def test_executable_as_text():
    options = SessionOptions(device_iterations=4, output_mode=OutputMode.Final,
                             anchors=[Anchor("Relu:0", OutputMode.All)])
    exe = compiler.compile(graph(), options, False)
    text = exe.as_text()
    lines = text.splitlines()
    assert lines[:6] == [
        "executable (inference):",
        "  backend: cpu/eager",
        "  ipus: 1",
        "  batching: D=4 A=1 R=1",
        "  output mode: Final",
        "  vectorized: 4 micro-batches per call",
    ]
    assert lines[6] == "  anchors: Relu:0"
    names = [name for name, _ in exe.passes]
    assert names == [p.name for p in compiler.PASSES]
    assert lines[7] == "  passes: " + ", ".join(
        f"{n}{'*' if changed else ''}" for n, changed in exe.passes)
    assert "resolve_anchors*" in lines[7] and "place," in lines[7]  # place: metadata
    assert "check_options," in lines[7]  # a check changes nothing
    assert lines[8] == "graph(4 parameters, 0 buffers, 0 constants, 1 inputs):"
    assert text.endswith("  return (linear_1, relu)")
    training = compiler.compile(export(Classifier(), torch.randn(2, 6),
                                       torch.tensor([1, 3])), SessionOptions(), True)
    assert training.as_text().splitlines()[:6] == [
        "executable (training):", "  backend: cpu/eager", "  ipus: 1",
        "  batching: D=1 A=1 R=1", "  output mode: All", "  loss output: 1"]
