"""Model-proto export: ``POPTORCH_EXPORT_PROTO_FILE`` / ``POPTORCH_EXPORT_PROTO_AS_BINARY``
write the compiled forward program as an ONNX model that ``onnx.checker`` accepts and
that computes what the model computes."""
import pytest
import torch

import poptorch
from models import MLP

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")


def run_onnx(proto, x):
    from onnx.reference import ReferenceEvaluator
    session = ReferenceEvaluator(proto)
    (out,) = session.run(None, {proto.graph.input[0].name: x.numpy()})
    return torch.from_numpy(out)


@pytest.mark.parametrize("binary", [False, True])
def test_compiled_forward_is_written_as_onnx(tmp_path, monkeypatch, binary):
    path = tmp_path / ("model.onnx" if binary else "model.onnxtxt")
    monkeypatch.setenv("POPTORCH_EXPORT_PROTO_FILE", str(path))
    monkeypatch.setenv("POPTORCH_EXPORT_PROTO_AS_BINARY", "1" if binary else "0")
    model = MLP((6, 8, 4)).eval()
    x = torch.randn(4, 6)
    out = poptorch.inferenceModel(model)(x)
    raw = path.read_bytes()
    if binary:
        proto = onnx.load_from_string(raw)
    else:
        from google.protobuf import text_format
        proto = text_format.Parse(raw.decode(), onnx.ModelProto())
    onnx.checker.check_model(proto)
    torch.testing.assert_close(run_onnx(proto, x), out, rtol=1e-5, atol=1e-6)
