"""popart_compiler/planner/problem.py: one IPU's estimate for every proportion, and
the IPUs of a placement adding up to the estimate of the whole placed program."""
import copy

import numpy as np
import pytest

from popart_compiler.planner.candidate import Candidate, full_estimate
from popart_compiler.planner.problem import DEFAULT_PROPORTIONS, StageSpec, Unit
from popart_compiler.planner.search import evaluate


def test_an_ipu_is_estimated_for_each_proportion(inference_problem):
    p = inference_problem
    ev = p.evaluate(0, 2, [StageSpec(0, 1, 0, 2)])
    assert ev.totals.shape == (2,) and len(ev.forward) == len(ev.backward) == 1
    assert np.all(ev.totals > 0) and np.all(ev.forward[0] > 0)
    assert np.all(ev.backward[0] == 0) and ev.update == 0.0  # inference
    assert p.evaluate(0, 2, [StageSpec(0, 1, 0, 2)]) is ev  # cached


def test_training_adds_backward_and_update_work(training_problem):
    ev = training_problem.evaluate(1, 2, [StageSpec(2, 3, 1, 2)])
    assert np.all(ev.backward[0] > ev.forward[0]) and ev.update > 0


@pytest.mark.parametrize("problem", ["inference_problem", "training_problem"])
def test_the_ipus_of_a_placement_add_up_to_the_whole_estimate(problem, request):
    p = request.getfixturevalue(problem)
    candidate = Candidate(((0, 0), (1, 3)), None, None, (0.6, 0.3))
    scored = evaluate(p, candidate, 8)
    whole = full_estimate(p, candidate, 8)
    assert scored.totals == pytest.approx(tuple(m.total for m in whole.memory))
    step = whole.cycles.pipeline_cycles + (whole.cycles.update_cycles if p.training else 0)
    assert scored.step_cycles == pytest.approx(step)
    assert scored.samples_per_second == pytest.approx(whole.cycles.samples_per_second)


def test_markers_present_and_valid_placements(inference_problem):
    p = inference_problem
    assert p.proportions == (0.3, 0.6) and DEFAULT_PROPORTIONS[0] == 0.1
    assert p.present([StageSpec(0, 3, 0, 1)]) == set()
    assert p.valid([StageSpec(0, 3, 0, 1)])
    # autoRecomputation is Pipeline (PopTorch's default): the program recomputes anyway
    assert p.user_recomputes and p.valid([StageSpec(0, 3, 0, 1, checkpoint=True)])
    marked = [Unit("a", True, 0, 1, ("m0",)), Unit("b", True, 1, 2, ("m1",)),
              Unit("c", False, 2, 3)]
    p2 = copy.copy(p)
    p2.units, p2.user_recomputes = marked, False
    # planner checkpoints without a single marker present: the program without them
    assert not p2.valid([StageSpec(0, 2, 0, 1, checkpoint=False)])
    stages = [StageSpec(0, 1, 0, 2, checkpoint=False), StageSpec(2, 2, 1, 2, False)]
    assert p2.present(stages) == {"m1"}  # the stage's last layer output only
    assert p2.present([StageSpec(0, 1, 0, 2, True), StageSpec(2, 2, 1, 2, True)]) == \
        {"m0", "m1"}
    assert p2.valid(stages)
    assert StageSpec(2, 2, 1, 2).final and not StageSpec(0, 1, 0, 2).final
