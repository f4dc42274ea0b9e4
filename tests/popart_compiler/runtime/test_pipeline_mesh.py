"""popart_compiler/runtime/pipeline_mesh.py: the processes' places in a pipeline run
and the gradient sums over the processes holding each parameter (4 processes: 2
replicas × 2 stages, ``pipeline_worker.py``)."""
import pytest

from popart_compiler.errors import Error
from popart_compiler.runtime.pipeline_mesh import PipelineMesh


class _Group:
    rank, size = 0, 3


def test_the_processes_must_be_a_multiple_of_the_stages():
    with pytest.raises(Error, match="This pipeline has 2 stages, so the number of processes "
                                    "must be a multiple of 2 .* but 3 were started"):
        PipelineMesh(_Group(), 2, "cpu")


def test_process_r_runs_stage_r_mod_p_of_replica_r_div_p(four_processes):
    assert [(r["stage"], r["replica"], r["replicas"]) for r in four_processes] == [
        (0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)]
    assert [r["rank_of"] for r in four_processes] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_gradients_flow_back_on_connections_of_their_own(four_processes):
    # the pipeline's processes, in a group that is neither the activations' nor the
    # host reads'
    assert [r["grad_group"] for r in four_processes] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r["grad_group_own"] for r in four_processes)


def test_each_gradient_is_summed_over_the_processes_that_hold_it(four_processes):
    # tied: every process (1 + 2 + 3 + 4); a: stage 0 of both replicas, where process 0
    # had none (10 × 3); b: stage 1 of both replicas (100 × (2 + 4))
    stage0 = {"tied": [10.0, 10.0], "a": [30.0, 30.0]}
    stage1 = {"tied": [10.0, 10.0], "b": [600.0, 600.0]}
    assert [r["sums"] for r in four_processes] == [stage0, stage1, stage0, stage1]


def test_every_stage_gets_each_parameters_norm_from_its_owner(four_processes):
    # norms of process r: r + 0.5; tied and a are owned by stage 0, b by stage 1
    assert [r["norms"] for r in four_processes] == [
        [0.5, 0.5, 1.5], [0.5, 0.5, 1.5], [2.5, 2.5, 3.5], [2.5, 2.5, 3.5]]
