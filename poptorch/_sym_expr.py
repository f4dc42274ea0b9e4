"""The grammar symbolic sizes of a stored program must follow (issue 19, item 1).

``torch.export`` writes a symbolic size, stride or condition as text
(``{"as_expr": {"expr_str": "s0 + 1"}}``) and its deserializer parses it with
``sympy.sympify``, which *evaluates* the text as Python. Before any file reaches that
deserializer, every such text is parsed here, by a small recursive-descent parser that
evaluates nothing, and must be:

* an arithmetic expression (sizes, strides, offsets, symbolic floats)::

      sum   := prod (("+" | "-") prod)*
      prod  := unary (("*" | "/") unary)*
      unary := "-" unary | power
      power := atom ("**" INTEGER)?            # exponent 0..8
      atom  := NUMBER | SYMBOL | "(" sum ")" | FUNC "(" sum ("," sum)* ")"
      FUNC  := FloorDiv | CeilDiv | CleanDiv | Mod | PythonMod | Max | Min | Abs
             | ToFloat | TruncToFloat | TruncToInt | FloorToInt | CeilToInt
             | RoundToInt | IntTrueDiv | FloatTrueDiv | FloatPow | PowByNatural
             | Identity

* or a condition (symbolic booleans)::

      bool  := bterm ("|" bterm)*
      bterm := bnot ("&" bnot)*
      bnot  := "~" bnot | True | False | sum CMP sum | "(" bool ")"
             | (Eq | Ne | Lt | Le | Gt | Ge) "(" sum "," sum ")"
             | (And | Or) "(" bool ("," bool)* ")" | Not "(" bool ")"
      CMP   := "==" | "!=" | "<" | "<=" | ">" | ">="

``SYMBOL`` is a ``torch.export`` symbol (``s<n>``, ``u<n>``, ``zf<n>``, ``zuf<n>``),
``NUMBER`` an integer or decimal literal of at most 40 characters; the text is at most
4,096 characters and 64 levels deep. A text that passes contains only those names,
numbers, the functions ``torch.export`` itself passes to ``sympify`` and operators, so
``sympify`` builds a SymPy expression from it and runs nothing else.
"""
from __future__ import annotations

import re
from typing import List, Tuple

__all__ = ["check_expression", "SYMBOL_RE"]

#: Symbols of ``torch.export`` programs: sizes (``s``), unbacked integers (``u``) and
#: floats (``zf``, ``zuf``).
SYMBOL_RE = re.compile(r"(?:s|u|zf|zuf)[0-9]{1,6}\Z")
_MAX_LENGTH = 4096
_MAX_DEPTH = 64
_MAX_EXPONENT = 8
#: Functions of ``torch.utils._sympy.functions`` (and SymPy's Max, Min, Abs).
_FUNCS = frozenset({"FloorDiv", "CeilDiv", "CleanDiv", "Mod", "PythonMod", "Max", "Min",
                    "Abs", "ToFloat", "TruncToFloat", "TruncToInt", "FloorToInt",
                    "CeilToInt", "RoundToInt", "IntTrueDiv", "FloatTrueDiv", "FloatPow",
                    "PowByNatural", "Identity"})
_BINARY = frozenset({"FloorDiv", "CeilDiv", "CleanDiv", "Mod", "PythonMod", "IntTrueDiv",
                     "FloatTrueDiv", "FloatPow", "PowByNatural"})
_UNARY = frozenset({"Abs", "ToFloat", "TruncToFloat", "TruncToInt", "FloorToInt",
                    "CeilToInt", "RoundToInt", "Identity"})
_RELATIONS = frozenset({"Eq", "Ne", "Lt", "Le", "Gt", "Ge"})
_CMP = frozenset({"==", "!=", "<", "<=", ">", ">="})
_TOKEN = re.compile(r"\s*(?:(?P<float>[0-9]+\.[0-9]*(?:e[-+]?[0-9]{1,3})?)|(?P<int>[0-9]+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                    r"|(?P<op>\*\*|==|!=|<=|>=|[-+*/(),<>&|~]))")


class _Reject(ValueError):
    pass


