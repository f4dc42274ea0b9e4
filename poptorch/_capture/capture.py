"""Capture of one micro-batch of a model's ``forward`` with ``torch.export``
(non-strict) into a :class:`popart_compiler.ir.Graph` (docs/semantics.md S-1…S-6, S-24, S-44).

This module is the orchestration: the jobs around it live beside it, in
:mod:`.hooks` (compile hooks), :mod:`.device_mode` (``"ipu"`` inside ``forward``),
:mod:`.block_tags` (ops tagged with their block), :mod:`.model_state` (parameters,
buffers, containers and constants of the model), :mod:`.quiet_logs` (torch's
diagnostics) and :mod:`.capture_errors` (what a failed capture raises).
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.fx.traceback as fx_traceback

from popart_compiler.errors import Error, py_error
from popart_compiler.ir import Graph
from poptorch import _impl
from poptorch._capture import block_tags, data_dependence, eager_words, model_state
from poptorch._capture import number_reads
from poptorch._capture.args import BoundArgs, Spec, flatten, leaf_names, unflatten
from poptorch._capture.capture_errors import raise_capture_error
from poptorch._capture.device_mode import (IpuDeviceMode, no_distribution_validation,
                                           patch_tensor_ipu)
from poptorch._capture.dtype_rules import DtypeRulesMode
from poptorch._capture.guard import capture_guard
from poptorch._capture.hooks import (  # noqa: F401  (re-exported, as PopTorch's names)
    registerPostCompileHook, registerPreCompileHook, run_post_compile_hooks,
    run_pre_compile_hooks)
from poptorch._capture.quiet_logs import quiet_torch_logs
from poptorch._capture.substitution import OverwriteContextManager
from poptorch._capture.warnings import at_user_code
from poptorch._logging import logger
from poptorch._ops import autograd_functions
from poptorch._ops import blocks as _blocks
from poptorch._ops import host as _host_ops
from poptorch._ops import opaque
from poptorch._options.execution_strategy import PipelinedExecution

__all__ = ["capture", "Captured", "capture_contexts", "registerPreCompileHook",
           "registerPostCompileHook"]


@dataclasses.dataclass
class Captured:
    """The result of a capture.

    Attributes:
        graph: the compiler's graph.
        output_spec: structure of ``forward``'s return value; tensor leaves index the
            graph outputs or hold host tensors (``host_outputs``).
        output_leaves: for each tensor leaf of ``output_spec``, the graph output index,
            or ``None`` for a host tensor returned as is.
        host_outputs: host tensors returned by ``forward`` (docs/semantics.md S-14).
        returned_none: ``forward`` returned ``None``.
    """
    graph: Graph
    output_spec: Optional[Spec]
    output_leaves: List[Optional[int]]
    host_outputs: List[torch.Tensor]


def _check_caller_autocast(device: str) -> None:
    """A caller's ``torch.autocast(dtype=torch.bfloat16)`` would make the model compute
    and return bfloat16, which the IPU does not have: name autocast as the cause."""
    device_type = torch.device(device).type
    if torch.is_autocast_enabled(device_type) and \
            torch.get_autocast_dtype(device_type) == torch.bfloat16:
        raise py_error(
            f"The model is called inside torch.autocast(\"{device_type}\", "
            "dtype=torch.bfloat16): autocast would make it compute and return bfloat16 "
            "tensors, and the IPU has no bfloat16 type. Call the model outside "
            "torch.autocast, or use float16 (model.half(), or poptorch.Options()."
            "Precision settings) for reduced precision.")


@contextlib.contextmanager
def capture_contexts(model: torch.nn.Module, training: bool, device: str, strategy,
                     module_namescope: bool) -> Iterator[None]:
    """The contexts ``torch.export`` runs in while it captures ``model``, entered in
    this order on one ``contextlib.ExitStack`` (and left in reverse order):

    1. :func:`.block_tags.block_tags`: block state reset, ops tagged with their block.
    2. ``_impl.device_context(training)``: "inside a model" for ``isRunningOnIpu()``.
    3. :func:`.quiet_logs.quiet_torch_logs`: torch's loggers, warnings, stderr quiet.
    4. :func:`.warnings.at_user_code`: warnings shown at the user's source line.
    5. :func:`.model_state.device_weights`: float64 weights held as float32.
    6. ``opaque.opaque_functions()``: functions the capture keeps as opaque ops.
    7. :class:`.device_mode.IpuDeviceMode`: ``"ipu"`` means ``device``.
    8. :class:`.dtype_rules.DtypeRulesMode`: master-weight mixed precision rules.
    9. :func:`.device_mode.no_distribution_validation`: no ``torch.distributions``
       argument validation.
    10. :class:`.substitution.OverwriteContextManager`: frameworks' substitutions.
    11. ``autograd_functions.honoured_backwards()``: custom autograd Functions keep
        their ``backward``.
    12. ``torch.fx.traceback.annotate``: ``no_module_scope`` when
        ``module_namescope`` is ``False`` (docs/semantics.md S-16).

    Each context is created only after the ones before it are entered, as in a
    ``with`` statement naming them all.
    """
    scope = {} if module_namescope else {"no_module_scope": True}
    with contextlib.ExitStack() as stack:
        stack.enter_context(block_tags.block_tags(strategy))
        stack.enter_context(_impl.device_context(training))
        stack.enter_context(quiet_torch_logs())
        stack.enter_context(at_user_code(data_dependence.user_frame))
        stack.enter_context(model_state.device_weights(model))
        stack.enter_context(opaque.opaque_functions())
        stack.enter_context(IpuDeviceMode(device))
        stack.enter_context(DtypeRulesMode())
        stack.enter_context(no_distribution_validation())
        stack.enter_context(OverwriteContextManager())
        stack.enter_context(autograd_functions.honoured_backwards())
        stack.enter_context(fx_traceback.annotate(scope))
        yield


def capture(*args, **kwargs) -> Captured:
    """Capture ``forward`` of ``model`` once; see :func:`_capture` for the arguments
    and errors. Captures are serialised process-wide and a ``SIGINT`` arriving during
    one is raised as ``KeyboardInterrupt`` after it (``_capture_guard``)."""
    with capture_guard(), number_reads.logged_once(logger) as once:
        try:
            return _capture(*args, **kwargs)
        except Error as exc:
            if not getattr(exc, "number_read", False):
                raise
        # int(t) / float(t) of a run-time value: capture again reading them as t.item()
        once.repeat()
        model = args[0] if args else kwargs["model"]
        with number_reads.items_for_number_reads(model):
            return _capture(*args, **kwargs)


def _capture(model: torch.nn.Module, forward: Callable, bound: BoundArgs,
            input_spec: Spec, micro_batch: List[torch.Tensor], training: bool,
            device: str = "cpu", strategy=None, module_namescope: bool = True) -> Captured:
    """Capture ``forward`` of ``model`` (a shallow copy of the user's module) once.

    Args:
        model: the module whose parameters/buffers are lifted.
        forward: its original ``forward`` (bound).
        bound: the bound call arguments (non-tensor values are frozen as constants).
        input_spec: structure of ``bound.values`` (tensor leaves = graph inputs).
        micro_batch: one micro-batch of every tensor leaf, in order.
        training: capture for training (loss ops checked by the compiler).
        device: where tensors created with ``device="ipu"`` live.
        strategy: the execution strategy deriving each block's stage, IPU and phase
            (docs/api-sections.md api §9); ``PipelinedExecution()`` by default.
        module_namescope: name ops after their sub-module path (docs/semantics.md S-16); ``False``
            for ``Options.disableModuleNamescope()``. ``poptorch.NameScope`` and the other scopes of
            docs/api-sections.md api §8 are recorded in ``node.meta["custom"]``.

    Raises:
        poptorch.Error: data-dependent Python control flow (with the user's source
            line and a pointer to ``poptorch.cond``), parameters/buffers replaced in
            ``forward`` (docs/semantics.md S-5), a block id started on two IPUs or with an invalid
            ``ipu_id``, explicit stages naming blocks the model never starts, other
            capture failures. Exceptions raised by the user's own code propagate
            unchanged. The model's host state is restored first.
        AssertionError: an unknown block id or a block without IPU under
            ``AutoStage.SameAsIpu`` (docs/api-sections.md api §9.7).
    """
    _check_caller_autocast(device)
    out_box: Dict[str, Any] = {}

    def flat_forward(*flat: torch.Tensor):
        values = unflatten(input_spec, iter(flat))
        if not flat:
            # torch.export (2.13) inserts lifted constants' placeholders before the
            # first user input, else before the graph's first node: with no input
            # that is the first constant's get_attr, which it then erases, losing
            # the other placeholders ("lifted_tensor_1 used before it has been
            # defined"). A first node that is no constant avoids it; it is dead code.
            torch.empty(0, device=device)
        state = model_state.state_identity(model)
        block_tags.start_tagging()
        try:
            result = bound.call(forward, values)
        finally:
            block_tags.untag_ops()
        model_state.check_state_unchanged(model, state)
        tensors: List[torch.Tensor] = []
        spec = flatten(result, tensors) if result is not None else None
        leaves: List[Optional[int]] = []
        graph_outs: List[torch.Tensor] = []
        host: List[torch.Tensor] = []
        for t in tensors:
            if isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
                leaves.append(len(graph_outs))
                graph_outs.append(t)
            else:
                warnings.warn("Output expected to be on the IPU but is on cpu", UserWarning,
                              stacklevel=2)
                leaves.append(None)
                host.append(t)
        out_box.update(spec=spec, leaves=leaves, host=host)
        return tuple(graph_outs)

    run_pre_compile_hooks()
    before = model_state.state_identity(model)
    _host_ops.take_captured()
    autograd_functions.take_captured()
    constants_before = model_state.plain_tensor_attributes(model)
    containers = model_state.container_attributes(model)
    had_forward = "forward" in vars(model)
    saved_forward = vars(model).get("forward")
    model.forward = flat_forward
    undo_ipu = patch_tensor_ipu()
    undo_class = model_state.as_plain_module(model)
    try:
        example = tuple(t.detach() for t in micro_batch)
        with capture_contexts(model, training, device, strategy, module_namescope):
            program = torch.export.export(model, example, strict=False)
            history = _blocks.block_history()
        model_state.check_state_unchanged(model, before)
        if strategy is None:
            strategy = PipelinedExecution()
        blocks = strategy._placements(history)
    except Exception as exc:
        eager_words.in_eager_words(exc)  # never name the capture's stand-ins (FakeTensor, ...)
        try:
            # docs/semantics.md S-5 explains most failures
            model_state.check_state_unchanged(model, before)
        finally:
            model_state.restore_state(model, before)
        raise_capture_error(exc)
        raise  # the user's own error, or a PopTorch op's argument check, as it is
    finally:
        undo_ipu()
        undo_class()
        model_state.restore_containers(containers)
        if had_forward:
            model.forward = saved_forward
        else:
            vars(model).pop("forward", None)
        run_post_compile_hooks()
    model_state.bake_constants(program, constants_before)
    # host_functions keep inline poptorch.CPU ops and custom autograd Functions alive
    graph = Graph(program, blocks=blocks, host_functions=_host_ops.take_captured()
                  + autograd_functions.take_captured(),
                  input_names=[n for name, child in zip(bound.names, input_spec.children)
                               for n in leaf_names(name, child)])
    return Captured(graph, out_box.get("spec"), out_box.get("leaves", []),
                    out_box.get("host", []))
