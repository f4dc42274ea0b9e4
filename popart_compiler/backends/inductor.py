"""The ``inductor`` backend: captured graphs compiled by TorchInductor.

The same ATen graph the ``eager`` backend interprets is handed to Inductor's
``compile_fx`` (no Dynamo: the graph is already captured): forward graphs become fused
kernels and, for training, AOTAutograd compiles the backward graph too (gradients
still come from ``torch.autograd.grad`` on the compiled forward). Parameters, buffers
and constants stay graph *inputs* — never constants folded into the kernels — so the
device weights can be rewritten (``copyWeightsToDevice``, optimizer updates) without
recompiling. A program is compiled once per input signature: later runs with the same
shapes and dtypes reuse the kernels (:func:`compile_count` counts compilations).

Graphs on the CPU run their linear layers with oneDNN (:func:`onednn_linear`), forward
and, in training, backward: PyTorch's ``addmm`` / ``mm`` go through the BLAS library it
was built with, which can be several times slower than oneDNN on some CPUs (measured
1.85 ms against 0.82 ms for a 256×784 by 784×512 product, one thread of an AMD EPYC);
the weights stay plain, unpacked graph inputs.

Inductor's per-process probe of the CPU's vector instruction sets runs in a background
thread while the program is captured (:func:`start_probing_cpu`).

Half-precision programs keep the eager kernels' roundings between fused pointwise ops
(Inductor's ``emulate_precision_casts``), as the IPU computes them in float16;
Inductor's own reductions (a float16 ``log_softmax``) can differ by 1–2 ulps.

Random ops keep the device RNG's semantics: Inductor is told to call PyTorch's random
kernels (``fallback_random``) so they draw from the generator the session swaps in
(docs/semantics.md S-95) and match the eager backend.
"""
from __future__ import annotations

import threading
from typing import Callable, List, Optional

import torch
import torch.fx as fx

from popart_compiler.backends.tracing import TRACE_LOCK
from popart_compiler.logging import logger

__all__ = ["compile_graph", "compile_count", "thread_compile_count", "onednn_linear",
           "start_probing_cpu"]

_lock = threading.Lock()
_compiles = 0
_per_thread = threading.local()
_probe: Optional[threading.Thread] = None


def start_probing_cpu() -> None:
    """Start Inductor's probe of the CPU's vector instruction sets in a background
    thread, so that it overlaps the capture of the program.

    In every process, Inductor's first CPU compilation (a cache hit too) builds a small
    library per instruction set and loads each in a child Python process to check that
    it runs: about 0.9 s, mostly waiting for those processes (measured on a 2-core AMD
    EPYC), which is most of a second process's compile time once its kernels are
    cached. The result is Inductor's own (``pick_vec_isa``, cached in the process);
    compilation waits for the probe (:func:`_inductor`). Does nothing after the first
    call."""
    global _probe  # pylint: disable=global-statement
    with TRACE_LOCK:
        if _probe is not None:
            return
        # The modules the probe uses are imported here, in the calling thread (the
        # compilation needs them anyway), under the trace lock (captures import them
        # too) and from torch._dynamo down (what torch.export and torch.optim import
        # first): torch._dynamo and torch._inductor import each other, and two threads
        # importing the cycle from different ends deadlock or see half-initialized
        # modules.
        # (Inductor's compile_fx is imported later, while the probe runs.)
        # pylint: disable=import-outside-toplevel,unused-import
        import torch._dynamo  # noqa: F401
        import torch._inductor.codecache
        import torch._inductor.cpp_builder
        import torch._inductor.cpu_vec_isa
        import torch.utils._filelock
        import torch.utils.cpp_extension  # noqa: F401
        _probe = threading.Thread(target=_probe_cpu, name="poptorch-inductor-isa-probe",
                                  daemon=True)
        _probe.start()


def _import_compiler_stack() -> None:
    """Import ``torch._dynamo`` (the end of the import cycle other threads start from),
    then Inductor's compiler."""
    # pylint: disable=import-outside-toplevel,unused-import
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401


def _probe_cpu() -> None:
    try:
        torch._inductor.cpu_vec_isa.pick_vec_isa()
    except Exception as e:  # pylint: disable=broad-except
        # Inductor probes again (and reports any error) when it compiles
        logger.debug("Inductor's CPU probe failed in the background: %s", e)


def _wait_for_probe() -> None:
    probe = _probe
    if probe is not None and probe is not threading.current_thread():
        probe.join()


def compile_count() -> int:
    """Number of graphs Inductor has compiled in this process (forward graphs; the
    backward graph of a training program is compiled with its forward); a compilation
    that raised is not counted."""
    return _compiles