def _tokens(text: str) -> List[Tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None:
            raise _Reject(f"unexpected character {text[pos:].lstrip()[:1]!r}")
        kind = match.lastgroup
        value = match.group(kind)
        if kind in ("int", "float") and len(value) > 40:
            raise _Reject("a number of more than 40 digits")
        out.append((kind, value))
        pos = match.end()
    return out


class _Parser:
    def __init__(self, tokens: List[Tuple[str, str]]):
        self.tokens = tokens
        self.pos = 0
        self.depth = 0

    # -- helpers ------------------------------------------------------------------------
    def peek(self, offset: int = 0) -> Tuple[str, str]:
        index = self.pos + offset
        return self.tokens[index] if index < len(self.tokens) else ("end", "")

    def take(self, value: str) -> bool:
        if self.peek()[1] == value and self.peek()[0] == "op":
            self.pos += 1
            return True
        return False

    def expect(self, value: str) -> None:
        if not self.take(value):
            raise _Reject(f"expected {value!r}, found {self.peek()[1] or 'the end'!r}")

    def nested(self, parse):
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _Reject(f"nested more than {_MAX_DEPTH} levels deep")
        try:
            return parse()
        finally:
            self.depth -= 1

    def call(self, item) -> int:
        """``"(" item ("," item)* ")"``; returns the number of arguments."""
        self.expect("(")
        count = 1
        self.nested(item)
        while self.take(","):
            self.nested(item)
            count += 1
        self.expect(")")
        return count

    # -- integers -----------------------------------------------------------------------
    def sum(self) -> None:
        self.prod()
        while self.take("+") or self.take("-"):
            self.prod()

    def prod(self) -> None:
        self.unary()
        while self.take("*") or self.take("/"):
            self.unary()

    def unary(self) -> None:
        if self.take("-"):
            self.nested(self.unary)
            return
        self.atom()
        if self.take("**"):
            kind, value = self.peek()
            if kind != "int" or int(value) > _MAX_EXPONENT:
                raise _Reject(f"an exponent other than an integer 0..{_MAX_EXPONENT}")
            self.pos += 1

    def atom(self) -> None:
        kind, value = self.peek()
        if kind in ("int", "float"):
            self.pos += 1
        elif kind == "name" and value in _FUNCS:
            self.pos += 1
            count = self.call(self.sum)
            if value in _UNARY and count != 1 or value in _BINARY and count != 2:
                raise _Reject(f"{value} with {count} arguments")
        elif kind == "name":
            if not SYMBOL_RE.match(value):
                raise _Reject(f"{value!r} is not a torch.export symbol (s<n>, u<n>, "
                              "zf<n>, zuf<n>) or an arithmetic function")
            self.pos += 1
        elif self.take("("):
            self.nested(self.sum)
            self.expect(")")
        else:
            raise _Reject(f"expected an integer term, found {value or 'the end'!r}")

    # -- conditions ---------------------------------------------------------------------
    def boolean(self) -> None:
        self.bterm()
        while self.take("|"):
            self.bterm()

    def bterm(self) -> None:
        self.bnot()
        while self.take("&"):
            self.bnot()

    def bnot(self) -> None:
        kind, value = self.peek()
        if self.take("~"):
            self.nested(self.bnot)
        elif kind == "name" and value in ("True", "False"):
            self.pos += 1
        elif kind == "name" and value in _RELATIONS:
            self.pos += 1
            if self.call(self.sum) != 2:
                raise _Reject(f"{value} needs 2 arguments")
        elif kind == "name" and value in ("And", "Or", "Not"):
            self.pos += 1
            if self.call(self.boolean) != 1 and value == "Not":
                raise _Reject("Not needs 1 argument")
        else:
            start = self.pos
            try:  # a comparison of integers ...
                self.sum()
                if self.peek()[0] != "op" or self.peek()[1] not in _CMP:
                    raise _Reject("expected a comparison")
                self.pos += 1
                self.sum()
            except _Reject:  # ... or a parenthesised condition
                self.pos = start
                self.expect("(")
                self.nested(self.boolean)
                self.expect(")")


def check_expression(text: object, kind: str) -> None:
    """Check that ``text`` is an integer expression (``kind="int"``) or a condition
    (``kind="bool"``) of the grammar above.

    Raises:
        ValueError: the text is not a string, too long, or outside the grammar (the
            message says where).
    """
    if not isinstance(text, str):
        raise ValueError(f"a symbolic expression must be a string, not "
                         f"{type(text).__name__}")
    if len(text) > _MAX_LENGTH:
        raise ValueError(f"a symbolic expression of {len(text)} characters (at most "
                         f"{_MAX_LENGTH})")
    try:
        parser = _Parser(_tokens(text))
        (parser.boolean if kind == "bool" else parser.sum)()
        if parser.pos != len(parser.tokens):
            raise _Reject(f"unexpected {parser.peek()[1]!r}")
    except _Reject as exc:
        shown = text if len(text) <= 80 else text[:77] + "..."
        what = {"int": "size", "float": "float", "bool": "condition"}[kind]
        raise ValueError(f"the symbolic {what} {shown!r} is not arithmetic over "
                         f"torch.export symbols ({exc})") from None
