"""Block tags on the captured ops (docs/semantics.md S-60): each op created while
``forward`` is captured records the ``poptorch.Block`` it ran in, in its node metadata,
which the compiler's placement reads."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from popart_compiler.passes.placement import BLOCK_KEY, NO_ACTIVE_BLOCK_KEY
from poptorch._ops import blocks as _blocks

__all__ = ["tag_ops", "start_tagging", "untag_ops", "block_tags"]

_tagging = [False]


def tag_ops() -> None:
    """Tag the ops created from now on with the active block: the block id under
    ``node.meta["custom"][BLOCK_KEY]`` (``None`` before the first block) or
    ``NO_ACTIVE_BLOCK_KEY`` after a ``with Block`` scope ended. Called on every block
    change and before every torch function, so that a tag reverted by a nested
    ``torch.fx.traceback.annotate`` scope is restored."""
    if not _tagging[0] or torch.compiler.is_dynamo_compiling():
        return  # inside torch.cond / control-flow bodies traced by Dynamo
    meta = torch.fx.traceback.current_meta
    custom = meta.get("custom")
    if custom is None:
        custom = meta["custom"] = {}
    block = _blocks.current_block()
    if block is _blocks.NO_ACTIVE_BLOCK:
        custom.pop(BLOCK_KEY, None)
        custom[NO_ACTIVE_BLOCK_KEY] = True
        return
    custom.pop(NO_ACTIVE_BLOCK_KEY, None)
    custom[BLOCK_KEY] = None if block is None else _blocks.block_key(
        block, _blocks.block_history())


def start_tagging() -> None:
    """``forward`` starts: tag the ops created from now on (:func:`tag_ops`)."""
    _tagging[0] = True
    tag_ops()


def untag_ops() -> None:
    """Ops created after ``forward`` returned (by the tracer) carry no block tag."""
    _tagging[0] = False
    custom = torch.fx.traceback.current_meta.get("custom")
    if custom is not None:
        custom.pop(BLOCK_KEY, None)
        custom.pop(NO_ACTIVE_BLOCK_KEY, None)


@contextlib.contextmanager
def block_tags(strategy) -> Iterator[None]:
    """Record blocks (docs/api-sections.md api §9) while capturing: reset the block state, tag ops
    with their block through preserved node metadata."""
    if strategy is not None:
        strategy._onStartCapture()
    with _blocks.block_capture(on_change=tag_ops), torch.fx.traceback.preserve_node_meta():
        try:
            yield
        finally:
            _tagging[0] = False
