"""The op-coverage rule (issue 7): every ATen op whose output shapes do not depend on
tensor values runs on the IPU Model, in inference and training, equal to plain PyTorch.

A sweep over more than 200 distinct ATen ops (``op_sweep_cases.py``), one capture per
case and mode, plus the count of distinct ATen ops the captured graphs contain. The
sweep takes two to three minutes on two cores, so it is marked slow (it runs in CI).
"""
import importlib.util
import sys
from pathlib import Path

import pytest


def _load(name):
    """Load a helper module of this directory (tests are not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(
            f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


sweep = _load("op_sweep")
CASES = _load("op_sweep_cases").CASES
_OPS_SEEN = {}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_inference_equals_plain_pytorch(case):
    _OPS_SEEN[case.name] = sweep.check_inference(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.grad],
                         ids=[c.name for c in CASES if c.grad])
def test_one_training_step_equals_plain_pytorch(case):
    sweep.check_training(case)


def test_case_names_are_unique():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))


@pytest.mark.slow
def test_sweep_covers_more_than_200_distinct_aten_ops():
    ops = set()
    for case in CASES:
        if case.name not in _OPS_SEEN:  # this test runs alone: capture the case here
            _OPS_SEEN[case.name] = sweep.check_inference(case)
        ops |= _OPS_SEEN[case.name]
    aten = {op for op in ops if op.startswith("aten::")}
    assert len(aten) >= 200, sorted(aten)
