"""Options from a file of setter calls or from JSON (docs/api-sections.md options §6): what
``Options.loadFromFile`` and ``Options.from_json`` (and ``POPTORCH_DEFAULT_OPTIONS``)
do. Behaviour follows PopTorch 3.x."""
from __future__ import annotations

import enum
import json
import os
import sys

from poptorch import enums

__all__ = ["ConfigFileError", "load_file", "apply_json"]


class ConfigFileError(Exception):
    """Raised by :meth:`Options.loadFromFile` when the file has a Python syntax
    error. Message: ``"<ErrorClass> at line <n> of <basename>: <detail>\\n> <line>"``
    where ``<n>`` counts only retained command lines. Same as PopTorch."""


def _convert_json_value(value):
    """``"<EnumName>.<Member>"`` → the member of ``poptorch.enums.<EnumName>``."""
    if isinstance(value, str) and "." in value:
        enum_name, member = value.split(".", 1)
        enum_cls = getattr(enums, enum_name, None)
        if isinstance(enum_cls, type) and issubclass(enum_cls, enum.Enum):
            if member not in enum_cls.__members__:
                raise ValueError(f"{member} is not a member of poptorch.{enum_name}")
            return enum_cls[member]
    return value


def load_file(options, filepath: str) -> None:
    """Run the setter calls of ``filepath`` on ``options`` (see
    ``Options.loadFromFile``).

    Raises:
        ConfigFileError: a Python syntax error in the file.
    """
    commands = []
    with open(filepath, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            commands.append("options." + line)
    code = "\n".join(commands)
    try:
        compiled = compile(code, f"<options file {os.path.basename(filepath)}>", "exec")
    except SyntaxError as err:
        lineno = min(max(err.lineno or 1, 1), max(len(commands), 1))
        offending = commands[lineno - 1] if commands else ""
        raise ConfigFileError(f"{type(err).__name__} at line {lineno} of "
                              f"{os.path.basename(filepath)}: {err.msg}\n> "
                              f"{offending}") from None
    exec(compiled, {"poptorch": sys.modules["poptorch"], "options": options})  # noqa: S102


def apply_json(options, string: str) -> None:
    """Apply a JSON object of accessor paths → arguments to ``options`` (see
    ``Options.from_json``).

    Raises:
        ValueError: invalid JSON, not an object, or an unknown enum member.
        AttributeError: an unknown accessor.
    """
    data = json.loads(string)
    if not isinstance(data, dict):
        raise ValueError("The JSON options must be an object mapping accessor paths "
                         f"to values, got {type(data).__name__}")
    for path, value in data.items():
        target = options
        for attr in path.split("."):
            target = getattr(target, attr)
        args = value if isinstance(value, list) else [value]
        target(*[_convert_json_value(a) for a in args])
