"""popart_compiler/runtime/pipeline_program.py: the units of a staged program, what
crosses each boundary, and the units run one after another computing the model."""
import torch

from popart_compiler.runtime.pipeline_program import PipelineProgram


def _program(exe, trainable=None):
    n = len(exe.graph.placeholders)
    return PipelineProgram(exe.stages, trainable or [False] * n)


def test_units_ipus_and_what_they_read(pipelined):
    _, exe = pipelined
    p = _program(exe)
    assert (p.num_units, p.unit_ipus, p.unit_stages) == (3, [0, 1, 0], [[0], [1], [2]])
    # placeholders: 3 × (weight, bias), then the input; unit k reads layer k and unit 0 x
    assert p.reads == [{0, 1, 6}, {2, 3}, {4, 5}]
    assert p.units_reading(6) == [0] and p.units_reading(3) == [1]
    assert p.describe(1) == "pipeline stage 1 of 3 (IPU 1)"


def test_boundaries_carry_one_activation(pipelined):
    _, exe = pipelined
    p = _program(exe)
    assert p.receives[0] == []
    assert [[(tuple(v.shape), v.dtype) for v in vs] for vs in p.sends] == \
        [[((2, 4), torch.float32)]] * 3
    assert p.receives[1] == p.sends[0] and p.receives[2] == p.sends[1]
    assert not any(v.requires_grad for vs in p.sends for v in vs)  # inference
    example = p.sends[0][0].example("cpu")
    assert example.shape == (2, 4) and example.is_contiguous()
    trained = _program(exe, [True] * 6 + [False])
    assert trained.sends[0][0].requires_grad and not trained.sends[2][0].requires_grad


def test_the_units_in_turn_compute_the_model(pipelined):
    model, exe = pipelined
    p = _program(exe)
    local = [v.detach() for v in exe.graph.state_values().values()]
    x = torch.randn(2, 4)
    sent = p.run(0, [], local + [x])
    sent = p.run(1, sent, local + [x])
    (out,) = p.run(2, sent, local + [x])
    torch.testing.assert_close(out, model.reference(x))
