"""``poptorch.print`` and ``poptorch.module_repr`` (docs/api-sections.md api §2.12)."""
from __future__ import annotations

import builtins

import torch
from torch.nn.modules.module import _addindent

from poptorch._ops.blocks import _begin_block_hooks

__all__ = ["print", "module_repr"]


def _has_blocks(module: torch.nn.Module) -> bool:
    return any(_begin_block_hooks(m) for m in module.modules())


def _repr(module: torch.nn.Module) -> str:
    # A sub-tree without BeginBlock annotations keeps torch's own rendering (so
    # custom __repr__ such as ModuleList's compression still applies).
    if not _has_blocks(module):
        return repr(module)
    extra_lines = []
    extra_repr = module.extra_repr()
    if extra_repr:
        extra_lines = extra_repr.split("\n")
    child_lines = []
    for key, sub in module._modules.items():
        sub_str = _repr(sub) if isinstance(sub, torch.nn.Module) else repr(sub)
        child_lines.append("(" + key + "): " + _addindent(sub_str, 2))
    lines = extra_lines + child_lines
    main_str = "".join(f"{hook!r} " for hook in _begin_block_hooks(module))
    main_str += module._get_name() + "("
    if lines:
        if len(extra_lines) == 1 and not child_lines:
            main_str += extra_lines[0]
        else:
            main_str += "\n  " + "\n  ".join(lines) + "\n"
    return main_str + ")"


def module_repr(m) -> str:
    """Render ``m`` like ``torch.nn.Module.__repr__`` but prefix each (sub)module
    line with the ``repr`` of its ``BeginBlock`` forward pre-hooks, e.g.
    ``BeginBlock(user_id=1, ipu_id=1) Linear(in_features=...)``. A non-module is
    rendered with ``repr``. Behaviour follows PopTorch."""
    if isinstance(m, torch.nn.Module):
        return _repr(m)
    return repr(m)


def print(m) -> None:  # noqa: A001 - shadows the builtin on purpose (poptorch.print)
    """Print ``module_repr(m)`` and then ``m`` itself if ``m`` is a module,
    otherwise just ``m``. Behaviour follows PopTorch."""
    if isinstance(m, torch.nn.Module):
        builtins.print(module_repr(m))
    builtins.print(m)
