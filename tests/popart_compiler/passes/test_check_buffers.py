"""``check_buffers`` (passes/checks.py): buffers written in place while replicas take
different data need ``broadcastBuffers(False)`` (docs/semantics.md S-36). Graph in, the same graph
out, or an ``Error``."""
import pytest
import torch

from models import MLP, BNClassifier, export
from popart_compiler.errors import Error
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.checks import check_buffers
from popart_compiler.session_options import SessionOptions


def bn_graph():
    return export(BNClassifier().train(), torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))


def test_mutated_buffers_are_those_of_batch_norm():
    assert bn_graph().mutated_buffers == {"bn.running_mean", "bn.running_var",
                                          "bn.num_batches_tracked"}


@pytest.mark.parametrize("options,training", [
    (SessionOptions(), True),  # one replica
    (SessionOptions(replication_factor=2, broadcast_buffers=False), True),
    (SessionOptions(replication_factor=2, input_group_size=2), True),  # same data
    (SessionOptions(num_processes=2), False),  # inference processes run on their own
    # PopRun: the rule counts the local replicas (one per process here), as PopTorch
    (SessionOptions(num_processes=2), True),
])
def test_allowed_in_place_buffer_updates(run_pass, options, training):
    g = bn_graph()
    before = g.module.code
    result = run_pass(check_buffers, g, Compilation(options, training))
    assert result.graph is g and result.changed is False and g.module.code == before


def test_replicas_without_in_place_buffers_pass(run_pass):
    result = run_pass(check_buffers, export(MLP(), torch.randn(2, 4)),
                      Compilation(SessionOptions(replication_factor=4), True))
    assert result.changed is False


@pytest.mark.parametrize("options,training", [
    (SessionOptions(replication_factor=2), True),
    (SessionOptions(replication_factor=2), False),
    (SessionOptions(replication_factor=4, input_group_size=2), True),
])
def test_replicas_with_different_data_need_broadcast_off(options, training):
    with pytest.raises(Error, match=r"PopTorch does not support broadcasting buffers\..*"
                                    r"poptorch\.Options\.broadcastBuffers\(False\)\. "
                                    r"Buffers modified in place: \['bn\.num_batches_tracked', "
                                    r"'bn\.running_mean', 'bn\.running_var'\]\."):
        check_buffers(bn_graph(), Compilation(options, training))
