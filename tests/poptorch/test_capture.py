"""Capture (docs/api-sections.md api §2.2; docs/semantics.md S-1, S-2, S-4…S-6): ``forward`` runs
once, on the host, at the first call; plain tensor attributes are frozen then, parameters and
buffers must not be replaced, trivial graphs pass inputs through, the train / eval flags are read at
wrap and capture, a wrapped model cannot be called inside another one, and compile hooks run around
every capture."""
import pytest
import torch
import torch.nn as nn

import poptorch


# -- capture once (docs/semantics.md S-1, S-2, S-4)
# ------------------------------------------------------

def test_plain_tensor_attribute_is_frozen_at_capture():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.i = torch.tensor([0.])

        def forward(self, x):
            self.i += 1
            return self.i + 0 * x

    m = M()
    model = poptorch.inferenceModel(m)
    assert model(torch.zeros(1)).tolist() == [1.0]
    assert model(torch.zeros(1)).tolist() == [1.0]
    assert m.i.tolist() == [1.0]  # the add ran once on the host, at capture


def test_forward_python_runs_once_and_is_running_on_ipu():
    calls = []

    class M(nn.Module):
        def forward(self, x):
            calls.append(poptorch.isRunningOnIpu())
            return x * 2

    model = poptorch.inferenceModel(M())
    for _ in range(3):
        assert torch.equal(model(torch.ones(2)), torch.full((2,), 2.0))
    assert calls == [True]
    assert not poptorch.isRunningOnIpu()


def test_ipu_and_cpu_paths_diverge():
    class M(nn.Module):
        def forward(self, x, y):
            if poptorch.isRunningOnIpu():
                return x + y
            return x * y

    x, y = torch.tensor([50.]), torch.tensor([2.])
    assert poptorch.inferenceModel(M())(x, y).item() == 52.0
    assert M()(x, y).item() == 100.0


def test_device_ipu_arguments_are_accepted(poptorch_logs):
    class M(nn.Module):
        def forward(self, x):
            return x + torch.ones(3, device="ipu") + torch.zeros(3).to("ipu") + torch.arange(3)

    out = poptorch.inferenceModel(M())(torch.zeros(3))
    assert out.tolist() == [1.0, 2.0, 3.0]
    assert "No device set in torch.arange(): forcing to IPU" in poptorch_logs.text


def test_compile_hooks_run_around_capture_even_on_failure():
    events = []
    pre = poptorch.registerPreCompileHook(lambda: events.append("pre"))
    post = poptorch.registerPostCompileHook(lambda: events.append("post"))
    try:
        class Bad(nn.Module):
            def forward(self, x):
                raise KeyError("user error")

        with pytest.raises(KeyError, match="user error"):
            poptorch.inferenceModel(Bad())(torch.ones(1))
        assert events == ["pre", "post"]
        poptorch.inferenceModel(nn.Identity())(torch.ones(1))
        assert events == ["pre", "post", "pre", "post"]
    finally:
        pre.remove()
        post.remove()
    poptorch.inferenceModel(nn.Identity())(torch.ones(1))
    assert len(events) == 4
    with pytest.raises(RuntimeError, match="callable"):
        poptorch.registerPreCompileHook(3)


def test_train_and_eval_flags_are_read_at_wrap_and_capture():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(x), torch.tensor(self.training)

    m = M()
    m.train()
    model = poptorch.inferenceModel(m)
    m.eval()  # the top-level flag was copied at wrap time; sub-modules are shared
    out, training = model(torch.ones(100))
    assert training.item() is True
    assert torch.equal(out, torch.ones(100))  # dropout in eval mode at capture


def test_wrapped_model_inside_another_forward_is_rejected():
    """Found by a user: it failed deep inside torch.export with an AssertionError."""
    inner = poptorch.inferenceModel(nn.Linear(2, 2))

    class Outer(nn.Module):
        def forward(self, x):
            return inner(x) + 1

    outer = poptorch.inferenceModel(Outer())
    with pytest.raises(poptorch.Error, match="cannot be called inside the forward of "
                                             "another wrapped model"):
        outer(torch.ones(1, 2))
    assert not outer.isCompiled()


# -- parameters must not be replaced (docs/semantics.md S-5)
# ---------------------------------------------

def test_reassigned_buffer_raises_and_host_state_is_restored():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("y", torch.zeros(2))

        def forward(self, x):
            self.y = x
            return x * 2

    m = M()
    buffer = m.y
    model = poptorch.inferenceModel(m)
    with pytest.raises(poptorch.Error, match=r"Buffer y is reassigned within the model.*"
                                             r"self\.y\.copy_\(src\)"):
        model(torch.ones(2))
    assert m.y is buffer and torch.equal(m.y, torch.zeros(2))
    assert not model.isCompiled()


def test_reassigned_parameter_raises():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x):
            self.w = nn.Parameter(x)
            return x

    with pytest.raises(poptorch.Error, match="Parameter w is reassigned"):
        poptorch.inferenceModel(M())(torch.ones(2))


# -- trivial graphs (docs/semantics.md S-6)
# --------------------------------------------------------------

def test_pass_through_outputs_follow_new_inputs():
    class M(nn.Module):
        def forward(self, x, y, z):
            return x, y, z + 0.0

    model = poptorch.inferenceModel(M())
    out = model(torch.tensor([1.]), torch.tensor([2.]), torch.tensor([3.]))
    assert [t.item() for t in out] == [1.0, 2.0, 3.0]
    out = model(torch.tensor([4.]), torch.tensor([5.]), torch.tensor([6.]))
    assert [t.item() for t in out] == [4.0, 5.0, 6.0]


def test_model_returning_none_returns_none_and_writes_inputs_back():
    class M(nn.Module):
        def forward(self, x):
            x += 1

    t = torch.tensor([1.])
    model = poptorch.inferenceModel(M())
    assert model(t) is None
    assert model(t) is None
    assert t.item() == 3.0


def test_model_returning_only_constants():
    class M(nn.Module):
        def forward(self, x):
            return torch.full((2,), 7.0)

    assert poptorch.inferenceModel(M())(torch.ones(1)).tolist() == [7.0, 7.0]
