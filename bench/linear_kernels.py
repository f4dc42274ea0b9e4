"""The CPU kernels a float32 linear layer can run on, side by side (issue 30): one
thread, the calling thread's CPU time, median of many calls.

For each shape ``(M, K, N)`` (default: the MLP row of ``bench/peers.py`` vectorized,
256 rows through 784→512, 512→512, 512→10) and with or without a ReLU after it:

* ``addmm``: ``torch.addmm(b, x, w.t())`` (PyTorch's BLAS), ReLU separately;
* ``onednn``: ``mkldnn._linear_pointwise`` on the plain weight (reordered every call);
* ``onednn-packed``: the same on a weight reordered once (``_reorder_linear_weight``),
  ReLU as oneDNN's post-op;
* ``mkl-packed``: MKL's packed GEMM (``mkl._mkl_reorder_linear_weight`` +
  ``mkl._mkl_linear``, what Inductor's ``freezing`` uses), ReLU separately;
* ``onnxruntime``: a session of ``MatMul`` + ``Add`` (+ ``Relu``) on the same weights
  (its per-run cost included: inside a whole model, ONNX Runtime's profile gives its
  fused GEMMs 5-10 % less, see docs/backends.md).

Usage::

    python bench/linear_kernels.py --repeats 2000
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

SHAPES: List[Tuple[int, int, int]] = [(256, 784, 512), (256, 512, 512), (256, 512, 10)]


def _median(fn: Callable[[], object], repeats: int) -> float:
    """Median thread CPU seconds of one call of ``fn`` (after 20 untimed calls)."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def _onnx(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
          relu: bool) -> Optional[Callable[[], object]]:
    """An ONNX Runtime session (one thread) computing ``x @ w.T + b`` (then ReLU)."""
    try:
        # pylint: disable=import-outside-toplevel
        import onnx
        import onnxruntime as ort
        from onnx import helper, numpy_helper
    except ImportError:
        return None
    m, k = x.shape
    n = w.shape[0]
    nodes = [helper.make_node("MatMul", ["x", "wt"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["y" if not relu else "pre"])]
    if relu:
        nodes.append(helper.make_node("Relu", ["pre"], ["y"]))
    graph = helper.make_graph(
        nodes, "linear",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [m, n])],
        [numpy_helper.from_array(w.t().contiguous().numpy(), "wt"),
         numpy_helper.from_array(b.numpy(), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = os.path.join(tempfile.mkdtemp(), "linear.onnx")
    onnx.save(model, path)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feed = {"x": x.numpy()}
    return lambda: sess.run(None, feed)


def candidates(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
               relu: bool) -> Dict[str, Callable[[], torch.Tensor]]:
    """The kernels of the module docstring computing ``linear(x, w, b)`` (then ReLU)
    on float32 CPU tensors; each checked against ``addmm`` to 1e-4."""
    m = x.shape[0]
    lin = torch.ops.mkldnn._linear_pointwise
    packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
    mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
    post = "relu" if relu else "none"

    def act(t):
        return torch.relu_(t) if relu else t
    out = {
        "addmm": lambda: act(torch.addmm(b, x, w.t())),
        "onednn": lambda: lin(x, w, b, post, [], ""),
        "onednn-packed": lambda: lin(x, packed, b, post, [], ""),
        "mkl-packed": lambda: act(torch.ops.mkl._mkl_linear(x, mkl_packed, w, b, m)),
    }
    ref = out["addmm"]()
    for name, fn in out.items():
        torch.testing.assert_close(fn(), ref, rtol=1e-4, atol=1e-4, msg=name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"median thread CPU time of {args.repeats} calls, µs; "
          f"load {os.getloadavg()[0]:.2f}")
    with torch.no_grad():
        for m, k, n in SHAPES:
            x = torch.randn(m, k)
            w = torch.randn(n, k) / k ** 0.5
            b = torch.randn(n)
            for relu in (False, True):
                runs = candidates(x, w, b, relu)
                ort_run = _onnx(x, w, b, relu)
                if ort_run is not None:
                    runs["onnxruntime"] = ort_run
                times = {name: _median(fn, args.repeats) * 1e6 for name, fn in runs.items()}
                cells = "  ".join(f"{name} {t:8.1f}" for name, t in times.items())
                print(f"{m}x{k}->{n}{' +relu' if relu else '      '}  {cells}", flush=True)


if __name__ == "__main__":
    main()
