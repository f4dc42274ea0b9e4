"""The grammar symbolic expressions of a stored program must follow (issue 19, item 1).

``torch.export`` writes a symbolic size, stride, float or condition as the SymPy
``srepr`` of its expression (``{"as_expr": {"expr_str": "Add(Symbol('u0',
integer=True), Integer(1))"}}``), and its deserializer parses the text with
``sympy.sympify``, which *evaluates* it as Python. Before any file reaches that
deserializer, every such text is parsed here, by a small recursive-descent parser that
evaluates nothing, and must be a constructor call tree::

    expr   := ["-"] CONST | FUNC "(" [arg ("," arg)*] ")"
            | "Symbol" "(" SYMBOL ("," ASSUMPTION "=" BOOL)* ")"
            | "Integer" "(" INT ")" | "Rational" "(" INT "," INT ")"
            | "Float" "(" DECIMAL ["," "precision" "=" INT] ")"
    arg    := expr
    CONST  := true | false | oo | int_oo | nan | zoo
    FUNC   := Add | Mul | Pow | Max | Min | Abs | Mod | Equality | Unequality
            | StrictLessThan | LessThan | StrictGreaterThan | GreaterThan | And | Or | Not
            | the functions of ``torch.utils._sympy.functions`` that torch's
              deserializer passes to ``sympify`` (FloorDiv, CeilDiv, ModularIndexing,
              Where, PythonMod, ToFloat, TruncToInt, ...)

``SYMBOL`` is a quoted ``torch.export`` symbol name (``'s0'``, ``'u3'``, ``'zuf0'``),
``ASSUMPTION`` a SymPy assumption name (``integer``, ``positive``, ...), ``INT`` an
integer literal of at most 40 digits, ``DECIMAL`` a quoted decimal number. Arguments
that SymPy would evaluate into huge numbers are bounded: an exponent or shift
(``Pow``, ``PowByNatural``, ``FloatPow``, ``LShift``, ``RShift``) is a symbol or an
integer of magnitude at most 64, and a ``Float``'s precision at most 256 bits. The text
is at most 64 KiB and 64 calls deep. A text that passes contains only these names,
literals and punctuation, so ``sympify`` builds a SymPy expression from it and runs
nothing else.
"""
from __future__ import annotations

import re
from typing import List, Tuple

__all__ = ["check_expression", "SYMBOL_RE"]

#: Symbols of ``torch.export`` programs: sizes (``s``), unbacked integers (``u``) and
#: floats (``zf``, ``zuf``).
SYMBOL_RE = re.compile(r"(?:s|u|zf|zuf)[0-9]{1,6}\Z")
_MAX_LENGTH = 1 << 16
_MAX_DEPTH = 64
_MAX_EXPONENT = 64
_MAX_PRECISION = 256
_CONSTS = frozenset({"true", "false", "oo", "int_oo", "nan", "zoo"})
_FUNCS = frozenset({
    "Add", "Mul", "Pow", "Max", "Min", "Abs", "Mod", "Equality", "Unequality",
    "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan", "And", "Or", "Not",
    # torch.utils._sympy.functions (the locals torch's deserializer gives sympify)
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt",
    "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow",
    "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat",
    "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity"})
#: Functions whose second argument SymPy may evaluate as an exponent or shift.
_POWERS = frozenset({"Pow", "PowByNatural", "FloatPow", "LShift", "RShift"})
_ASSUMPTIONS = frozenset({
    "integer", "positive", "negative", "nonnegative", "nonpositive", "zero", "nonzero",
    "real", "finite", "infinite", "rational", "irrational", "even", "odd", "extended_real",
    "extended_positive", "extended_negative", "extended_nonnegative",
    "extended_nonpositive", "commutative", "complex", "imaginary"})
