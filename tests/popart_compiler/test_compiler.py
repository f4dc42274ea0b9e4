"""``compile()`` (popart_compiler/compiler.py): the named list of passes ``PASSES`` run
in order, progress and debug logs from the list, a pass's error surfacing with its
location and a note naming the pass, and the ``Executable`` it returns. Each pass has
its own graph-in / graph-out test in ``passes/``. Nothing here imports ``poptorch``."""
import dataclasses
import pathlib

import pytest
import torch
import torch.nn as nn

from models import MLP, Classifier, export
from popart_compiler import compiler
from popart_compiler.errors import Error
from popart_compiler.passes import simplify
from popart_compiler.passes.base import Pass
from popart_compiler.session_options import Anchor, SessionOptions

NAMES = ["check_options", "check_inputs", "demote_float64", "retarget_device",
         "remove_inference_dropout", "check_loss", "check_buffers",
         "check_replica_groupings", "check_overlapped_io", "record_available_memory",
         "resolve_anchors", "name_tensors", "place", "session_defaults", "split_stages",
         "vectorize", "estimate"]


def test_passes_are_the_compiler_in_order():
    assert [p.name for p in compiler.PASSES] == NAMES
    assert all(p.run.__name__ == p.name for p in compiler.PASSES)


def test_every_pass_and_rewrite_rule_has_its_test_file():
    """``passes/test_<name>.py`` for each pass of ``PASSES``, each ``simplify`` rule and
    the argument rewrite under ``demote_float64`` / ``retarget_device``."""
    here = pathlib.Path(__file__).parent / "passes"
    names = [p.name for p in compiler.PASSES] + \
        [name for name in simplify.__all__ if name != "simplify"] + ["rewrite_args"]
    assert [n for n in names if not (here / f"test_{n}.py").is_file()] == []


def test_compile_runs_every_pass_and_reports_progress(compiler_logs):
    calls = []
    exe = compiler.compile(export(MLP(), torch.randn(2, 4)), SessionOptions(), False,
                           progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, len(NAMES)) for i in range(len(NAMES) + 1)]
    assert [name for name, _ in exe.passes] == NAMES
    assert [name for name, changed in exe.passes if changed] == []  # place: metadata
    assert exe.num_ipus == 1 and exe.loss_index is None and not exe.training
    assert exe.compile_seconds > 0 and exe.estimate is not None
    assert exe.stages is None
    assert exe.placement.stages == (0,)
    for i, name in enumerate(NAMES, 1):
        assert f"Compiler pass {i}/{len(NAMES)}: {name}" in compiler_logs.text


def test_training_executable():
    exe = compiler.compile(export(Classifier(), torch.randn(2, 6), torch.tensor([1, 3])),
                           SessionOptions(replication_factor=2,
                                          anchors=[Anchor("Relu:0", 2)]), True)
    assert exe.training and exe.loss_index == 1 and exe.num_ipus == 2
    assert exe.num_user_outputs == 2 and [a.name for a in exe.activation_anchors] == \
        ["Relu:0"]
    assert exe.vectorized is None and "Gradient___fc1.weight" in exe.tensor_names
    assert [name for name, changed in exe.passes if changed] == ["resolve_anchors"]


def test_compile_runs_the_passes_it_is_given():
    calls = []
    passes = [p for p in compiler.PASSES if p.name in ("check_options", "place")]
    exe = compiler.compile(export(MLP(), torch.randn(2, 4)), SessionOptions(), False,
                           progress=lambda done, total: calls.append((done, total)),
                           passes=passes)
    assert calls == [(0, 2), (1, 2), (2, 2)]
    assert exe.passes == [("check_options", False), ("place", False)]
    assert exe.estimate is None  # estimate did not run


def test_passes_return_what_they_derive():
    """Each pass gets the compilation the previous one returned and never writes into
    one (``Compilation`` is frozen); the executable holds what the last one holds."""
    given = []

    def recording(p):
        def run(graph, c):
            given.append(c)
            return p.run(graph, c)
        return Pass(p.name, run, p.ensures)

    exe = compiler.compile(export(MLP(), torch.randn(2, 4)), SessionOptions(), False,
                           passes=[recording(p) for p in compiler.PASSES])
    first, names = given[0], [p.name for p in compiler.PASSES]
    assert first.placement is None and first.estimate is None and first.tensor_names == []
    assert given[names.index("place")].placement is None
    assert given[names.index("place") + 1].placement is exe.placement
    assert given[-1].estimate is None and exe.estimate is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.placement = exe.placement


def test_a_graph_without_device_work_is_reported(compiler_logs):
    compiler.compile(export(nn.Identity(), torch.ones(2)), SessionOptions(), False)
    assert "No IPUs are used by this model. This may lead to unexpected behaviour." in \
        compiler_logs.text


def test_compile_errors():
    """A pass's error surfaces unchanged (its type and the location it was raised at),
    with a note naming the pass. Every message has its pass's test in ``passes/``."""
    class NoLoss(MLP):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(Error, match="Couldn't find a loss in graph!") as info:
        compiler.compile(export(NoLoss(), torch.randn(2, 4)), SessionOptions(), training=True)
    assert info.value.type == "poptorch_cpp_error"
    # rendered as PopTorch users read it: no file of the simulator in the text
    assert str(info.value).startswith("'poptorch_cpp_error': Couldn't find a loss")
    assert ".py" not in str(info.value) and type(info.value).__module__ == "poptorch"
    assert info.value.__notes__ == ["(in compiler pass check_loss)"]
    with pytest.raises(Error, match="Anchored tensor nope not found") as info:
        compiler.compile(export(MLP(), torch.randn(2, 4)),
                         SessionOptions(anchors=[Anchor("nope", 2)]), training=False)
    assert str(info.value).startswith("'poptorch_cpp_error': Anchored tensor nope")
    assert info.value.__notes__ == ["(in compiler pass resolve_anchors)"]


@pytest.mark.parametrize("options,probes", [
    (SessionOptions(backend="inductor"), True),
    (SessionOptions(), False),
    (SessionOptions(backend="inductor", fp_exceptions=True), False),
    (SessionOptions(backend="inductor", device="cuda"), False),
])
def test_prepare_starts_the_cpu_probe_of_inductor_only(monkeypatch, options, probes):
    calls = []
    monkeypatch.setattr(compiler.inductor, "start_probing_cpu", lambda: calls.append(1))
    compiler.prepare(options)
    assert calls == ([1] if probes else [])


def test_compile_stops_after_the_named_pass():
    calls = []
    exe = compiler.compile(export(MLP(), torch.randn(2, 4)),
                           SessionOptions(device_iterations=2), False,
                           progress=lambda done, total: calls.append((done, total)),
                           stop_after="vectorize")
    assert [name for name, _ in exe.passes] == NAMES[:NAMES.index("vectorize") + 1]
    assert calls[-1] == (len(NAMES) - 1, len(NAMES) - 1)
    assert exe.estimate is None and exe.placement is not None
    assert exe.vectorized is not None and exe.vectorized_slots == 2
    exe = compiler.compile(export(MLP(), torch.randn(2, 4)), SessionOptions(), False,
                           stop_after="check_options")
    assert exe.passes == [("check_options", False)] and exe.placement is None


def test_compile_refuses_an_unknown_stop():
    with pytest.raises(Error, match=r"compile\(stop_after='lower'\): no compiler pass has "
                                    r"that name. Name one of: check_options, check_inputs, "
                                    r".*, vectorize, estimate\.$"):
        compiler.compile(export(MLP(), torch.randn(2, 4)), SessionOptions(), False,
                         stop_after="lower")
