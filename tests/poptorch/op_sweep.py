"""Harness of the ATen op sweep (issue 7, the op-coverage rule): each case is one
PyTorch function or module on tiny inputs, run through ``poptorch.inferenceModel`` and
``poptorch.trainingModel`` and compared with plain PyTorch on the same values.

The cases themselves are in ``op_sweep_cases.py``; ``test_op_coverage.py`` runs them.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn

import poptorch

# -- inputs -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Input:
    """How to make one input tensor: ``kind`` is ``float`` (randn), ``pos`` (in
    [0.5, 2)), ``unit`` (in (-0.9, 0.9)), ``const`` (in [0, 1), never trained: targets
    and weights without a gradient), ``int`` (in [0, high)) or ``bool``."""
    kind: str
    shape: Tuple[int, ...]
    high: int = 0

    def make(self) -> torch.Tensor:
        if self.kind == "float":
            return torch.randn(self.shape)
        if self.kind == "pos":
            return torch.rand(self.shape) * 1.5 + 0.5
        if self.kind == "unit":
            return torch.rand(self.shape) * 1.8 - 0.9
        if self.kind == "const":
            return torch.rand(self.shape)
        if self.kind == "int":
            return torch.randint(0, self.high, self.shape)
        return torch.randn(self.shape) > 0

    @property
    def trainable(self) -> bool:
        return self.kind in ("float", "pos", "unit")


def F(*shape: int) -> Input:
    return Input("float", shape)


def P(*shape: int) -> Input:
    return Input("pos", shape)


def U(*shape: int) -> Input:
    return Input("unit", shape)


def C(*shape: int) -> Input:
    return Input("const", shape)


def I(high: int, *shape: int) -> Input:  # noqa: E743
    return Input("int", shape, high)


def B(*shape: int) -> Input:
    return Input("bool", shape)


# -- cases --------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One sweep entry.

    Attributes:
        name: test id (unique).
        family: op family (the table in docs/ops.md).
        fn: ``fn(*tensors)`` for a functional case, ``fn(module, *tensors)`` when
            ``module`` is given.
        inputs: the input tensors.
        module: builds an ``nn.Module`` whose parameters are trained too.
        grad: whether to run the training check (needs a float output with a gradient).
        tol: absolute and relative tolerance.
    """
    name: str
    family: str
    fn: Callable
    inputs: Tuple[Input, ...]
    module: Optional[Callable[[], nn.Module]] = None
    grad: bool = True
    tol: float = 1e-5


class _Op(nn.Module):
    """The case as a module: float inputs may be parameters (training)."""

    def __init__(self, case: Case, values: Sequence[torch.Tensor], train: bool):
        super().__init__()
        self.fn = case.fn
        self.inner = case.module() if case.module is not None else None
        self.trained = [train and spec.trainable for spec in case.inputs]
        self.params = nn.ParameterList(
            [nn.Parameter(v.clone()) for v, t in zip(values, self.trained) if t])

    def compute(self, *args):
        params, others = iter(self.params), iter(args)
        values = [next(params) if t else next(others) for t in self.trained]
        if self.inner is not None:
            return self.fn(self.inner, *values)
        return self.fn(*values)


def _leaves(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if out is None:
        return []
    return [t for o in out for t in _leaves(o)]


class _Inference(_Op):
    def forward(self, *args):
        return tuple(_leaves(self.compute(*args)))


class _Training(_Op):
    def forward(self, *args):
        outs = _leaves(self.compute(*args))
        loss = 0.0
        for out in outs:
            if out.is_floating_point():
                weight = torch.linspace(-1.0, 1.5, out.numel(), device=out.device,
                                        dtype=out.dtype).reshape(out.shape)
                loss = loss + (out * weight).sum()
        return (*outs, poptorch.identity_loss(loss, reduction="none"))


def _device_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the IPU returns for an output of ``dtype`` (docs/semantics.md S-44)."""
    return {torch.float64: torch.float32, torch.int64: torch.int32}.get(dtype, dtype)


def _compare(case: Case, outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor],
             what: str) -> None:
    assert len(outs) == len(refs), f"{case.name}: {len(outs)} outputs, expected {len(refs)}"
    for i, (out, ref) in enumerate(zip(outs, refs)):
        ref = ref.detach()
        assert out.dtype == _device_dtype(ref.dtype), \
            f"{case.name} {what} output {i}: dtype {out.dtype}, expected {ref.dtype} (S-44)"
        torch.testing.assert_close(out, ref.to(out.dtype), rtol=case.tol, atol=case.tol,
                                   equal_nan=True, msg=lambda m: f"{case.name} {what} "
                                   f"output {i}: {m}")


def aten_ops(executor: poptorch.PoplarExecutor) -> Set[str]:
    """Qualified names of the ATen ops (overload packets) in a compiled executor."""
    found = set()
    module = executor._state.executable.graph.module
    for gm in module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            for node in gm.graph.nodes:
                if node.op == "call_function" and \
                        isinstance(node.target, torch._ops.OpOverload):
                    found.add(node.target._schema.name)
    return found


def _values(case: Case) -> List[torch.Tensor]:
    torch.manual_seed(0)
    return [spec.make() for spec in case.inputs]


def check_inference(case: Case) -> Set[str]:
    """Run ``case`` with ``inferenceModel``; returns the ATen ops of its graph."""
    values = _values(case)
    torch.manual_seed(1)
    model = _Inference(case, values, train=False)
    ref = copy.deepcopy(model)
    executor = poptorch.inferenceModel(model)
    outs = executor(*values)
    refs = ref(*values)
    _compare(case, outs, refs, "inference")
    return aten_ops(executor)


def check_training(case: Case, lr: float = 0.5) -> Set[str]:
    """One SGD step with ``trainingModel``: outputs, loss and every updated parameter
    (the case's float inputs and its module's weights) equal plain PyTorch's."""
    values = _values(case)
    torch.manual_seed(1)
    model = _Training(case, values, train=True)
    ref = copy.deepcopy(model)
    constants = [v for v, t in zip(values, model.trained) if not t]
    executor = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(
        model.parameters(), lr=lr))
    outs = executor(*constants)
    optimizer = torch.optim.SGD(ref.parameters(), lr=lr)
    refs = ref(*constants)
    # the values the forward pass computed: an output that aliases a parameter (a view,
    # torch.positive) would otherwise show the value after the step (docs/semantics.md S-14)
    forward_values = [r.detach().clone() for r in refs]
    refs[-1].backward()
    optimizer.step()
    _compare(case, outs, forward_values, "training")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=case.tol, atol=case.tol,
                                   msg=lambda m: f"{case.name} updated {name}: {m}")
    return aten_ops(executor)


def families(cases: Sequence[Case]) -> Dict[str, List[Case]]:
    found: Dict[str, List[Case]] = {}
    for case in cases:
        found.setdefault(case.family, []).append(case)
    return found
