"""Values of tensors that ``forward`` computes from constants only, known at capture.

PopTorch captures ``forward`` once, with Python constants and tensors created in
``forward`` frozen into the graph (docs/semantics.md S-1). A tensor computed only from such
constants (``nn.Transformer.generate_square_subsequent_mask(3)``, ``torch.tensor([2, 3]) * 4``)
has the same value on every run, so Python code may read it: PyTorch's own
``nn.TransformerDecoder`` does (``bool((mask == causal_mask).all())`` to detect a
causal mask). ``torch.export`` traces with fake tensors, which carry no values; here
such a read evaluates the recorded ops that produced the tensor with PyTorch's kernels
and answers with the real value. A tensor that depends on an input, a parameter, a
buffer or a random op is not a constant and its read stays a data-dependence error.
"""
from __future__ import annotations

import operator
from typing import Dict, List, Optional

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import (disable_proxy_modes_tracing, get_proxy_mode,
                                                get_proxy_slot)

__all__ = ["VALUE_READS", "constant_value", "producing_op"]

#: Tensor methods and functions that hand a tensor's value to Python, with the name
#: error messages use for them.
VALUE_READS = {
    torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.item: "tensor.item()",
    torch.Tensor.tolist: "tensor.tolist()",
    torch.Tensor.numpy: "tensor.numpy()",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "a tensor used as a Python int",
    torch.Tensor.equal: "tensor.equal()",
    torch.equal: "torch.equal()",
    torch.Tensor.allclose: "tensor.allclose()",
    torch.allclose: "torch.allclose()",
}


def _mutates(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(a.alias_info is not None and a.alias_info.is_write
               for a in target._schema.arguments)


def _constant_ancestry(node: fx.Node) -> Optional[List[fx.Node]]:
    """The nodes that ``node``'s value depends on (``node`` included, and every op that
    wrote one of them in place), in graph order, if all of them are constants or
    deterministic ATen ops; otherwise ``None``."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        stack.extend(user for user in current.users if _mutates(user))
        if current.op == "get_attr":
            continue
        if current.op != "call_function":
            return None  # a placeholder: an input, a parameter or a buffer
        target = current.target
        if isinstance(target, torch._ops.OpOverload):
            if torch.Tag.nondeterministic_seeded in target.tags:
                return None
        elif target is not operator.getitem:
            return None
        stack.extend(current.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _evaluate(nodes: List[fx.Node], root: torch.nn.Module) -> Dict[fx.Node, object]:
    values: Dict[fx.Node, object] = {}
    for node in nodes:
        if node.op == "get_attr":
            values[node] = operator.attrgetter(node.target)(root)
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
        values[node] = node.target(*args, **kwargs)
    return values


def _node_of(tensor: torch.Tensor) -> Optional[fx.Node]:
    """The graph node that produced ``tensor`` in the trace being recorded."""
    mode = get_proxy_mode()
    if mode is None or not is_fake(tensor):
        return None
    slot = get_proxy_slot(tensor, mode.tracer, None)
    return None if slot is None else slot.proxy.node


def producing_op(tensor: torch.Tensor) -> Optional[str]:
    """Qualified name of the ATen op that produced ``tensor`` (``aten::nonzero``)."""
    node = _node_of(tensor)
    if node is None or not isinstance(node.target, torch._ops.OpOverload):
        return None
    return node.target._schema.name


def constant_value(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The real value of ``tensor`` (a fake tensor being traced) when the captured
    graph computes it from constants only, else ``None``."""
    node = _node_of(tensor)
    nodes = None if node is None else _constant_ancestry(node)
    if nodes is None:
        return None
    root = get_proxy_mode().tracer.root
    with unset_fake_temporarily(), disable_proxy_modes_tracing(), \
            torch._C.DisableTorchFunction():
        try:
            value = _evaluate(nodes, root)[node]
        except Exception:  # an op without an eager kernel: treat the value as unknown
            return None
    return value if isinstance(value, torch.Tensor) else None
