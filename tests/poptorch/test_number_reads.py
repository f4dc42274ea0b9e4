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
