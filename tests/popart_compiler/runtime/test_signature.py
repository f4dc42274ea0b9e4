"""popart_compiler/runtime/signature.py: what the processes of a run compare."""
import torch
import torch.nn as nn

from popart_compiler import compiler
from popart_compiler.ir import Graph
from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.runtime.signature import program_signature, signature_differences
from popart_compiler.session_options import SessionOptions


def _exe(width=4, **options):
    torch.manual_seed(0)
    model = nn.Linear(width, 3)
    model.bias.requires_grad_(False)
    graph = Graph(torch.export.export(model, (torch.randn(2, width),), strict=False))
    return compiler.compile(graph, SessionOptions(**options), False)


def test_the_signature_names_options_inputs_and_parameters():
    sig = program_signature(_exe(device_iterations=2, replication_factor=1))
    assert sig["deviceIterations"] == "2"
    assert sig["replicationFactor (local replicas)"] == "1"
    assert sig["accumulationAndReplicationReductionType"] == "Mean"
    assert sig["micro-batch input 0"] == "[2, 4] float32"
    assert sig["parameter weight"] == "[3, 4] float32"
    assert sig["parameter bias"] == "[3] float32 frozen"
    assert len(sig["the model's program (sha256 of the captured graph)"]) == 16


def test_a_different_program_or_optimizer_changes_the_signature():
    a, b = program_signature(_exe()), program_signature(_exe(width=5))
    assert a["micro-batch input 0"] != b["micro-batch input 0"]
    assert program_signature(_exe()) == a  # the same program: the same strings
    sgd = OptimizerDescription("SGD", defaults={"lr": 0.1}, groups=[], group_of={})
    with_optimizer = program_signature(_exe(), sgd)
    assert with_optimizer["optimizer"] == " / ".join(sgd.describe())
    assert "optimizer" not in a


def test_signature_differences_name_the_first_process_that_differs():
    same = {"options": "a", "inputs": "x"}
    assert signature_differences([same, dict(same), dict(same)]) == []
    other = {"options": "b", "parameters": "w"}
    assert signature_differences([same, dict(same), other]) == [
        "inputs is x in process 0 but absent in process 2",
        "options is a in process 0 but b in process 2",
        "parameters is absent in process 0 but w in process 2"]
    many = {f"k{i}": str(i) for i in range(10)}
    out = signature_differences([many, {}], shown=8)
    assert len(out) == 9 and out[-1] == "... 2 more"
