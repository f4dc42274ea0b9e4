"""Tests mirror the compiler: every module of popart_compiler's planner/, cost/,
runtime/ and backends/ has its own test module,
tests/popart_compiler/<package>/test_<module>.py."""
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("planner", "cost", "runtime", "backends")


def missing_test_modules(root: pathlib.Path = ROOT):
    """``popart_compiler/<package>/<module>.py`` paths without
    ``tests/popart_compiler/<package>/test_<module>.py``."""
    missing = []
    for package in PACKAGES:
        for source in sorted((root / "popart_compiler" / package).glob("*.py")):
            if source.name == "__init__.py":
                continue
            test = root / "tests" / "popart_compiler" / package / f"test_{source.name}"
            if not test.is_file():
                missing.append(source.relative_to(root).as_posix())
    return missing


@pytest.mark.parametrize("package", PACKAGES)
def test_the_packages_have_modules(package):
    assert len(list((ROOT / "popart_compiler" / package).glob("*.py"))) > 2


def test_every_module_has_its_test_module():
    assert missing_test_modules() == []


def test_a_module_without_tests_is_reported(tmp_path):
    (tmp_path / "popart_compiler" / "cost").mkdir(parents=True)
    (tmp_path / "popart_compiler" / "cost" / "new_model.py").write_text("")
    (tmp_path / "popart_compiler" / "cost" / "__init__.py").write_text("")
    for package in PACKAGES[:1] + PACKAGES[2:]:
        (tmp_path / "popart_compiler" / package).mkdir(parents=True)
    assert missing_test_modules(tmp_path) == ["popart_compiler/cost/new_model.py"]
    (tmp_path / "tests" / "popart_compiler" / "cost").mkdir(parents=True)
    (tmp_path / "tests" / "popart_compiler" / "cost" / "test_new_model.py").write_text("")
    assert missing_test_modules(tmp_path) == []
