"""popart_compiler/runtime/pipeline_service.py: a host read of another stage's state,
answered by its owner's service thread (4 processes, ``pipeline_worker.py``)."""
from popart_compiler.runtime.pipeline_service import StateStats


def test_each_process_fetches_the_other_stages_weight_from_its_owner(four_processes):
    # process r's own weight is r + 1; the other stage of its replica is rank r ^ 1
    assert [r["fetched"] for r in four_processes] == [
        [2.0] * 3, [1.0] * 3, [4.0] * 3, [3.0] * 3]
    for r in four_processes:
        assert r["fetched_versions"] == [[[1 - r["stage"], "weights"], [0, 0]]]


def test_each_read_and_answer_is_counted(four_processes):
    # one read made and one answered by each process; 3 float32 received
    assert [r["stats"] for r in four_processes] == [[1, 1, 12]] * 4
    assert StateStats() == StateStats(0, 0, 0, 0, 0.0)
