"""Model-proto export, as PopTorch's ``POPTORCH_EXPORT_PROTO_FILE`` did.

When ``POPTORCH_EXPORT_PROTO_FILE=<path>`` is set, every compilation writes the
captured forward program to ``<path>`` as an ONNX model (``torch.onnx.export`` of the
``torch.export`` program), in protobuf text format, or binary when
``POPTORCH_EXPORT_PROTO_AS_BINARY=1``. The model passes ``onnx.checker``; its inputs
are the flat tensor inputs of one micro-batch. Needs the optional ``onnx`` extra
(``onnx``, ``onnxscript``).
"""
from __future__ import annotations

import importlib.util
import os

import torch

from popart_compiler.errors import backend_error
from poptorch._options import environment as config
from poptorch._logging import logger

__all__ = ["export_proto_if_requested", "export_proto"]

_FILE_VARIABLE = "POPTORCH_EXPORT_PROTO_FILE"
_BINARY_VARIABLE = "POPTORCH_EXPORT_PROTO_AS_BINARY"


def export_proto(program, path: str, binary: bool) -> None:
    """Write ``program`` (a ``torch.export.ExportedProgram``) to ``path`` as ONNX.

    Raises:
        poptorch.Error: ``onnx`` / ``onnxscript`` are not installed, or torch cannot
            express an op of the program in ONNX.
    """
    missing = [name for name in ("onnx", "onnxscript")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise backend_error(f"{_FILE_VARIABLE} needs the onnx and onnxscript packages "
                            f"(missing: {', '.join(missing)}): pip install "
                            "'poptorch[onnx]'.")
    try:
        onnx_program = torch.onnx.export(program, dynamo=True, verbose=False)
    except Exception as exc:
        raise backend_error(f"Could not export the model proto to {path}: "
                            f"{type(exc).__name__}: {exc}") from exc
    proto = onnx_program.model_proto
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if binary:
        data = proto.SerializeToString()
    else:
        from google.protobuf import text_format
        data = text_format.MessageToString(proto).encode()
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    logger.info("Wrote the model proto (%s) to %s", "binary" if binary else "text", path)


def export_proto_if_requested(program) -> None:
    """Export ``program`` (a :class:`~poptorch._files.program.Program`) when
    ``POPTORCH_EXPORT_PROTO_FILE`` is set."""
    path, binary = config.proto_export()
    if not path:
        return
    export_proto(program.captured.graph.program, path, binary)
