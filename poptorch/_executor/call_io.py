"""The arguments and results of a :class:`poptorch.PoplarExecutor` call (spec api §5.2;
S-11, S-20, S-22…S-24, S-44): binding the call's arguments to ``forward``'s
signature and checking their batch dimension, the 32-bit contiguous device inputs,
the check that later calls match the compiled inputs, the write-back of inputs
mutated in place, and the output structure. A mixin of ``PoplarExecutor``."""
from __future__ import annotations

from typing import List, Tuple

import torch

from popart_compiler.errors import py_error

from poptorch._capture.args import BoundArgs, Spec, check_batch, flatten, leaf_names, unflatten, validate
from poptorch._logging import logger

__all__ = ["CallIOMixin"]

_RECOMPILE = ("The inputs given at run time differ from the ones the model was compiled "
              "with. To run with these inputs, create a new wrapper or call destroy() on "
              "this one: the next call then recompiles.")


def _no_backward(*args, **kwargs):
    raise py_error("backward() cannot be called explicitly on outputs of a PopTorch "
                   "model. If you're using a trainingModel, the backward pass is "
                   "performed automatically when invoking the model. If you're using an "
                   "inferenceModel, you should use a trainingModel instead.")


class CallIOMixin:
    """Inputs in, outputs out. Uses the executor's ``_parser``, ``_options``,
    ``_training``, the compiled ``_input_spec`` / ``_input_names`` /
    ``_num_positional``, ``_executable`` and ``_captured``; the one-time warnings set
    ``_warned_requires_grad`` and ``_warned_contiguous``."""

    def _bind(self, args, kwargs) -> Tuple[BoundArgs, List[torch.Tensor], Spec]:
        bound = self._parser.bind(args, kwargs)
        tensors: List[torch.Tensor] = []
        spec = flatten(tuple(bound.values), tensors)
        names = [n for name, child in zip(bound.names, spec.children)
                 for n in leaf_names(name, child)]
        o = self._options
        d, r, g = o.device_iterations, o.replication_factor, o.input_group_size
        a = o.Training.gradient_accumulation if self._training else 1
        factor = d * (r // g) * a
        for name, t in zip(names, tensors):
            check_batch(name, t, factor, d, r, g, a)
        return bound, tensors, spec

    def _batch_factor(self) -> int:
        o = self._options
        a = o.Training.gradient_accumulation if self._training else 1
        return o.device_iterations * (o.replication_factor // o.input_group_size) * a

    def _device_inputs(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """Contiguous, detached, 32-bit versions of the inputs (S-24, S-44)."""
        out = []
        for t in tensors:
            if t.requires_grad:
                if not self._warned_requires_grad:
                    logger.warning("Input tensor has requires_grad=True set. This tensor "
                                   "will be detached because backward pass via inputs is "
                                   "not supported.")
                    self._warned_requires_grad = True
                t = t.detach()
            if not t.is_contiguous():
                if not self._warned_contiguous:
                    logger.warning("At least one input tensor is not contiguous: non-"
                                   "contiguous tensors will be converted.")
                    self._warned_contiguous = True
                t = t.contiguous()
            if t.dtype == torch.float64:
                t = t.float()
            elif t.dtype == torch.int64:
                t = t.to(torch.int32).to(torch.int64)  # 32-bit range on the device
            out.append(t)
        return out

    def _validateInputs(self, bound: BoundArgs, spec: Spec) -> None:
        """S-22: the inputs must match those of the compilation."""
        if bound.num_positional != self._num_positional:
            raise py_error(
                f"Number of positional arguments mismatch: expected {self._num_positional} "
                f"arguments but got {bound.num_positional}.\n{_RECOMPILE}")
        compiled = dict(zip(self._input_names, self._input_spec.children))
        for name, now in zip(bound.names, spec.children):
            if name not in compiled:
                raise py_error(f"Keys mismatch for keyword arguments: Unexpected arguments: "
                               f"['{name}']. Missing arguments: "
                               f"{sorted(set(compiled) - set(bound.names))}.\n{_RECOMPILE}")
            validate(name, compiled[name], now)
        missing = [n for n in self._input_names if n not in bound.names]
        if missing:
            raise py_error(f"Keys mismatch for keyword arguments: Unexpected arguments: []. "
                           f"Missing arguments: {missing}.\n{_RECOMPILE}")

    def _writeBackInputs(self, originals: List[torch.Tensor],
                         device_inputs: List[torch.Tensor]) -> None:
        """In-place updates of inputs reach the caller's tensors (S-23): the session runs
        the graph on views of ``device_inputs``, which are copied back where they are
        not the caller's own tensors (converted dtype, made contiguous)."""
        mutated = self._executable.graph.mutated_inputs if self._executable else ()
        for i in mutated:
            src, dst = device_inputs[i], originals[i]
            if src.data_ptr() != dst.data_ptr():
                with torch.no_grad():
                    dst.copy_(src.to(dst.dtype))

    def _buildOutputs(self, outputs: List[torch.Tensor]):
        captured = self._captured
        if captured.output_spec is None:
            return None
        host = iter(captured.host_outputs)
        leaves = [outputs[i] if i is not None else next(host) for i in captured.output_leaves]
        for t in leaves:
            if isinstance(t, torch.Tensor):
                t.backward = _no_backward  # type: ignore[method-assign]
        return unflatten(captured.output_spec, iter(leaves))
