"""The arguments and results of a :class:`poptorch.PoplarExecutor` call
(docs/api-sections.md api §5.2; docs/semantics.md S-11, S-20, S-22…S-24, S-44): binding
the call's
arguments to ``forward``'s signature and checking their batch dimension, the 32-bit contiguous
device inputs, the check that later calls match the compiled inputs, the write-back of inputs
mutated in place, and the output structure. Functions of the executor's state."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from popart_compiler.errors import py_error
from poptorch._capture.args import (RECOMPILE, BoundArgs, Spec, check_batch, flatten,
                                    keys_mismatch,
                                    leaf_names, unflatten, validate)
from poptorch._executor.state import Compiled, ExecutorState
from poptorch._logging import logger

__all__ = ["bind", "check_input_storage", "device_inputs", "validate_inputs",
           "write_back_inputs", "build_outputs", "steady_inputs", "remember_inputs"]


def _no_backward(*args, **kwargs):
    raise py_error("backward() cannot be called explicitly on outputs of a PopTorch "
                   "model. If you're using a trainingModel, the backwards pass is "
                   "performed automatically when invoking the model. If you're using an "
                   "inferenceModel, you should use a trainingModel instead.")


def bind(state: ExecutorState, args, kwargs,
         running: bool = True) -> Tuple[BoundArgs, List[torch.Tensor], Spec]:
    """Bind a call's arguments to ``forward`` and flatten them (docs/semantics.md S-20); check each
    tensor's batch dimension against ``N = D × (R / g) × A`` (docs/semantics.md S-11).
    ``running=False`` (``compile()``, offline precompilation) admits inputs on the
    ``meta`` device: compiling and estimating need shapes only.

    Returns:
        ``(bound, tensors, spec)``: the bound arguments, their tensors in order and
        their structure.
    """
    bound = state.parser.bind(args, kwargs)
    tensors: List[torch.Tensor] = []
    spec = flatten(tuple(bound.values), tensors)
    names = [n for name, child in zip(bound.names, spec.children)
             for n in leaf_names(name, child)]
    o = state.options
    d, r, g = o.device_iterations, o.replication_factor, o.input_group_size
    a = o.Training.gradient_accumulation if state.training else 1
    factor = d * (r // g) * a
    for name, t in zip(names, tensors):
        check_input_storage(name, t, running)
        check_batch(name, t, factor, d, r, g, a)
    return bound, tensors, spec


def _steady_key(args) -> Optional[tuple]:
    """What :func:`bind` and :func:`validate_inputs` read of positional arguments that
    are all plain tensors (type, dtype, shape, device, layout); ``None`` for anything
    else (a subclass, a nested tensor, a non-tensor), which takes the full path."""
    key: tuple = ()
    for t in args:
        if type(t) is not torch.Tensor or t.is_nested:  # pylint: disable=unidiomatic-typecheck
            return None
        key += ((t.dtype, t.shape, t.device, t.layout),)
    return key


def steady_inputs(compiled: Compiled, args, kwargs
                  ) -> Optional[Tuple[BoundArgs, List[torch.Tensor], Spec]]:
    """:func:`bind` for a steady-state call: when ``args`` are plain tensors of the
    same dtypes, shapes, devices and layouts as those of the last call that ran on
    ``compiled`` (:func:`remember_inputs`), and no keyword is given, they bind, satisfy
    :func:`check_input_storage`, the batch check and :func:`validate_inputs` as those
    did: the binding is rebuilt from the stored one without checking again.

    Returns:
        ``(bound, tensors, spec)`` as :func:`bind`, or ``None`` (then call :func:`bind`
        and :func:`validate_inputs`).
    """
    steady = compiled.steady
    if steady is None or kwargs or _steady_key(args) != steady[0]:
        return None
    values = list(args)
    return BoundArgs(list(steady[1]), values, len(values)), list(values), steady[2]


def remember_inputs(compiled: Compiled, args, kwargs, bound: BoundArgs, spec: Spec) -> None:
    """After a call that ran on ``compiled``: keep what :func:`steady_inputs` needs when
    the call passed only plain tensors, positionally, and ``forward`` took no default
    value (its bound values are exactly ``args``)."""
    if kwargs or bound.num_positional != len(args) or len(bound.values) != len(args):
        compiled.steady = None
        return
    key = _steady_key(args)
    compiled.steady = None if key is None else (key, tuple(bound.names), spec)


def check_input_storage(name: str, tensor: torch.Tensor, running: bool = True) -> None:
    """Raise unless ``tensor`` holds values the program can take: a dense (strided),
    non-quantized tensor with data (not on the ``meta`` device when ``running``: a
    compilation without a run needs shapes only), of plain ``torch.Tensor`` kind or a
    subclass whose data is a plain tensor.

    Raises:
        poptorch.Error: naming the input and what to pass instead.
    """
    if running and tensor.is_meta:
        raise py_error(f"The input {name!r} is on the meta device, which holds no values: pass "
                       "a tensor with data (e.g. on the cpu, `x.to_empty(device='cpu')` "
                       "then fill it).")
    if tensor.layout != torch.strided:
        raise py_error(f"The input {name!r} has layout {tensor.layout}; the program takes dense "
                       "tensors only: pass `x.to_dense()`.")
    if tensor.is_quantized:
        raise py_error(f"The input {name!r} is a quantized tensor; the program takes plain "
                       "tensors only: pass `x.dequantize()`.")
    if tensor.is_nested:
        raise py_error(f"The input {name!r} is a nested tensor; the program takes plain "
                       "tensors only: pad it (`torch.nested.to_padded_tensor`).")


def _warn_once(state: ExecutorState, key: str, message: str) -> None:
    if key not in state.warned:
        logger.warning(message)
        state.warned.add(key)


def device_inputs(state: ExecutorState, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """Contiguous, detached, 32-bit versions of the inputs (docs/semantics.md S-24, S-44)."""
    out = []
    for t in tensors:
        if t.requires_grad:
            _warn_once(state, "requires_grad",
                       "Input tensor has requires_grad=True set. This tensor will be "
                       "detached because backward pass via inputs is not supported.")
            t = t.detach()
        if not t.is_contiguous():
            _warn_once(state, "contiguous",
                       "At least one input tensor is not contiguous: non-contiguous "
                       "tensors will be converted.")
            t = t.contiguous()
        if t.dtype == torch.float64:
            t = t.float()
        elif t.dtype == torch.int64:
            t = t.to(torch.int32).to(torch.int64)  # 32-bit range on the device
        out.append(t)
    return out


def validate_inputs(compiled: Compiled, bound: BoundArgs, spec: Spec) -> None:
    """docs/semantics.md S-22: the inputs must match those of the compilation.

    Raises:
        poptorch.Error: other positional / keyword arguments, or other types, shapes
            or structure (naming the argument).
    """
    if bound.num_positional != compiled.num_positional:
        raise py_error(
            f"Number of positional arguments mismatch: expected {compiled.num_positional} "
            f"arguments but got {bound.num_positional}.\n{RECOMPILE}")
    expected = dict(zip(compiled.input_names, compiled.input_spec.children))
    for name, now in zip(bound.names, spec.children):
        if name not in expected:
            raise py_error("Keys mismatch for keyword arguments: " + keys_mismatch(
                [name], sorted(set(expected) - set(bound.names))) + f"\n{RECOMPILE}")
        validate(name, expected[name], now)
    missing = [n for n in compiled.input_names if n not in bound.names]
    if missing:
        raise py_error("Keys mismatch for keyword arguments: "
                       + keys_mismatch([], missing) + f"\n{RECOMPILE}")


def write_back_inputs(compiled: Compiled, originals: List[torch.Tensor],
                      inputs: List[torch.Tensor]) -> None:
    """In-place updates of inputs reach the caller's tensors (docs/semantics.md S-23): the session
    runs the graph on views of ``inputs`` (the device inputs), which are copied back where they are
    not the caller's own tensors (converted dtype, made contiguous)."""
    for i in compiled.executable.graph.mutated_inputs:
        src, dst = inputs[i], originals[i]
        if src.data_ptr() != dst.data_ptr():
            with torch.no_grad():
                dst.copy_(src.to(dst.dtype))


def build_outputs(compiled: Compiled, outputs: List[torch.Tensor]):
    """The structure ``forward`` returned at capture time, its tensors the run's
    outputs and the host outputs (constants, non-tensors) of the capture."""
    captured = compiled.captured
    if captured.output_spec is None:
        return None
    host = iter(captured.host_outputs)
    leaves = [outputs[i] if i is not None else next(host) for i in captured.output_leaves]
    for t in leaves:
        if isinstance(t, torch.Tensor):
            t.backward = _no_backward  # type: ignore[method-assign]
    return unflatten(captured.output_spec, iter(leaves))
