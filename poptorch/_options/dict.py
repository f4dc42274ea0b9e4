"""The "safe dictionary" behind every ``poptorch.Options`` group (docs/api-sections.md options §1).

:class:`OptionsDict` stores option values type-checked against their current value,
readable as attributes, freezable; deep copies are unfrozen. Behaviour follows PopTorch.
"""
from __future__ import annotations

import copy
from typing import Any

__all__ = ["OptionsDict", "UnfrozenCopies", "FROZEN_MESSAGE", "check_type", "check_int",
           "check_bool", "check_proportion", "check_strings"]

FROZEN_MESSAGE = "Can't modify frozen Options"
_MACHINERY = ("_values", "_is_frozen", "_initialized")


def _type_names(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join("None" if t is type(None) else t.__name__ for t in types)


def check_type(option: str, value: Any, types) -> None:
    """Raise ``AssertionError`` "<option> must be <types>, got <type>" unless
    ``value`` is an instance of ``types`` (a ``bool`` is never accepted as an
    ``int``)."""
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise AssertionError(f"{option} must be {_type_names(allowed)}, got "
                             f"{type(value).__name__} {value!r}")


def check_int(option: str, value: Any, minimum: int = 0) -> int:
    """An ``int`` (not a ``bool``) of at least ``minimum``.

    Raises:
        AssertionError: not an int.
        ValueError: "<option> must be an integer >= <minimum>, got <value>".
    """
    check_type(option, value, int)
    if value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{option} must be {kind}, got {value}")
    return value


def check_bool(option: str, value: Any) -> bool:
    """``AssertionError`` "<option> must be bool, got ..." unless a ``bool``."""
    check_type(option, value, bool)
    return value


def check_proportion(option: str, value: Any) -> float:
    """A real number in ``[0, 1]``.

    Raises:
        AssertionError: not an int or float.
        ValueError: outside ``[0, 1]`` (or NaN).
    """
    check_type(option, value, (float, int))
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{option} must be a proportion between 0 and 1, got {value}")
    return float(value)


def check_strings(option: str, values: Any) -> None:
    """``AssertionError`` unless ``values`` is a list (or tuple) of str."""
    check_type(option, values, (list, tuple))
    for value in values:
        check_type(f"{option} entries", value, str)


class UnfrozenCopies:
    """Copying and pickling of an option group: ``copy.deepcopy`` returns an unfrozen
    copy; pickling keeps every attribute (frozen state included)."""

    def __deepcopy__(self, memo):
        result = type(self).__new__(type(self))
        memo[id(self)] = result
        for key, value in self.__dict__.items():
            object.__setattr__(result, key, copy.deepcopy(value, memo))
        object.__setattr__(result, "_is_frozen", False)
        return result

    def __getstate__(self):
        return dict(self.__dict__)

    def __setstate__(self, state):
        self.__dict__.update(state)


class _OptionsMeta(type):
    """Marks an option group as fully constructed once ``__init__`` has returned
    (new private attributes are rejected afterwards)."""

    def __call__(cls, *args, **kwargs):
        obj = super().__call__(*args, **kwargs)
        object.__setattr__(obj, "_initialized", True)
        return obj


class OptionsDict(UnfrozenCopies, metaclass=_OptionsMeta):
    """A "safe dictionary" of option values (docs/api-sections.md options §1). Behaviour follows
    PopTorch.

    * ``set(**kw)``: only existing keys; a new value must be an instance of the
      type of the current one (``AssertionError`` "Unexpected type <t> for option
      <k>. Expected <t0>"); unknown key → ``AssertionError`` "Invalid option <k>,
      valid options are <keys>"; integer keys listed in ``_int_ranges`` must also
      be in range (``ValueError``).
    * Values are readable as attributes (unknown → ``AttributeError`` "Invalid
      attribute <k>."); assigning a public attribute is ``set``; creating a new
      private attribute after construction → ``AttributeError`` "Invalid private
      attribute <k>. Valid attributes: [...]".
    * ``obj("key")`` returns the value.
    * Frozen groups reject every mutation with ``AttributeError`` "Can't modify
      frozen Options"; ``copy.deepcopy`` returns an unfrozen copy; pickling keeps
      everything.
    """

    #: private attributes left out of ``repr`` (references to other groups)
    _repr_excludes: tuple = ()
    #: key → (setter name used in messages, minimum) for integer values with a lower
    #: bound, checked by :meth:`set` whichever way the value is set.
    _int_ranges: dict = {}

    def __init__(self, **default_values):
        object.__setattr__(self, "_values", dict(default_values))
        object.__setattr__(self, "_is_frozen", False)

    # -- freezing ------------------------------------------------------------
    def _check_not_frozen(self) -> None:
        if self.__dict__.get("_is_frozen", False):
            raise AttributeError(FROZEN_MESSAGE)

    def _freeze(self) -> None:
        """Reject every further mutation (``AttributeError`` "Can't modify frozen
        Options")."""
        object.__setattr__(self, "_is_frozen", True)

    def _unfreeze(self) -> None:
        """Allow mutations again."""
        object.__setattr__(self, "_is_frozen", False)

    # -- dictionary helpers ----------------------------------------------------
    def set(self, **kwargs):
        """Set existing options (type-checked, see class docstring). Returns self.

        Raises:
            AssertionError: unknown key or wrong type.
            ValueError: an integer out of its range (``_int_ranges``).
            AttributeError: "Can't modify frozen Options".
        """
        self._check_not_frozen()
        for option, value in kwargs.items():
            if option not in self._values:
                raise AssertionError(f"Invalid option {option}, valid options are "
                                     f"{list(self._values.keys())}")
            expected = type(self._values[option])
            if not isinstance(value, expected):
                raise AssertionError(f"Unexpected type {type(value)} for option "
                                     f"{option}. Expected {expected}")
            if option in self._int_ranges:  # a bool passes as an int (PopTorch)
                setter, minimum = self._int_ranges[option]
                check_int(setter, int(value), minimum)
        self._values.update(kwargs)
        return self

    def createOrSet(self, **kwargs):
        """Set options, creating the keys that do not exist yet (existing keys are
        type-checked like :meth:`set`). Returns self. ``AttributeError`` when frozen."""
        self._check_not_frozen()
        for option, value in kwargs.items():
            if option in self._values:
                self.set(**{option: value})
            else:
                self._values[option] = value
        return self

    def exists(self, option: str) -> bool:
        """``True`` if ``option`` is a key of this group."""
        return option in self._values

    def deleteIfExists(self, option: str) -> None:
        """Remove ``option`` if present. ``AttributeError`` when frozen."""
        self._check_not_frozen()
        self._values.pop(option, None)

    def update(self, other: dict) -> dict:
        """Merge this group's values into ``other`` and return it.

        Raises:
            AssertionError: "Can't merge dictionaries, they have some keys in
                common".
        """
        if set(self._values).intersection(other):
            raise AssertionError("Can't merge dictionaries, they have some keys in common")
        other.update(self._values)
        return other

    def toDict(self) -> dict:
        """A (shallow) copy of this group's values."""
        return self.update({})

    def __call__(self, option: str):
        if option not in self._values:
            raise AssertionError(f"Invalid option {option}, valid options are "
                                 f"{list(self._values.keys())}")
        return self._values[option]

    # -- attribute protocol ----------------------------------------------------
    def __getattr__(self, option: str):
        if option.startswith("__"):
            raise AttributeError(option)
        values = self.__dict__.get("_values")
        if values is not None and option in values:
            return values[option]
        raise AttributeError(f"Invalid attribute {option}.")

    def __setattr__(self, option: str, value: Any) -> None:
        if option.startswith("_"):
            self._check_not_frozen()
            if (self.__dict__.get("_initialized", False) and option not in self.__dict__
                    and not hasattr(type(self), option)):
                valid = [k for k in self.__dict__ if k.startswith("_") and k not in _MACHINERY]
                raise AttributeError(f"Invalid private attribute {option}. "
                                     f"Valid attributes: {valid}")
            object.__setattr__(self, option, value)
        else:
            self.set(**{option: value})


    # -- printing --------------------------------------------------------------
    def _private_items(self):
        return [(k, v) for k, v in self.__dict__.items()
                if k.startswith("_") and k not in _MACHINERY and k not in self._repr_excludes]

    def __repr__(self) -> str:
        items = list(self._values.items()) + self._private_items()
        return f"{type(self).__name__}(" + ", ".join(f"{k}={v!r}" for k, v in items) + ")"

