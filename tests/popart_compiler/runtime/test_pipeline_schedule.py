"""popart_compiler/runtime/pipeline_schedule.py: how the values crossing a boundary are
laid out in one message, and the shapes the last stage's outputs finish with (the
schedule's sends and receives run in the multi-process tests)."""
import torch

from popart_compiler.enums import OutputMode
from popart_compiler.runtime.pipeline_program import BoundaryValue
from popart_compiler.runtime.pipeline_schedule import ScheduleStats, _Message, finished_shapes
from popart_compiler.session_options import SessionOptions


def _values(*specs):
    return [BoundaryValue(None, torch.Size(shape), dtype, False) for shape, dtype in specs]


def test_several_values_pack_into_one_aligned_buffer_and_back():
    msg = _Message(_values(((3,), torch.float32), ((2, 2), torch.int64),
                           ((5,), torch.bool)), torch.device("cpu"))
    assert msg.offsets == [0, 64, 128] and msg.nbytes == 192 and not msg.single
    values = [torch.tensor([1.0, 2.0, 3.0]), torch.arange(4).reshape(2, 2),
              torch.tensor([True, False, True, True, False])]
    buf, packed = msg.pack(values)
    assert packed and buf.dtype == torch.uint8 and buf.numel() == 192
    for got, want in zip(msg.unpack(buf), values):
        assert got.dtype == want.dtype and torch.equal(got, want)
    msg.retire(buf)
    assert msg.empty() is buf  # reused once its sends completed (none here)


def test_a_single_value_travels_as_it_is():
    msg = _Message(_values(((2,), torch.float32)), torch.device("cpu"))
    t = torch.tensor([4.0, 5.0], requires_grad=True)
    buf, packed = msg.pack([t])
    assert not packed and torch.equal(buf, t.detach()) and not buf.requires_grad
    (back,) = msg.unpack(buf)
    assert torch.equal(back, t.detach())
    flags = _Message(_values(((3,), torch.bool)), torch.device("cpu"))
    wire, _ = flags.pack([torch.tensor([True, False, True])])
    assert wire.dtype == torch.uint8  # gloo has no bool
    assert flags.unpack(wire)[0].tolist() == [True, False, True]


def test_finished_shapes_follow_the_output_mode(pipelined):
    """Micro-batches of 2 rows, D = 3 device iterations, A = 2 accumulated ones."""
    _, exe = pipelined
    expected = {(OutputMode.All, 1): (12, 4), (OutputMode.Final, 1): (2, 4),
                (OutputMode.EveryN, 3): (4, 4), (OutputMode.Sum, 1): (2, 4)}
    for (mode, period), shape in expected.items():
        options = SessionOptions(device_iterations=3, output_mode=mode,
                                 output_return_period=period)
        assert finished_shapes(exe, options, (3, 2, 1)) == \
            [(torch.Size(shape), torch.float32)], mode


def test_stats_start_at_zero():
    stats = ScheduleStats()
    assert (stats.micro_batches, stats.messages, stats.bytes_sent, stats.wait_s) == \
        (0, 0, 0, 0.0)
