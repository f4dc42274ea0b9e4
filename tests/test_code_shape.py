"""The code's shape, as DEVELOPERS.md asks: no line over 100 characters in poptorch/,
popart_compiler/, bench/ and tests/ (the ``line-length`` of ``[tool.ruff]`` and
``[tool.black]`` in pyproject.toml), and no module of poptorch/ or popart_compiler/ over
600 lines (split by responsibility, never packed). Pure Python: no linter is needed."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINE = 100
MAX_LINES = 600
LINE_DIRS = ("poptorch", "popart_compiler", "bench", "tests")
FILE_DIRS = ("poptorch", "popart_compiler")


def _sources(dirs):
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py")
                  if "__pycache__" not in p.parts)


def long_lines(path: pathlib.Path, limit: int = MAX_LINE):
    """``[(line number, length)]`` of the lines of ``path`` longer than ``limit``
    characters (Unicode characters, as ruff counts them)."""
    text = path.read_text(encoding="utf-8")
    return [(i, len(line)) for i, line in enumerate(text.splitlines(), 1)
            if len(line) > limit]


def test_the_sources_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in _sources(LINE_DIRS)}
    assert "poptorch/options.py" in names and "tests/test_code_shape.py" in names
    assert "popart_compiler/enums.py" in names and any(n.startswith("bench/") for n in names)


def test_no_line_is_longer_than_100_characters():
    found = {p.relative_to(ROOT).as_posix(): long_lines(p) for p in _sources(LINE_DIRS)}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_no_module_is_longer_than_600_lines():
    lengths = {p.relative_to(ROOT).as_posix():
               len(p.read_text(encoding="utf-8").splitlines()) for p in _sources(FILE_DIRS)}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def test_the_checker_counts_characters_and_finds_a_long_line(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("x = 1\n" + "#" * 101 + "\n" + "é" * 100 + "\n", encoding="utf-8")
    assert long_lines(sample) == [(2, 101)]


@pytest.mark.parametrize("section", ["tool.ruff", "tool.black"])
def test_the_formatters_are_configured_with_the_same_limit(section):
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    body = text.split(f"[{section}]\n", 1)[1].split("\n[", 1)[0]
    assert re.search(rf"^line-length = {MAX_LINE}$", body, re.M), body


#: The top-level modules of poptorch/: the public ones, ``__init__`` and the private
#: names PopTorch programs import (everything else lives in a subpackage).
TOP_LEVEL = {"__init__", "enums", "options", "optim", "ops", "profiling", "testing",
             "poptorch_core", "_poplar_executor", "_impl", "_logging", "_utils"}


def test_poptorch_has_only_its_twelve_top_level_modules():
    found = {p.stem for p in (ROOT / "poptorch").glob("*.py")}
    assert found == TOP_LEVEL
