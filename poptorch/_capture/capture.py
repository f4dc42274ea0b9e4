"""Capture of one micro-batch of a model's ``forward`` with ``torch.export``
(non-strict) into a :class:`popart_compiler.ir.Graph` (docs/semantics.md S-1…S-6, S-24, S-44).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import logging
import os
import sys
import traceback
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from popart_compiler.errors import Error, backend_error, py_error
from popart_compiler.ir import Graph
from popart_compiler.passes.placement import BLOCK_KEY, NO_ACTIVE_BLOCK_KEY
from poptorch import _impl
from poptorch._capture import data_dependence, eager_words, number_reads, storage_reads
from poptorch._capture.args import BoundArgs, Spec, flatten, leaf_names, unflatten
from poptorch._capture.constants import VALUE_READS, constant_value, producing_op
from poptorch._capture.dtype_rules import DtypeRulesMode
from poptorch._capture.guard import capture_guard, thread_stderr
from poptorch._capture.substitution import OverwriteContextManager
from poptorch._capture.warnings import at_user_code
from poptorch._logging import logger
from poptorch._ops import autograd_functions
from poptorch._ops import blocks as _blocks
from poptorch._ops import dynamic_slicing
from poptorch._ops import host as _host_ops
from poptorch._ops import opaque, static_counts
from poptorch._options.execution_strategy import PipelinedExecution

__all__ = ["capture", "Captured", "registerPreCompileHook", "registerPostCompileHook"]

# OrderedDicts: RemovableHandle keeps a weak reference to its registry.
_PRE_HOOKS: Dict[int, Callable[[], None]] = collections.OrderedDict()
_POST_HOOKS: Dict[int, Callable[[], None]] = collections.OrderedDict()


def _register(registry: Dict[int, Callable[[], None]], hook) -> RemovableHandle:
    if not callable(hook):
        raise RuntimeError("The compile hook must be callable")
    handle = RemovableHandle(registry)
    registry[handle.id] = hook
    return handle


def registerPreCompileHook(hook: Callable[[], None]) -> RemovableHandle:
    """Run ``hook()`` right before every model's ``forward`` is captured
    (docs/api-sections.md api §2.8).

    Returns:
        A handle whose ``remove()`` unregisters the hook.

    Raises:
        RuntimeError: ``hook`` is not callable.
    """
    return _register(_PRE_HOOKS, hook)


def registerPostCompileHook(hook: Callable[[], None]) -> RemovableHandle:
    """Run ``hook()`` when every capture ends, also when it fails
    (docs/api-sections.md api §2.9)."""
    return _register(_POST_HOOKS, hook)


# -- device placement inside forward (docs/semantics.md S-3)
# -------------------------------------------

_FACTORIES = {
    torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.linspace,
    torch.logspace, torch.rand, torch.randn, torch.randint, torch.randperm, torch.tensor,
    torch.full_like, torch.zeros_like, torch.ones_like, torch.empty_like, torch.rand_like,
    torch.randn_like, torch.randint_like, torch.normal, torch.eye,
}
_LIKE = {torch.full_like, torch.zeros_like, torch.ones_like, torch.empty_like,
         torch.rand_like, torch.randn_like, torch.randint_like}


def _is_ipu(device) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "ipu"
    return isinstance(device, torch.device) and device.type == "ipu"


class _IpuDeviceMode(TorchFunctionMode):
    """Maps ``device="ipu"`` / ``.to("ipu")`` to the execution device and logs the
    "forcing to IPU" warning for factories called without a device (docs/semantics.md S-3)."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)
        self.offsets = dynamic_slicing.OffsetTracker()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        _tag_ops()
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_ipu(kwargs["device"]):
            kwargs["device"] = self.device
        elif func in _FACTORIES and func not in _LIKE and "device" not in kwargs and not (
                func is torch.normal and any(isinstance(a, torch.Tensor) for a in args)):
            name = getattr(func, "__name__", str(func))
            logger.warning("No device set in torch.%s(): forcing to IPU", name)
        if func in (torch.Tensor.to, torch.Tensor.cuda) or getattr(func, "__name__", "") == "to":
            args = tuple(self.device if _is_ipu(a) else a for a in args)
        if getattr(func, "__name__", "") == "ipu":  # Tensor.ipu() does not exist in torch
            return args[0]
        # t[x:x + n] (docs/semantics.md S-102)
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            sliced = self.offsets.rewrite_getitem(*args)
            if sliced is not None:
                return sliced
        sliced = self.offsets.rewrite_slice(func, args)
        if sliced is not None:
            return sliced
        if func in VALUE_READS:
            result = _read_value(func, args, kwargs)
            self.offsets.record(func, args, result)
            return result
        static = static_counts.rewrite_for(func, args, kwargs)
        if static is not None:
            return static()
        func = opaque.redirect_for(func) or func
        try:
            result = func(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, Error) or not data_dependence.is_data_dependent(exc):
                raise
            raise data_dependence.op_error(func, exc) from None
        _check_static_shape(result, func)
        self.offsets.record(func, args, result)
        return result


