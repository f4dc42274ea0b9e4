"""User-facing errors in the words eager PyTorch uses.

While ``forward`` is captured, the user's tensors are stand-ins: ``FakeTensor`` (no
storage), ``FunctionalTensor`` (the functionalisation wrapper of training captures) or
fx proxies. An error raised by a torch function names the argument types it got, so an
op that eager PyTorch refuses with ``got (int, Tensor, Tensor, str)`` would be refused
during capture with ``got (int, FakeTensor, FakeTensor, str)``: a name the user never
wrote. :func:`in_eager_words` rewrites such messages in place, keeping the exception's
type and traceback, so that the error reads as eager PyTorch's does (as PopTorch's own
errors do: it captures with real-looking ``torch.Tensor`` s).
"""
from __future__ import annotations

import re

__all__ = ["in_eager_words", "eager_text"]

#: Class names of the capture's stand-ins, optionally module-qualified
#: (``torch._subclasses.fake_tensor.FakeTensor``), as whole words.
_STAND_IN = re.compile(
    r"\b(torch\.(?:_subclasses|fx|_functorch)(?:\.\w+)*\.)?"
    r"(FakeTensor|FunctionalTensor|FakeTensorMode|Proxy|_ProxyTensor)\b")
_EAGER = {"FakeTensor": "Tensor", "FunctionalTensor": "Tensor", "Proxy": "Tensor",
          "_ProxyTensor": "Tensor", "FakeTensorMode": "TensorMode"}
#: Only these names are rewritten when they stand alone (a bare ``Proxy`` in a user's
#: message may be the user's own word).
_BARE = frozenset({"FakeTensor", "FunctionalTensor"})


def eager_text(text: str) -> str:
    """``text`` with every stand-in type name replaced by eager PyTorch's
    (``FakeTensor`` / ``FunctionalTensor`` → ``Tensor``; qualified names →
    ``torch.Tensor``)."""

    def replace(match: re.Match) -> str:
        prefix, name = match.group(1), match.group(2)
        if prefix is None and name not in _BARE:
            return match.group(0)
        eager = _EAGER[name]
        return f"torch.{eager}" if prefix else eager
    return _STAND_IN.sub(replace, text)


def in_eager_words(exc: BaseException) -> BaseException:
    """Rewrite ``exc``'s message in place (its string arguments) with
    :func:`eager_text`; the exception keeps its type, traceback and cause.

    Returns:
        ``exc`` itself, for ``raise in_eager_words(exc)``.
    """
    args = getattr(exc, "args", ())
    if any(isinstance(a, str) for a in args):
        new = tuple(eager_text(a) if isinstance(a, str) else a for a in args)
        if new != args:
            try:
                exc.args = new
            except (AttributeError, TypeError):
                return exc
    return exc
