"""Hyper-parameter tensors written through ``optimizer.load_state_dict`` (``ipu_param``,
docs/semantics.md S-56) are used by the following updates and read back as written, until the param
groups change; user-written step counts give NaN updates, not complex-number errors."""
import pytest
import torch
import torch.nn as nn

import poptorch


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        out = self.fc(x)
        return out, poptorch.identity_loss(out.square().sum(), reduction="sum")


def _compiled(opt_cls, **kwargs):
    torch.manual_seed(0)
    net = _Net()
    opt = opt_cls(net.parameters(), **kwargs)
    model = poptorch.trainingModel(net, optimizer=opt)
    x = torch.randn(4, 3)
    model.compile(x)
    return net, opt, model, x


def _torch_step(net, opt_cls, x, **kwargs):
    opt = opt_cls(net.parameters(), **kwargs)
    opt.zero_grad()
    net.fc(x).square().sum().backward()
    opt.step()


@pytest.mark.parametrize("kind", ["Adam", "SGD"])
def test_written_learning_rate_is_used_and_read_back(kind):
    start_lr, new_lr = 0.01, 0.25
    net, opt, model, x = _compiled(getattr(poptorch.optim, kind), lr=start_lr)
    reference = _Net()
    reference.load_state_dict(net.state_dict())
    state = opt.state_dict()
    if kind == "Adam":
        keys = [k for k in state["ipu_param"] if k.startswith("learningRate___")]
        value = new_lr
    else:
        keys = [k for k in state["ipu_param"] if k.startswith("scaledLearningRate0___")]
        value = new_lr  # lr × (1 - dampening) / lossScaling with both neutral
    for k in keys:
        state["ipu_param"][k] = torch.tensor(value)
    opt.load_state_dict(state)
    model(x)
    _torch_step(reference, getattr(torch.optim, kind), x, lr=new_lr)
    torch.testing.assert_close(net.fc.weight, reference.fc.weight)
    back = opt.state_dict()["ipu_param"]
    assert all(back[k].item() == pytest.approx(value) for k in keys)
    # New host values replace the written ones.
    for group in opt.param_groups:
        group["lr"] = 0.5
    model.setOptimizer(opt)
    model(x)
    back = opt.state_dict()["ipu_param"]
    specific = [k for k in keys if "___specific___" in k]
    assert specific and all(back[k].item() == pytest.approx(0.5) for k in specific)


def test_written_fractional_step_count_gives_nan_not_complex():
    net, opt, model, x = _compiled(poptorch.optim.Adam, lr=0.01)
    state = opt.state_dict()
    for k in state["ipu_state"]:
        if k.startswith("Step___"):
            state["ipu_state"][k] = torch.tensor(-1.5)  # next: 1 - 0.999 ** -0.5 < 0
    opt.load_state_dict(state)
    model(x)  # torch.optim's float arithmetic would raise a ComplexFloat cast error
    assert torch.isnan(net.fc.weight).all()


def test_written_negative_rmsprop_momentum_moves_the_velocity():
    net, opt, model, x = _compiled(poptorch.optim.RMSprop, lr=0.01, momentum=0.5)
    state = opt.state_dict()
    for k in state["ipu_param"]:
        if k.startswith("momentum___"):
            state["ipu_param"][k] = torch.tensor(-0.5)
    velocity = {k: torch.full_like(v, 0.25) for k, v in state["ipu_state"].items()
                if k.startswith("Accl3___")}
    state["ipu_state"].update(velocity)
    opt.load_state_dict(state)
    model(x)
    after = opt.state_dict()["ipu_state"]
    for k, v in velocity.items():
        assert not torch.allclose(after[k], v)
