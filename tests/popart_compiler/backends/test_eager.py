"""popart_compiler/backends/eager.py: floating-point exceptions op by op."""
import pytest
import torch
import torch.fx as fx

from popart_compiler.backends.eager import FloatingPointChecker
from popart_compiler.errors import Error


def _run(fn, *inputs):
    return FloatingPointChecker(fx.symbolic_trace(fn)).run(*inputs)


def test_finite_results_are_returned_unchanged():
    x = torch.tensor([1.0, 4.0])
    torch.testing.assert_close(_run(lambda a: torch.sqrt(a) * 2, x), torch.tensor([2.0, 4.0]))


def test_a_nan_from_finite_inputs_is_an_invalid_operation():
    with pytest.raises(Error, match=r"Floating point exception: invalid operation \(NaN "
                                    r"result\) in sqrt") as info:
        _run(lambda a: torch.sqrt(a), torch.tensor([-1.0]))
    assert info.value.type == "poplar_application_runtime_error"


def test_an_infinity_from_finite_inputs_is_an_overflow():
    with pytest.raises(Error, match="overflow or division by zero"):
        _run(lambda a: a / 0.0, torch.tensor([1.0]))
    with pytest.raises(Error, match="overflow or division by zero"):
        _run(lambda a: torch.log(a), torch.tensor([0.0]))


def test_non_finite_values_given_to_an_op_pass_through():
    inf = torch.tensor([float("inf")])
    assert torch.isinf(_run(lambda a: a * 2, inf)).all()
    nan = torch.tensor([float("nan")])
    assert torch.isnan(_run(lambda a: a + 1, nan)).all()


def test_a_comparison_reading_a_nan_is_refused():
    with pytest.raises(Error, match="a comparison read a NaN"):
        _run(lambda a: torch.lt(a, 0.0), torch.tensor([float("nan")]))
    assert _run(lambda a: torch.lt(a, 0.0), torch.tensor([-1.0])).tolist() == [True]