def thread_compile_count() -> int:
    """:func:`compile_count` for the calling thread only (a graph compiles on the
    thread that makes its first call), unaffected by compilations in other threads."""
    return getattr(_per_thread, "compiles", 0)


def _inductor(gm: fx.GraphModule, example_inputs: List[torch.Tensor], *,
              random: bool) -> Callable:
    """Count, then compile with Inductor (AOTAutograd: forward and backward graphs)."""
    global _compiles  # pylint: disable=global-statement
    _import_compiler_stack()
    # pylint: disable=import-outside-toplevel
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    _wait_for_probe()  # one probe at a time: pick_vec_isa's cache has no lock
    logger.debug("Compiling a graph of %d nodes with TorchInductor",
                 len(gm.graph.nodes))
    # half-precision results rounded where the eager kernels round them (Inductor
    # would elide a fused float16 → float32 round trip: 8.7e-4 off the eager backend)
    patches = {"emulate_precision_casts": True, "fallback_random": random}
    # the context Dynamo would give: a fake mode with a shape environment (Inductor's
    # FX graph and AOTAutograd caches are bypassed without one), static shapes
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(a, static_shapes=True)
             if isinstance(a, torch.Tensor) else a for a in example_inputs]
    with tracing(TracingContext(fake_mode)):
        compiled = compile_fx(gm, fakes, config_patches=patches)
    with _lock:
        _compiles += 1  # counted once compiled: a failed compilation is not counted
    _per_thread.compiles = thread_compile_count() + 1
    return compiled


def compile_graph(gm: fx.GraphModule, *, random: bool = False,
                  compile_on_miss: bool = True) -> Callable:
    """Compile ``gm`` with TorchInductor (lazily: on its first call).

    Args:
        gm: a flat graph module (state and inputs as placeholders), as captured or
            vectorized by the compiler.
        random: the graph has random ops: draw from PyTorch's generator (see module
            docstring) instead of Inductor's own.
        compile_on_miss: compile at a call with a new input signature (default); if
            ``False``, such a call runs ``gm`` uncompiled, and only
            ``precompile(args, grad)`` compiles (the ``auto`` backend, which compiles
            in the background).

    Returns:
        A callable with ``gm``'s signature. It compiles at the first call, and again
        only for a new input signature (shapes, strides, dtypes, devices,
        ``requires_grad``, grad mode).
    """
    return _Compiled(gm, random, compile_on_miss)


def _signature(grad: bool, args) -> tuple:
    return (grad,) + tuple(
        (a.shape, a.stride(), a.dtype, a.device, a.requires_grad)
        if isinstance(a, torch.Tensor) else a if isinstance(a, (int, float, bool))
        else type(a) for a in args)


class _Compiled:
    """``gm`` compiled by Inductor's ``compile_fx`` once per input signature (the
    specializations Inductor's code asserts, and what AOTAutograd decides from). Not
    through ``torch.compile``: Dynamo's frame evaluation failed ("found no compiled
    frames") while another thread captured, and its guards cost ~13 µs a call.
    Compiling holds :data:`tracing.TRACE_LOCK`; running compiled code does not.

    A graph of prepacked oneDNN kernels and views only is not compiled: it runs as it
    is (:mod:`~popart_compiler.backends.direct`; Inductor would generate no code)."""

    def __init__(self, gm: fx.GraphModule, random: bool, compile_on_miss: bool = True):
        self._gm = gm
        self._random = random
        self._compile_on_miss = compile_on_miss
        self._by_signature: dict = {}
        # pylint: disable=import-outside-toplevel
        from popart_compiler.backends import direct  # imports prepack, which imports us
        self._direct = direct.runner(gm)

    @property
    def runs_as_is(self) -> bool:
        """Whether the graph runs as it is, never compiled (prepacked kernels only)."""
        return self._direct is not None

    def precompile(self, args, grad: bool) -> None:
        """Compile for calls with arguments like ``args`` (only their shapes, strides,
        dtypes, devices and ``requires_grad`` are read) in grad mode ``grad``, without
        running anything; a training graph's backward is compiled too.

        Raises:
            Exception: what TorchInductor raises when the graph cannot be compiled.
        """
        # pylint: disable=import-outside-toplevel
        from torch._functorch import config as functorch_config
        if self._direct is not None:
            return
        key = _signature(grad, args)
        with TRACE_LOCK, torch.set_grad_enabled(grad), \
                functorch_config.patch(force_non_lazy_backward_lowering=True):
            if key not in self._by_signature:
                self._by_signature[key] = _inductor(self._gm, list(args),
                                                    random=self._random)

    def __call__(self, *args):
        if self._direct is not None:
            return self._direct(*args)
        key = _signature(torch.is_grad_enabled(), args)
        fn = self._by_signature.get(key)
        if fn is None:
            if not self._compile_on_miss:
                logger.debug("No compilation for this input signature: running the "
                             "graph uncompiled")
                return self._gm(*args)
            with TRACE_LOCK:
                fn = self._by_signature.get(key)  # compiled by another thread meanwhile
                if fn is None:
                    fn = _inductor(self._gm, list(args), random=self._random)
                    self._by_signature[key] = fn
        return fn(*args)