def _read_value(func, args, kwargs):
    """A tensor's value handed to Python: known at capture if it is computed from
    constants only; otherwise a data-dependence error naming the read."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    values = [constant_value(t) for t in tensors]
    if tensors and all(v is not None for v in values):
        real = iter(values)
        args = tuple(next(real) if isinstance(a, torch.Tensor) else a for a in args)
        with unset_fake_temporarily(), disable_proxy_modes_tracing():
            return func(*args, **kwargs)
    try:
        return func(*args, **kwargs)
    except Exception as exc:
        # A fake tensor has no storage for .numpy() to share: its value is unknown too.
        if data_dependence.is_data_dependent(exc) or func is torch.Tensor.numpy:
            raise data_dependence.read_error(
                VALUE_READS[func], traceback.extract_stack()[:-1]) from None
        raise


def _check_static_shape(result, func) -> None:
    """The IPU's graphs are static: an op whose output shape depends on tensor values
    (boolean-mask indexing, ``nonzero``, ``unique``, ...) cannot be captured."""
    values = result if isinstance(result, (tuple, list)) else (result,)
    for value in values:
        if isinstance(value, torch.Tensor) and not all(isinstance(d, int)
                                                       for d in value.shape):
            name = data_dependence.function_name(func)
            aten = producing_op(value)
            raise data_dependence.shape_error(f"{name} ({aten})" if aten else name,
                                               traceback.extract_stack()[:-1])


def _patch_tensor_ipu() -> Callable[[], None]:
    """Give tensors an ``.ipu()`` method during capture (PopTorch programs use it)."""
    had = hasattr(torch.Tensor, "ipu")
    if not had:
        torch.Tensor.ipu = lambda self, *a, **k: self  # type: ignore[attr-defined]

    def undo():
        if not had:
            del torch.Tensor.ipu
    return undo


# -- error translation ------------------------------------------------------------------

#: poptorch's own source directory (a PopTorch op's argument checks raise from here).
_POPTORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_frame(exc: BaseException) -> Optional[traceback.FrameSummary]:
    """The innermost traceback frame in user code (not torch / poptorch)."""
    return data_dependence.user_frame(traceback.extract_tb(exc.__traceback__))


# -- constants, parameters and quiet logs ------------------------------------------------

@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Silence torch's own diagnostics while capturing: its loggers, its warnings and
    the partial graph ``torch.export`` prints to stderr when it fails (PopTorch reports
    capture errors itself). Anything else written to stderr is passed through."""
    names = ["torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export",
             "torch._export", "torch.fx.experimental.recording", "torch._functorch"]
    saved = []
    for name in names:
        lg = logging.getLogger(name)
        saved.append((lg, lg.level))
        lg.setLevel(logging.CRITICAL)
    real_stderr = sys.stderr
    buffer = io.StringIO()
    try:
        with warnings.catch_warnings(), thread_stderr(buffer):
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*TorchScript.*")
            yield
    except BaseException as exc:
        text = buffer.getvalue()
        partial = getattr(exc, "partial_fx_graph", None)
        if partial is not None:
            text = text.replace(f"{partial}\n", "").replace(str(partial), "")
        real_stderr.write(text)
        raise
    else:
        real_stderr.write(buffer.getvalue())
    finally:
        for lg, level in saved:
            lg.setLevel(level)


def _plain_tensor_attributes(model: torch.nn.Module) -> Dict[int, torch.Tensor]:
    """id → clone of every tensor attribute that is neither a parameter nor a buffer."""
    found = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                found[id(value)] = value.detach().clone()
    return found


