"""``check_inputs`` (passes/checks.py): the dtypes the IPU takes as inputs and outputs
(docs/semantics.md S-45; complex values only inside the graph) and no zero-sized user input or
output (docs/semantics.md S-3). Graph in, the same graph out, or an ``Error``."""
import pytest
import torch
import torch.nn as nn

from models import export
from popart_compiler.errors import Error
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.checks import check_inputs
from popart_compiler.session_options import SessionOptions


def check(run_pass, graph):
    return run_pass(check_inputs, graph, Compilation(SessionOptions(), False))


class Scale(nn.Module):
    def forward(self, x):
        return x * 2


class ComplexInside(nn.Module):
    """A complex intermediate (torch.fft), a real output."""

    def forward(self, x):
        return torch.fft.fft(x).abs()


class ComplexOutput(nn.Module):
    def forward(self, x):
        return torch.fft.fft(x)


class EmptyInside(nn.Module):
    """A zero-sized intermediate concatenated to the input (an empty key/value cache)."""

    def forward(self, x):
        return torch.cat([x.new_zeros(0, 3), x]) + 1


@pytest.mark.parametrize("module,args", [
    (Scale(), (torch.randn(2, 3),)),
    (Scale(), (torch.ones(2, dtype=torch.float16),)),
    (Scale(), (torch.ones(2, dtype=torch.int32),)),
    (ComplexInside(), (torch.randn(8),)),
    (EmptyInside(), (torch.randn(2, 3),)),
], ids=["float32", "float16", "int32", "complex_inside", "empty_inside"])
def test_supported_inputs_and_outputs_leave_the_graph_unchanged(run_pass, module, args):
    g = export(module, *args)
    before = g.module.code
    result = check(run_pass, g)
    assert result.graph is g and result.changed is False and g.module.code == before


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "BFloat16"),
                                        (torch.complex64, "ComplexFloat"),
                                        (torch.complex128, "ComplexDouble")])
def test_unsupported_input_dtype(dtype, name):
    g = export(Scale(), torch.ones(2, dtype=dtype))
    with pytest.raises(Error, match=f"Unsupported tensor input type from pytorch: {name}. "
                                    r"Convert it with \.float\(\) or \.half\(\)"):
        check_inputs(g, Compilation(SessionOptions(), False))


def test_complex_output_names_the_alternatives():
    g = export(ComplexOutput(), torch.randn(8))
    with pytest.raises(Error, match=r"Unsupported tensor output type: ComplexFloat\. The "
                                    r"IPU has no complex or bfloat16 types.*"
                                    r"torch\.view_as_real\(x\)"):
        check_inputs(g, Compilation(SessionOptions(), False))


def test_zero_sized_input():
    g = export(Scale(), torch.ones(0, 2, 5))
    with pytest.raises(Error, match=r"Zero-sized tensors are unsupported \(Got shape "
                                    r"\[0, 2, 5\]\)"):
        check_inputs(g, Compilation(SessionOptions(), False))


def test_zero_sized_output():
    class EmptyOutput(nn.Module):
        def forward(self, x):
            return x + 1, x.new_zeros(3, 0)

    g = export(EmptyOutput(), torch.ones(2))
    with pytest.raises(Error, match=r"Zero-sized tensors are unsupported \(Got shape "
                                    r"\[3, 0\]\)"):
        check_inputs(g, Compilation(SessionOptions(), False))
