"""Custom gradients are never dropped silently (issue 22): a ``torch.autograd.Function``
with its own ``backward`` trains with that backward, equal to PyTorch's gradients; what
cannot be honoured is refused. ``int(t)`` points to ``t.item()``."""
import logging

import pytest
import torch

import poptorch


class SpikeFn(torch.autograd.Function):
    """A Heaviside spike with a fast-sigmoid surrogate gradient (as snntorch's)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x > 0).float()

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return grad / (1 + 10 * x.abs()) ** 2


class RoundSTE(torch.autograd.Function):
    """Straight-through rounding with a non-tensor argument and two outputs, in the
    ``setup_context`` style."""

    @staticmethod
    def forward(x, scale):
        return torch.round(x * scale) / scale, x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, grad, grad_twice):
        return grad * ctx.scale + 2 * grad_twice, None


class Passthrough(torch.autograd.Function):
    """Returns its input as is; the backward scales the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return 3 * grad


class InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class Net(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.body = body

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.body(self.fc(x)), y)


def _spike(h):
    return SpikeFn.apply(h)


def _ste(h):
    q, twice = RoundSTE.apply(h, 4.0)
    return q + twice


def _passthrough(h):
    return Passthrough.apply(h * 1.0) + h


def _train_both(body, steps=2):
    torch.manual_seed(0)
    model, ref = Net(body), Net(body)
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 4), torch.rand(4, 3)
    training = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(
        model.parameters(), lr=0.5))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(steps):
        loss = training(x, y)
        opt.zero_grad()
        want = ref(x, y)
        want.backward()
        opt.step()
        torch.testing.assert_close(loss, want.detach())
    return model, ref


@pytest.mark.parametrize("body", [_spike, _ste, _passthrough],
                         ids=["surrogate", "straight-through", "passthrough"])
def test_custom_backward_trains_like_pytorch(body):
    model, ref = _train_both(body)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7,
                                   msg=name)


def test_the_surrogate_gradient_is_not_the_spikes_zero_gradient():
    """The failing case: a spike function trained with the gradient of its forward
    (zero) left the weights unchanged."""
    model, _ = _train_both(_spike, steps=1)
    torch.manual_seed(0)
    untrained = Net(_spike)
    assert not torch.equal(model.fc.weight.detach(), untrained.fc.weight.detach())


def test_inference_traces_through_forward():
    model = Net(_spike)
    x = torch.randn(4, 4)
    torch.testing.assert_close(poptorch.inferenceModel(model.fc)(x), model.fc(x))
    body = torch.nn.Sequential(model.fc)
    out = poptorch.inferenceModel(torch.nn.Sequential(body, _Module(_spike)))(x)
    torch.testing.assert_close(out, (model.fc(x) > 0).float())


class _Module(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_a_function_that_modifies_its_input_is_refused():
    training = poptorch.trainingModel(Net(lambda h: InPlace.apply(h * 1.0)))
    with pytest.raises(poptorch.Error, match=r"InPlace modifies its input in place"):
        training(torch.randn(4, 4), torch.rand(4, 3))


def test_the_refusal_logs_no_forcing_to_ipu_warning(caplog):
    """Fresh-user report D7: the refusal of a ctx.mark_dirty Function was preceded by
    "No device set in torch.zeros(): forcing to IPU" from our own example run."""
    training = poptorch.trainingModel(Net(lambda h: InPlace.apply(h * 1.0)))
    with caplog.at_level(logging.WARNING, logger="poptorch"), \
            pytest.raises(poptorch.Error, match=r"InPlace modifies its input in place"):
        training(torch.randn(4, 4), torch.rand(4, 3))
    assert not [r for r in caplog.records if "forcing to IPU" in r.getMessage()]


class WrongShapeGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad.sum(0)  # [3] for an input of [4, 3]


class BroadcastGrad(WrongShapeGrad):
    @staticmethod
    def backward(ctx, grad):
        return (2 * grad).expand(5, *grad.shape)  # summed to the input's shape, as PyTorch


def test_a_wrongly_shaped_gradient_names_the_function():
    """Fresh-user report D6: a raw RuntimeError naming an internal op before."""
    training = poptorch.trainingModel(Net(lambda h: WrongShapeGrad.apply(h)))
    with pytest.raises(RuntimeError, match=r"invalid gradient at index 0"):
        Net(lambda h: WrongShapeGrad.apply(h))(torch.randn(4, 4), torch.rand(4, 3)).backward()
    with pytest.raises(poptorch.Error, match=r"Function \S*WrongShapeGrad returned an "
                       r"invalid gradient at index 0 - got "
                       r"\[3\] but expected shape compatible with \[4, 3\]"):
        training(torch.randn(4, 4), torch.rand(4, 3))


def test_a_broadcast_gradient_is_summed_like_pytorch():
    model, ref = _train_both(lambda h: BroadcastGrad.apply(h))
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)


def test_labels_moved_to_the_logits_device_stay_in_the_last_stage():
    """torch.export records ``labels.to(logits.device)``'s metadata check without the
    block tag: it must not count as a return to IPU 0 (HF ViT pipelined over 2 IPUs
    needed gradientAccumulation 7 instead of 3)."""
    class TwoStages(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = poptorch.BeginBlock(torch.nn.Linear(4, 4), "A", ipu_id=0)
            self.b = poptorch.BeginBlock(torch.nn.Linear(4, 3), "B", ipu_id=1)

        def forward(self, x, labels):
            logits = self.b(self.a(x))
            labels = labels.to(logits.device)
            return torch.nn.functional.cross_entropy(logits, labels)

    opts = poptorch.Options()
    opts.Training.gradientAccumulation(3)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    training = poptorch.trainingModel(TwoStages(), opts)
    loss = training(torch.randn(3, 4), torch.tensor([0, 1, 2]))
    assert loss.shape == () and torch.isfinite(loss)
