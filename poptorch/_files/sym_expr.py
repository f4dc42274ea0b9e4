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
integer literal of at most 40 digits, ``DECIMAL`` a quoted decimal number. The text
is at most 64 KiB and 64 calls deep. A text that passes contains only these names,
literals and punctuation, so ``sympify`` builds a SymPy expression from it and runs
nothing else.

SymPy evaluates constant sub-expressions as it builds them (``Pow(Integer(10),
Integer(64))`` becomes a 213-bit integer), and torch later substitutes the symbols'
hints and ranges (int64 values) into them, so the parser also bounds the size of every
number either could compute. Each sub-expression gets a bound on the bits of the
numbers it stands for (numerator and denominator for a rational, the binary exponent for
a float): a literal its own size, a size symbol (``s``, ``u``) 64 bits, a float symbol
(``zf``, ``zuf``) 1024 bits; ``Max``, ``Min``, ``Abs``, ``Where`` and roundings the
largest of their arguments' bounds, a comparison 1 bit, a sum of integers the largest
bound plus the bits of the number of terms; a product, quotient, sum of fractions or
any other function at most the sum of its arguments' bounds plus one bit per argument
(a common denominator); ``Pow`` / ``PowByNatural`` / ``FloatPow`` the base's bound
times the exponent, ``LShift`` the base's bound plus the shift, ``RoundDecimal`` the
value's bound plus 4 bits per digit. An exponent or shift must be an integer literal of
magnitude at most 64 (a symbolic one only in an ``RShift`` or on a base of magnitude at
most 1), a ``Float``'s precision at most 256 bits, and no bound may exceed 8192 bits
(2466 decimal digits). So a crafted expression such as ``Pow(Pow(Pow(Integer(99...9),
Integer(64)), Integer(64)), Integer(64))``, which SymPy would spend minutes to hours and
gigabytes evaluating, is refused in the time it takes to parse it (well under a
millisecond; a 64 KiB text in tens of milliseconds).
"""
from __future__ import annotations

import re
from typing import List, NamedTuple, Optional, Tuple

__all__ = ["check_expression", "SYMBOL_RE"]

#: Symbols of ``torch.export`` programs: sizes (``s``), unbacked integers (``u``) and
#: floats (``zf``, ``zuf``).
SYMBOL_RE = re.compile(r"(?:s|u|zf|zuf)[0-9]{1,6}\Z")
_MAX_LENGTH = 1 << 16
_MAX_DEPTH = 64
_MAX_EXPONENT = 64
_MAX_PRECISION = 256
#: Bound on the bits of any number SymPy or torch may compute from an expression.
_MAX_BITS = 8192
#: Bits of the value of a symbol: torch substitutes int64 hints and range bounds for
#: size symbols, Python floats for float symbols.
_SYMBOL_BITS = {"s": 64, "u": 64, "z": 1024}
_LOG2_10 = 3.33
_CONSTS = frozenset({"true", "false", "oo", "int_oo", "nan", "zoo"})
_FUNCS = frozenset({
    "Add", "Mul", "Pow", "Max", "Min", "Abs", "Mod", "Equality", "Unequality",
    "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan", "And", "Or", "Not",
    # torch.utils._sympy.functions (the locals torch's deserializer gives sympify)
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt",
    "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow",
    "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat",
    "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity"})
#: Functions whose value is one of their arguments' (or its rounding).
_SELECT = frozenset({"Max", "Min", "Abs", "Where", "Identity", "FloorToInt", "CeilToInt",
                     "TruncToInt", "RoundToInt", "TruncToFloat", "ToFloat"})
#: Functions whose value is true or false.
_PREDICATES = frozenset({"Equality", "Unequality", "StrictLessThan", "LessThan",
                         "StrictGreaterThan", "GreaterThan", "And", "Or", "Not",
                         "IsNonOverlappingAndDenseIndicator"})
#: Functions whose value is an integer / a float whatever their arguments.
_TO_INT = frozenset({"FloorToInt", "CeilToInt", "TruncToInt", "RoundToInt", "FloorDiv",
                     "CeilDiv", "CleanDiv", "ModularIndexing"}) | _PREDICATES
_TO_FLOAT = frozenset({"ToFloat", "TruncToFloat", "FloatTrueDiv", "IntTrueDiv",
                       "FloatPow", "RoundDecimal"})
#: Functions whose second argument SymPy may evaluate as an exponent or shift, and how
#: the bits of the result grow with it.
_POWERS = {"Pow": "times", "PowByNatural": "times", "FloatPow": "times",
           "LShift": "plus", "RShift": "none", "RoundDecimal": "digits"}
_ASSUMPTIONS = frozenset({
    "integer", "positive", "negative", "nonnegative", "nonpositive", "zero", "nonzero",
    "real", "finite", "infinite", "rational", "irrational", "even", "odd", "extended_real",
    "extended_positive", "extended_negative", "extended_nonnegative",
    "extended_nonpositive", "commutative", "complex", "imaginary"})
_TOKEN = re.compile(r"\s*(?:(?P<int>[0-9]{1,40}(?![0-9]))|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                    r"|(?P<str>'[^'\\]{0,60}')|(?P<op>[-(),=]))")
_DECIMAL = re.compile(r"-?([0-9]{1,40})(?:\.([0-9]{0,40}))?(?:e([-+]?[0-9]{1,4}))?\Z")


class _Reject(ValueError):
    """An expression outside the grammar or its size bounds (becomes "Invalid file")."""


class _Value(NamedTuple):
    """What the parser knows of a sub-expression: its head, a bound on the bits of the
    numbers it stands for, its value if it is an integer literal, and whether it is an
    integer (sums of integers need no common denominator)."""

    head: str
    bits: int
    literal: Optional[int] = None
    integral: bool = False


def _int_bits(value: int) -> int:
    """Bits of an integer literal; 0 for magnitudes of at most 1 (powers keep them)."""
    return 0 if abs(value) <= 1 else abs(value).bit_length()


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

    def integer(self) -> int:
        sign = -1 if self.take("-") else 1
        return sign * int(self.next("int", "an integer"))

    def keyword(self, allowed) -> str:
        name = self.next("name", "a keyword")
        if name not in allowed:
            raise _Reject(f"unexpected keyword {name!r}")
        self.expect("=")
        return name

    def expr(self) -> _Value:
        """Parse one expression."""
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _Reject(f"nested more than {_MAX_DEPTH} calls deep")
        try:
            negative = self.take("-")
            name = self.next("name", "a SymPy constructor")
            if name in _CONSTS:
                return _Value(name, 0, integral=True)
            if negative:
                raise _Reject(f"'-' before {name}")
            self.expect("(")
            value = self.call(name)
            self.expect(")")
            if value.bits > _MAX_BITS:
                raise _Reject(f"a {name} whose value may have more than {_MAX_BITS} "
                              "bits, which SymPy would take unbounded time and memory "
                              "to compute")
            return value
        finally:
            self.depth -= 1

    def call(self, name: str) -> _Value:
        """The arguments of constructor ``name`` (after its "(")."""
        if name == "Symbol":
            symbol = self.next("str", "a quoted symbol name")[1:-1]
            if not SYMBOL_RE.match(symbol):
                raise _Reject(f"{symbol!r} is not a torch.export symbol (s<n>, u<n>, "
                              "zf<n>, zuf<n>)")
            while self.take(","):
                self.keyword(_ASSUMPTIONS)
                if self.next("name", "True or False") not in ("True", "False"):
                    raise _Reject("an assumption that is not True or False")
            return _Value(name, _SYMBOL_BITS[symbol[0]], integral=symbol[0] in "su")
        if name == "Integer":
            literal = self.integer()
            return _Value(name, _int_bits(literal), literal, integral=True)
        if name == "Rational":
            numerator = self.integer()
            self.expect(",")
            return _Value(name, _int_bits(numerator) + _int_bits(self.integer()))
        if name == "Float":
            match = _DECIMAL.match(self.next("str", "a quoted number")[1:-1])
            if not match:
                raise _Reject("a Float that is not a decimal number")
            if self.take(","):
                self.keyword({"precision"})
                if not 1 <= self.integer() <= _MAX_PRECISION:
                    raise _Reject(f"a Float precision above {_MAX_PRECISION} bits")
            whole, fraction, exponent = match.groups()
            digits = len(whole) + len(fraction or "") + abs(int(exponent or 0))
            return _Value(name, int(digits * _LOG2_10) + 1)
        if name not in _FUNCS:
            raise _Reject(f"{name!r} is not a SymPy or torch.export function")
        args = []
        if self.peek() != ("op", ")"):
            args.append(self.expr())
            while self.take(","):
                args.append(self.expr())
        integral = name in _TO_INT or name not in _TO_FLOAT and all(
            a.integral for a in args) and not (name == "Pow" and len(args) == 2 and
                                               (args[1].literal or 0) < 0)
        if name in _PREDICATES or not args:
            bits = 1
        elif name in _POWERS and len(args) >= 2:
            bits = self.power(name, args[0], args[1]) + sum(a.bits + 1 for a in args[2:])
        elif name in _SELECT:
            bits = max(a.bits for a in args)
        elif name == "Add" and all(a.integral for a in args):
            bits = max(a.bits for a in args) + len(args).bit_length()
        else:  # products, quotients, sums of fractions: common denominators
            bits = sum(a.bits + 1 for a in args)
        return _Value(name, bits, integral=integral)

    @staticmethod
    def power(name: str, base: _Value, exponent: _Value) -> int:
        """Bits of ``name(base, exponent)``: an exponent or shift is an integer literal
        of magnitude at most 64, or anything on a base of magnitude at most 1."""
        grows = _POWERS[name]
        if exponent.literal is None:
            if grows == "none" or grows == "times" and base.bits == 0:
                return base.bits + exponent.bits
            raise _Reject("an exponent or shift that is not an integer literal")
        if abs(exponent.literal) > _MAX_EXPONENT:
            raise _Reject(f"an exponent or shift of magnitude above {_MAX_EXPONENT}")
        steps = abs(exponent.literal)
        return {"times": base.bits * steps, "plus": base.bits + steps,
                "none": base.bits, "digits": base.bits + 4 * steps}[grows]


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