@torch.library.custom_op("popart_compiler::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x.reshape(-1, K) @ weight.T + bias`` by oneDNN, for ``weight`` of shape
    ``(N, K)``: a 2-D ``(x.numel() // K, N)`` result. Inductor calls it as an external
    kernel; taking ``x`` before its flattening lets Inductor keep the producer's
    vectorized layout (the reshape is a view when ``x`` is contiguous)."""
    rows = x.reshape(-1, weight.shape[1])
    # oneDNN reads any strides of the input and the weight, but only a dense bias (a
    # strided or expanded one gave wrong sums)
    bias = bias.contiguous() if bias is not None else None
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


@_onednn_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((x.numel() // weight.shape[1], weight.shape[0]))


def _onednn_linear_setup(ctx, inputs, output):  # pylint: disable=unused-argument
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _onednn_linear_backward(ctx, grad: torch.Tensor):
    """Gradients by oneDNN too: ``grad_x = grad @ W``, ``grad_W = grad.T @ x`` (both
    as linears on transposed views), ``grad_b = grad.sum(0)``."""
    x, weight = ctx.saved_tensors
    linear = torch.ops.popart_compiler.onednn_linear
    need_x, need_w, need_b = ctx.needs_input_grad
    grad_x = linear(grad, weight.t(), None).reshape(x.shape) if need_x else None
    grad_w = linear(grad.t(), x.reshape(-1, weight.shape[1]).t(), None) if need_w else None
    return grad_x, grad_w, grad.sum(0) if need_b else None


_onednn_linear.register_autograd(_onednn_linear_backward, setup_context=_onednn_linear_setup)


_FLATTENS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
             torch.ops.aten.reshape.default)


def onednn_linear(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite linear layers on float32 CPU tensors (``aten.linear``, and what it
    decomposes to: ``addmm(b, x, t(w))``, ``mm(x, t(w))``) into oneDNN's linear
    (``popart_compiler::onednn_linear``, an external kernel for Inductor; same result
    up to float rounding). Its gradients are oneDNN linears too, so training graphs use
    it as well. Returns ``gm`` (rewritten in place); unchanged where oneDNN is
    unavailable."""
    if not torch.backends.mkldnn.is_available():
        return gm
    changed = False
    for node in list(gm.graph.nodes):
        operands = _linear_operands(node)
        if operands is None:
            continue
        x, w, bias = operands
        vals = [getattr(n, "meta", {}).get("val") for n in (x, w, node)]
        if bias is not None:
            vals.append(bias.meta.get("val") if isinstance(bias, fx.Node) else None)
        if not all(isinstance(v, torch.Tensor) and v.dtype == torch.float32
                   and v.device.type == "cpu" for v in vals):
            continue
        if bias is not None and tuple(vals[-1].shape) != (vals[1].shape[0],):
            # a broadcast bias (shape (1,) or a scalar): oneDNN has no broadcasting
            continue
        out = vals[2]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.popart_compiler.onednn_linear.default,
                                         (x, w, bias))
            new.meta["val"] = out.reshape(-1, out.shape[-1])
            if out.dim() != 2:  # aten.linear on a batch of sequences: (..., N)
                new = gm.graph.call_function(torch.ops.aten.view.default,
                                             (new, list(out.shape)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _linear_operands(node: fx.Node) -> Optional[tuple]:
    """``(x, weight, bias)`` of a linear layer at ``node`` (``bias`` may be ``None``),
    with ``x`` taken before a flattening view (see :func:`_onednn_linear`); ``None`` if
    ``node`` is no linear layer."""
    aten = torch.ops.aten
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is aten.linear.default:
        x, w, bias = (tuple(node.args) + (None,))[:3]
        return (x, w, bias) if isinstance(w, fx.Node) and w.meta.get("val") is not None \
            and w.meta["val"].dim() == 2 else None
    if node.target not in (aten.addmm.default, aten.mm.default):
        return None
    bias, x, wt = (node.args if node.target is aten.addmm.default
                   else (None,) + tuple(node.args))
    if not (isinstance(wt, fx.Node) and wt.target in (aten.t.default, aten.permute.default)):
        return None
    if wt.target is aten.permute.default and list(wt.args[1]) != [1, 0]:
        return None
    while isinstance(x, fx.Node) and x.target in _FLATTENS:
        x = x.args[0]  # flattened inside the op (see _onednn_linear)
    return x, wt.args[0], bias