_TOKEN = re.compile(r"\s*(?:(?P<int>[0-9]{1,40}(?![0-9]))|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                    r"|(?P<str>'[^'\\]{0,60}')|(?P<op>[-(),=]))")
_DECIMAL = re.compile(r"-?[0-9]{1,40}(?:\.[0-9]{0,40})?(?:e[-+]?[0-9]{1,4})?\Z")


class _Reject(ValueError):
    pass


def _tokens(text: str) -> List[Tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None:
            raise _Reject(f"unexpected text {text[pos:].lstrip()[:12]!r}")
        kind = match.lastgroup
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


class _Parser:
    def __init__(self, tokens: List[Tuple[str, str]]):
        self.tokens = tokens
        self.pos = 0
        self.depth = 0

    def peek(self) -> Tuple[str, str]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ("end", "")

    def take(self, value: str) -> bool:
        if self.peek() == ("op", value):
            self.pos += 1
            return True
        return False

    def expect(self, value: str) -> None:
        if not self.take(value):
            raise _Reject(f"expected {value!r}, found {self.peek()[1] or 'the end'!r}")

    def next(self, kind: str, what: str) -> str:
        token = self.peek()
        if token[0] != kind:
            raise _Reject(f"expected {what}, found {token[1] or 'the end'!r}")
        self.pos += 1
        return token[1]

    def integer(self, limit: int = 0) -> int:
        sign = -1 if self.take("-") else 1
        value = sign * int(self.next("int", "an integer"))
        if limit and abs(value) > limit:
            raise _Reject(f"an integer of magnitude above {limit} where SymPy would "
                          "evaluate it")
        return value

    def keyword(self, allowed) -> str:
        name = self.next("name", "a keyword")
        if name not in allowed:
            raise _Reject(f"unexpected keyword {name!r}")
        self.expect("=")
        return name

    def expr(self) -> str:
        """Parse one expression; returns its head (function or constant name)."""
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _Reject(f"nested more than {_MAX_DEPTH} calls deep")
        try:
            negative = self.take("-")
            name = self.next("name", "a SymPy constructor")
            if name in _CONSTS:
                return name
            if negative:
                raise _Reject(f"'-' before {name}")
            self.expect("(")
            if name == "Symbol":
                symbol = self.next("str", "a quoted symbol name")[1:-1]
                if not SYMBOL_RE.match(symbol):
                    raise _Reject(f"{symbol!r} is not a torch.export symbol (s<n>, u<n>, "
                                  "zf<n>, zuf<n>)")
                while self.take(","):
                    self.keyword(_ASSUMPTIONS)
                    if self.next("name", "True or False") not in ("True", "False"):
                        raise _Reject("an assumption that is not True or False")
            elif name == "Integer":
                self.integer()
            elif name == "Rational":
                self.integer()
                self.expect(",")
                self.integer()
            elif name == "Float":
                if not _DECIMAL.match(self.next("str", "a quoted number")[1:-1]):
                    raise _Reject("a Float that is not a decimal number")
                if self.take(","):
                    self.keyword({"precision"})
                    if not 1 <= self.integer() <= _MAX_PRECISION:
                        raise _Reject(f"a Float precision above {_MAX_PRECISION} bits")
            elif name in _FUNCS:
                args = []
                if self.peek() != ("op", ")"):
                    args.append(self.expr())
                    while self.take(","):
                        start = self.pos
                        args.append(self.expr())
                        if name in _POWERS and len(args) == 2:
                            self.check_exponent(start)
            else:
                raise _Reject(f"{name!r} is not a SymPy or torch.export function")
            self.expect(")")
            return name
        finally:
            self.depth -= 1

    def check_exponent(self, start: int) -> None:
        """An exponent / shift is a symbol or a small integer literal."""
        end, self.pos = self.pos, start
        head = self.next("name", "an exponent")
        if head == "Integer":
            self.expect("(")
            self.integer(_MAX_EXPONENT)
        elif head != "Symbol":
            raise _Reject("an exponent or shift that is not a symbol or an integer")
        self.pos = end


def check_expression(text: object, kind: str = "int") -> None:
    """Check that ``text`` follows the grammar above (``kind``: ``"int"``,
    ``"float"`` or ``"bool"``, for the message).

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
        parser.expr()
        if parser.pos != len(parser.tokens):
            raise _Reject(f"unexpected {parser.peek()[1]!r} after the expression")
    except _Reject as exc:
        shown = text if len(text) <= 80 else text[:77] + "..."
        what = {"int": "size", "float": "float", "bool": "condition"}.get(kind, "value")
        raise ValueError(f"the symbolic {what} {shown!r} is not a SymPy expression over "
                         f"torch.export symbols ({exc})") from None