@contextlib.contextmanager
def _device_weights(model: torch.nn.Module) -> Iterator[None]:
    """Hold float64 parameters and buffers as float32 during capture (docs/semantics.md S-44)."""
    swapped: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for t in list(model.parameters()) + list(model.buffers()):
        if t.dtype == torch.float64 and all(t is not s for s, _ in swapped):
            swapped.append((t, t.data))
            t.data = t.data.float()
    if swapped:
        logger.warning("[DISPATCHER] Type coerced from Double to Float for %d model "
                       "tensor(s): the IPU has no 64-bit floating point type",
                       len(swapped))
    try:
        yield
    finally:
        for t, data in swapped:
            t.data = data


def _state_identity(model: torch.nn.Module):
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    buffers = {n: b for n, b in model.named_buffers(remove_duplicate=False)}
    return params, buffers


def _check_state_unchanged(model: torch.nn.Module, before) -> None:
    """docs/semantics.md S-5: parameters and buffers must be neither removed nor reassigned."""
    params0, buffers0 = before
    params1, buffers1 = _state_identity(model)
    bn_types = (torch.nn.modules.batchnorm._NormBase,)
    exempt = {name for name, m in model.named_modules() if isinstance(m, bn_types)}

    def owner(name):
        return name.rpartition(".")[0]

    for kind, old, new in (("Buffer", buffers0, buffers1), ("Parameter", params0, params1)):
        for name, tensor in old.items():
            if kind == "Buffer" and owner(name) in exempt:
                continue
            if name not in new:
                raise py_error(f"{kind} {name} is removed from the model when calling the "
                               "forward method.")
            if new[name] is not tensor:
                attr = name.rpartition(".")[2]
                raise py_error(
                    f"{kind} {name} is reassigned within the model when calling the forward "
                    f"method. This is not supported. Consider using self.{attr}.copy_(src) "
                    f"to copy data from a source tensor, where src is the name of the "
                    "source tensor.")


#: Attributes every ``nn.Module`` has (its own bookkeeping, never the user's).
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def _container_attributes(model: torch.nn.Module) -> List[Tuple[Dict[str, Any], str, Any]]:
    """``(vars(module), name, value)`` of every dict / list / set / tuple attribute of
    the user's modules."""
    found = []
    for module in model.modules():
        attrs = vars(module)
        for name, value in attrs.items():
            if name not in _MODULE_INTERNALS and isinstance(value, (dict, list, set, tuple)):
                found.append((attrs, name, value))
    return found


def _restore_containers(found: List[Tuple[Dict[str, Any], str, Any]]) -> None:
    """Put back the user's container objects: ``torch.export`` rebuilds containers it
    traces through and writes the copies back into the module, after which edits the
    user makes to the original (``model.cfg["flag"] = True``) would not be seen."""
    for attrs, name, value in found:
        if name in attrs and attrs[name] is not value:
            attrs[name] = value


def _restore_state(model: torch.nn.Module, before) -> None:
    params0, buffers0 = before
    for kind, table in (("_parameters", params0), ("_buffers", buffers0)):
        for name, tensor in table.items():
            path, _, attr = name.rpartition(".")
            module = model.get_submodule(path) if path else model
            getattr(module, kind)[attr] = tensor


@contextlib.contextmanager
def _no_distribution_validation() -> Iterator[None]:
    """``torch.distributions`` argument validation is off during capture (docs/semantics.md S-3)."""
    previous = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(previous)


# -- block tags (docs/semantics.md S-60)
# ---------------------------------------------------------------------

_tagging = [False]


def _tag_ops() -> None:
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


def _untag_ops() -> None:
    """Ops created after ``forward`` returned (by the tracer) carry no block tag."""
    _tagging[0] = False
    custom = torch.fx.traceback.current_meta.get("custom")
    if custom is not None:
        custom.pop(BLOCK_KEY, None)
        custom.pop(NO_ACTIVE_BLOCK_KEY, None)


