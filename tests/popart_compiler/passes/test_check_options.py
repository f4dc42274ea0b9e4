"""``check_options`` (passes/checks.py): output-mode periods against
``device_iterations`` (docs/semantics.md S-12), positive batching factors, no gradient accumulation
in inference, a valid distributed process id. Graph in, the same graph out, or an ``Error``."""
import pytest
import torch

from models import MLP, export
from popart_compiler.enums import OutputMode
from popart_compiler.errors import Error
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.checks import check_options
from popart_compiler.session_options import Anchor, SessionOptions


def graph():
    return export(MLP(), torch.randn(2, 4))


@pytest.mark.parametrize("options,training", [
    (SessionOptions(), False),
    (SessionOptions(device_iterations=6, output_mode=OutputMode.EveryN,
                    output_return_period=3), False),
    (SessionOptions(gradient_accumulation=4, replication_factor=2), True),
    (SessionOptions(num_processes=2, process_id=1), False),
    (SessionOptions(device_iterations=4,
                    anchors=[Anchor("Relu:0", OutputMode.EveryN, 2)]), False),
])
def test_valid_options_leave_the_graph_unchanged(run_pass, options, training):
    g = graph()
    before = g.module.code
    c = Compilation(options, training)
    result = run_pass(check_options, g, c)
    assert result.graph is g and result.changed is False
    assert g.module.code == before
    assert c.loss_index is None and c.placement is None  # a check records nothing


@pytest.mark.parametrize("options,training,message", [
    (SessionOptions(device_iterations=2, output_mode=OutputMode.EveryN,
                    output_return_period=4), False,
     r"Return period must be <= to the number of batches per step \(4 > 2\)\."),
    (SessionOptions(device_iterations=6, output_mode=OutputMode.EveryN,
                    output_return_period=4), False,
     r"Return period must be a factor of the number of batches per step \(6 % 4 != 0\)\."),
    (SessionOptions(device_iterations=4,
                    anchors=[Anchor("Relu:0", OutputMode.EveryN, 3)]), False,
     "Return period of anchor Relu:0 must be <= to and a factor of the number of "
     "batches per step."),
    (SessionOptions(device_iterations=2,
                    anchors=[Anchor("Relu:0", OutputMode.EveryN, 4)]), False,
     "Return period of anchor Relu:0 must be <= to and a factor"),
    (SessionOptions(gradient_accumulation=2), False,
     "Gradient accumulation must be 1 for an inference model."),
    (SessionOptions(replication_factor=0), False,
     "deviceIterations, replicationFactor and gradientAccumulation must be positive "
     "integers."),
    (SessionOptions(device_iterations=0), False, "must be positive integers"),
    (SessionOptions(gradient_accumulation=0), True, "must be positive integers"),
    (SessionOptions(num_processes=2, process_id=2), True,
     r"Invalid distributed process 2 of 2: Options.Distributed.configureProcessId\(id, "
     r"n\) needs 0 <= id < n\."),
    (SessionOptions(num_processes=0), False, "Invalid distributed process 0 of 0"),
    (SessionOptions(num_processes=2, process_id=-1), False,
     "Invalid distributed process -1 of 2"),
])
def test_invalid_options_raise(options, training, message):
    with pytest.raises(Error, match=message) as info:
        check_options(graph(), Compilation(options, training))
    assert info.value.type == "poptorch_cpp_error"
