"""popart_compiler/planner/search.py: branch and bound finds the fastest placement that
fits (checked against every placement of a small space), closest() when none fits."""
import itertools

import pytest

from popart_compiler.cost.cycle_model import Stage
from popart_compiler.planner.candidate import Candidate
from popart_compiler.planner.search import Space, closest, evaluate, score, search


def _every_two_ipu_placement(problem, micro_batches):
    n = len(problem.units)
    for cut, props in itertools.product(range(n - 1), itertools.product(
            problem.proportions, repeat=2)):
        candidate = Candidate(((0, cut), (cut + 1, n - 1)), None, None, props)
        yield evaluate(problem, candidate, micro_batches)


@pytest.mark.parametrize("problem", ["inference_problem", "training_problem"])
def test_search_finds_the_fastest_fitting_placement(problem, request):
    p = request.getfixturevalue(problem)
    best = search(p, Space(num_ipus=2, micro_batches=8, checkpoint_modes=(False,)))
    brute = min((s for s in _every_two_ipu_placement(p, 8) if s.fits),
                key=lambda s: s.step_cycles)
    assert best.fits and best.step_cycles == pytest.approx(brute.step_cycles)
    assert best.candidate.ranges[0][0] == 0 and best.candidate.ranges[-1][1] == 3
    again = evaluate(p, best.candidate, 8)
    assert again.step_cycles == pytest.approx(best.step_cycles)


def test_too_few_micro_batches_for_the_pipeline_leave_nothing_to_search(training_problem):
    # training over 2 stages needs gradientAccumulation >= 2 x 2 - 1
    assert search(training_problem, Space(num_ipus=2, micro_batches=2)) is None
    assert search(training_problem, Space(num_ipus=2, micro_batches=3)) is not None


def test_when_nothing_fits_closest_gives_the_least_full_placement(small_problem):
    p = small_problem  # 4 tiles: 2.5 MB per IPU
    space = Space(num_ipus=2, micro_batches=8, checkpoint_modes=(False,))
    assert search(p, space) is None
    found = closest(p, space)
    assert not found.fits
    least = min(max(s.totals) for s in _every_two_ipu_placement(p, 8))
    assert max(found.totals) == pytest.approx(least)


def test_score_is_the_pipeline_plus_the_update_in_training(training_problem):
    p = training_problem
    scored = evaluate(p, Candidate(((0, 1), (2, 3)), None, None, (0.6, 0.6)), 8)
    assert scored.samples_per_second > 0
    step, samples = score(p, [Stage("forward 0 (IPU 0)", 0, 100.0, 100.0)], 50.0, 8)
    assert step == pytest.approx(8 * 100.0 + 50.0) and samples > 0
