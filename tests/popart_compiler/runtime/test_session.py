"""The inference session (runtime/session.py) on its own: output modes and periods
(docs/semantics.md S-12), replicas and input groups (docs/semantics.md S-13, S-26), the reduction of
outputs, the device RNG (docs/semantics.md S-95) and floating-point checks (docs/semantics.md S-46).
Nothing here imports ``poptorch``."""
import pytest
import torch
import torch.nn as nn

from models import MLP, export
from popart_compiler import compiler
from popart_compiler.enums import OutputMode
from popart_compiler.errors import Error
from popart_compiler.runtime.session import InferenceSession, reduce_output
from popart_compiler.session_options import SessionOptions


def test_inference_session_output_modes():
    m = MLP()
    x = torch.randn(6 * 2, 4)  # D=6, B=2
    ref = m(x).detach().reshape(6, 2, 3)
    for mode, period, expected in [
        (2, 1, ref.reshape(12, 3)),
        (1, 3, ref[[2, 5]].reshape(4, 3)),
        (0, 1, ref[5]),
        (3, 1, ref.sum(0)),
    ]:
        g = export(m, x[:2])
        opts = SessionOptions(device_iterations=6, output_mode=mode, output_return_period=period)
        session = InferenceSession(compiler.compile(g, opts, training=False))
        (out,) = session.run([x])
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_replicas_and_input_groups():
    class Id(nn.Module):
        def forward(self, x):
            return x * 1

    x = torch.arange(4.).reshape(4, 1)  # D=2, G=2, B=1
    opts = SessionOptions(device_iterations=2, replication_factor=4, input_group_size=2,
                          input_group_type=1)
    session = InferenceSession(compiler.compile(export(Id(), x[:1]), opts, training=False))
    (out,) = session.run([x])
    assert out.flatten().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


class _Outputs(nn.Module):
    """A tensor per sample, a 0-d one per micro-batch, the input itself and a 64-bit
    result."""

    def forward(self, x):
        return x * 2, x.sum(), x, x.argmax(-1)


@pytest.mark.parametrize("replicas, slots", [(1, None), (2, None), (1, 2)])
def test_vectorized_outputs_fold_as_output_mode_all(replicas, slots):
    """All of a call's micro-batches at once (the folded path) or a few at a time
    (``slots``) give OutputMode.All's results: per-sample ones as ``[D·R·B, ...]``,
    0-d ones as ``[D·R]``; an output that is the input is a tensor of its own."""
    d, b = 4, 3
    x = torch.randn(d * replicas * b, 5)
    opts = SessionOptions(device_iterations=d, replication_factor=replicas)
    session = InferenceSession(compiler.compile(export(_Outputs(), x[:b]), opts,
                                                training=False))
    assert session._vectorized is not None  # pylint: disable=protected-access
    if slots is not None:
        session._vectorized_slots = slots  # pylint: disable=protected-access
    doubled, sums, same, index = session.run([x])
    torch.testing.assert_close(doubled, x * 2)
    assert index.dtype == torch.int32 and torch.equal(index, x.argmax(-1).int())
    torch.testing.assert_close(sums, x.reshape(d * replicas, b, 5).sum((1, 2)))
    assert torch.equal(same, x) and same.data_ptr() != x.data_ptr()
    folded = session._folds_all  # pylint: disable=protected-access
    assert folded is True


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(1)
        return x * 2


class _Noisy(nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x)


@pytest.mark.parametrize("module, leaves_no_state", [(MLP(), True), (_Counting(), False),
                                                     (_Noisy(), False)])
def test_runs_that_change_no_device_state_take_no_snapshot(module, leaves_no_state):
    """Only a run that mutates a buffer or an input, draws random numbers or records an
    anchor has something to roll back (docs/semantics.md S-73); the others skip the
    snapshot. A run that writes the buffers, then raises, leaves them as they were."""
    x = torch.randn(4 * 2, 4)
    session = InferenceSession(compiler.compile(export(module, x[:2]),
                                                SessionOptions(device_iterations=4),
                                                training=False))
    assert session._leaves_no_state is leaves_no_state  # pylint: disable=protected-access
    session.run([x])
    before = [t.clone() for bufs in session.weights.buffers for t in bufs]

    def failing(*args):  # writes every buffer, then fails
        for t in before:
            next(u for bufs in session.weights.buffers for u in bufs if u.shape == t.shape).add_(5)
        raise RuntimeError("stopped")
    session._vectorized = session._runner = failing  # pylint: disable=protected-access
    with pytest.raises(RuntimeError, match="stopped"):
        session.run([x])
    after = [t for bufs in session.weights.buffers for t in bufs]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_reduce_output_scalar_rules():
    t = torch.arange(6.).reshape(3, 1, 2)  # D=3, A=1, R=2, scalar outputs
    assert reduce_output(t, OutputMode.All).tolist() == [0, 1, 2, 3, 4, 5]
    assert reduce_output(t, OutputMode.Final).tolist() == [4, 5]
    assert reduce_output(t[:, :, :1], OutputMode.Final).shape == ()
    assert reduce_output(t, OutputMode.Sum).tolist() == [6, 9]
    assert reduce_output(t.int(), OutputMode.Sum).dtype == torch.int32


def test_rng_state_roundtrip_and_seed():
    class Drop(nn.Module):  # dropout is the identity in inference sessions (docs/semantics.md S-34)
        def forward(self, x):
            return x * (torch.rand_like(x) > 0.5)

    g = export(Drop(), torch.ones(100))
    session = InferenceSession(compiler.compile(g, SessionOptions(random_seed=7), False))
    state = session.getRngState()
    assert state[0] == 7
    a = session.run([torch.ones(100)])[0]
    session.setRngState(state)
    b = session.run([torch.ones(100)])[0]
    c = session.run([torch.ones(100)])[0]
    assert torch.equal(a, b) and not torch.equal(b, c)
    host = torch.get_rng_state()
    session.run([torch.ones(100)])
    assert torch.equal(host, torch.get_rng_state())  # the host RNG is not touched
    plain = InferenceSession(compiler.compile(export(MLP(), torch.ones(1, 4)),
                                              SessionOptions(), False))
    assert plain.getRngState() == [0]


def test_inference_session_floating_point_checks():
    class Div(nn.Module):
        def forward(self, x, y):
            return x / y

    g = export(Div(), torch.ones(2), torch.ones(2))
    on = InferenceSession(compiler.compile(g, SessionOptions(fp_exceptions=True), False))
    with pytest.raises(Error, match="overflow or division by zero"):
        on.run([torch.ones(2), torch.zeros(2)])
    with pytest.raises(Error, match="invalid operation"):
        on.run([torch.zeros(2), torch.zeros(2)])
    off = InferenceSession(compiler.compile(g, SessionOptions(), False))
    assert torch.isinf(off.run([torch.ones(2), torch.zeros(2)])[0]).all()
