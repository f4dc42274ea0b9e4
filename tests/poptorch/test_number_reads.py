"""``int(t)`` / ``float(t)`` of a run-time value are read as ``t.item()`` (issue 22):
``int(t[0])`` was refused as control flow while ``t[0].item()`` worked."""
import pytest
import torch

import poptorch


class Scale(torch.nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, x, n):
        if self.spelling == "int":
            k = int(n[0]) * float(n[1])
        else:
            k = n[0].item() * n[1].item()
        assert isinstance(3, int) and isinstance(0.5, float) and issubclass(bool, int)
        return x * k + int("2") + float(x.shape[0])


@pytest.mark.parametrize("spelling", ["int", "item"])
def test_int_and_item_of_a_run_time_value_give_the_same_results(spelling):
    model = Scale(spelling)
    executor = poptorch.inferenceModel(model)
    x = torch.arange(3.0)
    for n in (torch.tensor([2.0, 0.5]), torch.tensor([5.0, 3.0])):
        torch.testing.assert_close(executor(x, n), Scale("item")(x, n))
    assert "int" not in globals() and "float" not in globals()  # put back after capture


class Branch(torch.nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, x, n):
        value = int(n[0]) if self.spelling == "int" else n[0].item()
        if value > 2:  # Python branching on a run-time value
            return x
        return -x


@pytest.mark.parametrize("spelling", ["int", "item"])
def test_branching_on_int_or_item_gives_the_same_error(spelling):
    with pytest.raises(poptorch.Error, match=r"uses the value of a tensor in Python "
                       r"control flow.*`if value > 2:.*poptorch\.cond"):
        poptorch.inferenceModel(Branch(spelling))(torch.ones(2), torch.tensor([3]))


class Pipelined(torch.nn.Module):
    """Blocks with automatic ids: the capture that failed at int() had already given
    the first block its id ("0"); the second capture must give the next block "1"."""

    def __init__(self):
        super().__init__()
        self.a = poptorch.BeginBlock(torch.nn.Linear(2, 2), ipu_id=0)
        self.b = poptorch.BeginBlock(torch.nn.Linear(2, 2), ipu_id=1)
        self.double = poptorch.CPU(lambda t: t * 2, "double")

    def forward(self, x, n):
        return self.b(self.double(self.a(x)) * int(n[0]))


def test_int_read_in_a_pipelined_model_with_a_host_op():
    torch.manual_seed(0)
    model = Pipelined()
    executor = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    x, n = torch.randn(4, 2), torch.full((4, 1), 3)
    torch.testing.assert_close(executor(x, n), model.b(model.a(x) * 2 * 3))
    ids = [hook.user_id for layer in (model.a, model.b)
           for hook in layer._forward_pre_hooks.values() if hasattr(hook, "user_id")]
    assert ids == ["0", "1"]


def test_a_capture_that_failed_midway_does_not_reuse_automatic_block_ids():
    model = Pipelined()
    executor = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    with pytest.raises(poptorch.Error, match="same reduction dim"):  # after block "0" began
        executor(torch.randn(4, 3), torch.full((4, 1), 3))
    x, n = torch.randn(4, 2), torch.full((4, 1), 3)
    torch.testing.assert_close(executor(x, n), model.b(model.a(x) * 2 * 3))


class LogsThenReads(torch.nn.Module):
    def forward(self, x, n):
        zeros = torch.zeros(2)  # logs "No device set in torch.zeros(): forcing to IPU"
        return x * int(n[0]) + zeros


def test_the_repeated_capture_does_not_log_twice(poptorch_logs):
    out = poptorch.inferenceModel(LogsThenReads())(torch.ones(2), torch.tensor([3]))
    assert out.tolist() == [3.0, 3.0]
    logged = [r for r in poptorch_logs.records if "No device set in torch.zeros()" in
              r.getMessage()]
    assert len(logged) == 1
