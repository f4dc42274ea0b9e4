"""The anchor-mode names PopTorch 2.4 deprecated and 2.5 removed (docs/api-sections.md options §9),
kept as shims that warn and forward to their ``outputMode`` replacements."""
from __future__ import annotations

import enum
from typing import Optional

from poptorch import enums
from poptorch._logging import logger

__all__ = ["DeprecatedAnchorMode"]


class DeprecatedAnchorMode:
    """``Options.anchorMode`` / ``Options.defaultAnchorMode`` (mixed into
    :class:`poptorch.Options`, which provides ``outputMode`` and ``defaultOutputMode``)."""

    def anchorMode(self, anchor_mode, anchor_return_period: Optional[int] = None):
        """Removed in 2.5; compatibility shim forwarding to :meth:`outputMode`
        (accepts an ``OutputMode``, an enum member with the same name, or its int
        value) with a deprecation warning. Returns self."""
        logger.warning("poptorch.Options.anchorMode is deprecated since version 2.4 and "
                       "was removed in 2.5. Use outputMode instead.")
        if not isinstance(anchor_mode, enums.OutputMode):
            if isinstance(anchor_mode, enum.Enum):
                anchor_mode = enums.OutputMode[anchor_mode.name]
            elif isinstance(anchor_mode, int):
                anchor_mode = enums.OutputMode(anchor_mode)
        return self.outputMode(anchor_mode, anchor_return_period)

    def defaultAnchorMode(self) -> bool:
        """Removed in 2.5; compatibility shim for :meth:`defaultOutputMode` with a
        deprecation warning."""
        logger.warning("poptorch.Options.defaultAnchorMode is deprecated since version "
                       "2.4 and was removed in 2.5. Use defaultOutputMode instead.")
        return self.defaultOutputMode()
