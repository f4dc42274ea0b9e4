"""Trace channels (docs/api-sections.md api §11.1). Tracing needs Graphcore's libpvti,
which the IPU
Model does not have, so channels are no-ops: ``instrument`` returns the object
unchanged and ``tracepoint`` returns a do-nothing context manager."""
import contextlib

__all__ = ["Channel"]


class Channel:
    """A named trace channel (no-op on the IPU Model).

    Args:
        name: the channel name; spans are recorded as ``<channel>.<name>``.
    """

    def __init__(self, name: str):
        self.name = name

    def instrument(self, obj, *method_names: str):
        """Wrap ``method_names`` of ``obj`` in trace points; returns ``obj``."""
        return obj

    def tracepoint(self, name: str):
        """A context manager recording the span ``<channel>.<name>``."""
        return contextlib.nullcontext()