@contextlib.contextmanager
def _block_tags(strategy) -> Iterator[None]:
    """Record blocks (docs/api-sections.md api §9) while capturing: reset the block state, tag ops
    with their block through preserved node metadata."""
    if strategy is not None:
        strategy._onStartCapture()
    with _blocks.block_capture(on_change=_tag_ops), torch.fx.traceback.preserve_node_meta():
        try:
            yield
        finally:
            _tagging[0] = False


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
        state = _state_identity(model)
        _tagging[0] = True
        _tag_ops()
        try:
            result = bound.call(forward, values)
        finally:
            _untag_ops()
        _check_state_unchanged(model, state)
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

    for hook in list(_PRE_HOOKS.values()):
        hook()
    before = _state_identity(model)
    _host_ops.take_captured()
    autograd_functions.take_captured()
    constants_before = _plain_tensor_attributes(model)
    containers = _container_attributes(model)
    had_forward = "forward" in vars(model)
    saved_forward = vars(model).get("forward")
    model.forward = flat_forward
    undo_ipu = _patch_tensor_ipu()
    undo_class = _as_plain_module(model)
    try:
        example = tuple(t.detach() for t in micro_batch)
        scope = {} if module_namescope else {"no_module_scope": True}
        with _block_tags(strategy), _impl.device_context(training), _quiet_torch_logs(), \
                at_user_code(data_dependence.user_frame), \
                _device_weights(model), opaque.opaque_functions(), \
                _IpuDeviceMode(device), DtypeRulesMode(), _no_distribution_validation(), \
                OverwriteContextManager(), autograd_functions.honoured_backwards(), \
                fx_traceback.annotate(scope):
            program = torch.export.export(model, example, strict=False)
            history = _blocks.block_history()
        _check_state_unchanged(model, before)
        if strategy is None:
            strategy = PipelinedExecution()
        blocks = strategy._placements(history)
    except Exception as exc:
        eager_words.in_eager_words(exc)  # never name the capture's stand-ins (FakeTensor, ...)
        try:
            _check_state_unchanged(model, before)  # docs/semantics.md S-5 explains most failures
        finally:
            _restore_state(model, before)
        if isinstance(exc, Error):
            raise
        storage_reads.raise_if_storage_read(exc)  # e.g. Lightning's self.log in a step
        if data_dependence.is_data_dependent(exc):
            raise data_dependence.data_dependent_error(exc) from None
        frame = _user_frame(exc)
        origin = traceback.extract_tb(exc.__traceback__)
        if frame is not None and origin and origin[-1].filename == frame.filename:
            raise  # raised by the user's own code
        if (frame is not None and isinstance(exc, (ValueError, AssertionError)) and origin
                and os.path.abspath(origin[-1].filename).startswith(_POPTORCH_DIR)):
            # a PopTorch op's argument check: docs/api-sections.md api §8 names these exception
            # types
            raise
        if isinstance(exc, (AssertionError, ValueError, TypeError, RuntimeError,
                            NotImplementedError, KeyError, IndexError)) and frame is None:
            raise
        raise backend_error(f"Failed to capture the model's forward: "
                            f"{type(exc).__name__}: {exc}") from exc
    finally:
        undo_ipu()
        undo_class()
        _restore_containers(containers)
        if had_forward:
            model.forward = saved_forward
        else:
            vars(model).pop("forward", None)
        for hook in list(_POST_HOOKS.values()):
            hook()
    _bake_constants(program, constants_before)
    # host_functions keep inline poptorch.CPU ops and custom autograd Functions alive
    graph = Graph(program, blocks=blocks, host_functions=_host_ops.take_captured()
                  + autograd_functions.take_captured(),
                  input_names=[n for name, child in zip(bound.names, input_spec.children)
                               for n in leaf_names(name, child)])
    return Captured(graph, out_box.get("spec"), out_box.get("leaves", []),
                    out_box.get("host", []))


def _as_plain_module(model: torch.nn.Module) -> Callable[[], None]:
    """``torch.export`` runs a ``torch.fx.GraphModule`` root with an fx Interpreter,
    bypassing the instance's ``forward`` that the capture installs: present such a
    root as a plain ``nn.Module`` while capturing (its generated ``forward``, bound
    beforehand, still runs). Returns the undo function."""
    if not isinstance(model, torch.fx.GraphModule):
        return lambda: None
    original = model.__class__
    model.__class__ = type("GraphModuleRoot", (torch.nn.Module,), {})

    def undo():
        model.__class__ = original
    return undo


def _bake_constants(program, before: Dict[int, torch.Tensor]) -> None:
    """Constants hold their capture-time values (docs/semantics.md S-1): undo in-place updates made
    to plain tensor attributes while capturing, in the program's copies only."""
    for name, value in list(program.constants.items()):
        if isinstance(value, torch.Tensor) and id(value) in before:
            program.constants[name] = before[id(value)]
