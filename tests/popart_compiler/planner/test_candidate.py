"""popart_compiler/planner/candidate.py: a candidate's stages, its assembled program
and its whole-program estimate."""

from popart_compiler.planner.candidate import Candidate, assemble, full_estimate, settings
from popart_compiler.planner.problem import StageSpec


def test_stages_in_pipeline_order_with_the_head_on_ipu_0():
    c = Candidate(((0, 1), (2, 4)), head=5, checkpoints=(True, False, True))
    assert (c.num_ipus, c.num_stages) == (2, 3)
    assert c.stages(7) == [(0, StageSpec(0, 1, 0, 3, True)), (1, StageSpec(2, 4, 1, 3, False)),
                           (0, StageSpec(5, 6, 2, 3, True))]
    assert c.stages_of(0, 7) == [StageSpec(0, 1, 0, 3, True), StageSpec(5, 6, 2, 3, True)]
    assert Candidate(((0, 6),)).stages(7) == [(0, StageSpec(0, 6, 0, 1, None))]


def test_assemble_places_each_units_ops_on_its_ipu(inference_problem):
    p = inference_problem
    costs = assemble(p, Candidate(((0, 0), (1, 3)), proportions=(0.6, 0.6)))
    units = p.units
    assert [op.ipu for op in costs.ops] == \
        [0] * (units[0].hi - units[0].lo) + [1] * (units[3].hi - units[1].lo)
    assert [op.stage for op in costs.ops] == [op.ipu for op in costs.ops]
    assert costs.num_ipus == 2 and costs.stages == [(0, 0), (1, 1)]
    # each layer's weight lives on the IPU whose ops read it
    assert sorted(w.ipus for w in costs.weights) == [(0,), (0,), (1,), (1,), (1,), (1,),
                                                     (1,), (1,)]


def test_settings_and_estimate_follow_the_candidates_knobs(inference_problem):
    p = inference_problem
    c = Candidate(((0, 1), (2, 3)), proportions=(0.3, 0.6))
    memory, cycles = settings(p, c, micro_batches=4)
    assert memory.available_memory == {0: 0.3, 1: 0.6} and cycles.micro_batches == 4
    est = full_estimate(p, c, 4)
    assert len(est.memory) == 2 and est.fits
    assert [s.name for s in est.cycles.stages] == ["forward 0 (IPU 0)", "forward 1 (IPU 1)"]
    assert est.cycles.run_cycles >= est.cycles.pipeline_cycles > 0
