"""What each operation of a captured program costs, read from shapes alone.

The IPU Model's memory and cycle estimates (:mod:`.memory_model`, :mod:`.cycle_model`)
start here. For every node of the graph this module records where it runs (the
``node.meta["placement"]`` written by the placement pass, or a layer → IPU mapping
computed from ``nn_module_stack``), the bytes it produces and reads (from the fake
tensors in ``node.meta["val"]``), its FLOPs (``torch.utils.flop_counter`` evaluated on
``meta`` tensors: no kernel runs at full size), and the IPU-compiler steering ops
around it (``recomputation_checkpoint``, ``set_available_memory``,
``serialized_matmul``, matched by op name; api §8).
"""
from __future__ import annotations

import dataclasses
import operator
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from .errors import backend_error
from .ir import Graph, _op_name

__all__ = ["OpCost", "WeightCost", "ProgramCosts", "collect", "steering_op",
           "layer_placement"]

#: Steering ops (api §8) by op name; any namespace (``poptorch::<name>``).
CHECKPOINT_OP = "recomputation_checkpoint"
AVAILABLE_MEMORY_OP = "set_available_memory"
SERIALIZED_MATMUL_OP = "serialized_matmul"

#: Ops whose output aliases an input: no new memory, no compute.
_VIEW_TAG = "view"
#: Element-wise ops that cost several vector instructions per element on a tile.
_TRANSCENDENTAL = frozenset({
    "gelu", "tanh", "exp", "log", "sigmoid", "softmax", "_softmax", "log_softmax",
    "_log_softmax", "layer_norm", "native_layer_norm", "batch_norm", "group_norm",
    "erf", "pow", "sqrt", "rsqrt", "div", "cross_entropy_loss", "nll_loss",
    "silu", "mean", "var", "var_mean", "_native_batch_norm_legit_functional",
    "native_batch_norm",
})


@dataclasses.dataclass
class OpCost:
    """One operation of the forward program.

    Attributes:
        name: the fx node name.
        op: the op name (``linear``, ``softmax``, ...).
        ipu / stage: where it runs (``Placement`` of contract A; 0 when absent).
        layer: the layer key used by :func:`layer_placement` (``""`` outside layers).
        out_bytes: bytes of its outputs (0 for views).
        in_bytes: bytes of its tensor inputs.
        weight_bytes: bytes of the inputs that are parameters or buffers.
        elements: elements of its outputs.
        flops: forward FLOPs counted by ``torch.utils.flop_counter`` (matmuls,
            convolutions, attention); 0 for other ops.
        vector_ops: element operations done by the tiles' vector units (the other ops):
            one per element of its largest output or activation input, four for
            transcendental ops.
        half: whether it computes in float16.
        view: whether its output aliases an input.
        checkpoint: a ``recomputation_checkpoint``: its output is kept for backward.
        available_memory: ``set_available_memory`` proportion applied to it, if any.
        serialization: ``(mode, factor)`` of a ``serialized_matmul``, if any.
        inputs: names of the nodes it reads.
    """
    name: str
    op: str
    ipu: int = 0
    stage: int = 0
    layer: str = ""
    out_bytes: int = 0
    in_bytes: int = 0
    weight_bytes: int = 0
    elements: int = 0
    flops: float = 0.0
    vector_ops: float = 0.0
    half: bool = False
    view: bool = False
    checkpoint: bool = False
    available_memory: Optional[float] = None
    serialization: Optional[Tuple[str, int]] = None
    inputs: Tuple[str, ...] = ()

    @property
    def signature(self) -> Tuple:
        """What makes two ops share code after outlining: op and output size."""
        return (self.op, self.out_bytes, self.in_bytes)


@dataclasses.dataclass
class WeightCost:
    """A parameter or buffer.

    Attributes:
        name: its ``state_dict`` name.
        elements / bytes: its size.
        ipus: the IPUs whose ops read it (a tied weight lives on each of them).
        trainable: whether it has a gradient and optimizer state.
        itemsize: bytes per element.
    """
    name: str
    elements: int
    bytes: int
    ipus: Tuple[int, ...]
    trainable: bool
    itemsize: int


@dataclasses.dataclass
class ProgramCosts:
    """The costed program: ops in execution order, weights, and I/O per micro-batch.

    Attributes:
        ops: forward ops in execution order.
        weights: parameters and buffers.
        input_bytes / output_bytes: host ↔ device bytes of one micro-batch.
        num_ipus: IPUs the placement uses.
        stages: pipeline stages in order, each ``(stage, ipu)``.
    """
    ops: List[OpCost]
    weights: List[WeightCost]
    input_bytes: int
    output_bytes: int
    num_ipus: int
    stages: List[Tuple[int, int]]


def steering_op(node: fx.Node) -> str:
    """The op name of a call (``poptorch::set_available_memory`` → its name), or ``""``.

    Steering ops are matched by name in any namespace (contract B).
    """
    if node.op != "call_function":
        return ""
    parts = str(node.target).split(".")
    if len(parts) >= 2 and parts[1] in (CHECKPOINT_OP, AVAILABLE_MEMORY_OP,
                                        SERIALIZED_MATMUL_OP):
        return parts[1]
    return ""


def _tensors(value) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _bytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _is_view(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if _op_name(node) in ("_assert_tensor_metadata", "sym_size", "sym_numel"):
        return True
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and \
        not returns[0].alias_info.is_write


def _as_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_as_meta(v) for v in value)
    return value


def _flops(node: fx.Node) -> float:
    """FLOPs of one node from ``torch.utils.flop_counter`` on ``meta`` tensors."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    name = _op_name(node)
    if not any(k in name for k in ("linear", "mm", "matmul", "conv", "attention",
                                   "einsum", "bilinear", SERIALIZED_MATMUL_OP)):
        return 0.0
    args = fx.node.map_arg(node.args, lambda n: _as_meta(n.meta.get("val")))
    kwargs = fx.node.map_arg(node.kwargs, lambda n: _as_meta(n.meta.get("val")))
    if name == SERIALIZED_MATMUL_OP:
        target, args, kwargs = torch.ops.aten.matmul.default, args[:2], {}
    else:
        target = node.target
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _NoModuleTracking()
    try:
        with counter:
            target(*args, **kwargs)
    except Exception:  # an op without a meta kernel counts as vector work
        return 0.0
    return float(counter.get_total_flops())


class _NoModuleTracking:
    """Stands in for ``FlopCounterMode``'s module tracker, which registers
    process-wide module hooks while counting: another thread's training run then met
    those hooks in its backward pass and failed ("A leaf node was passed to
    _will_engine_execute_node ..."). Counting one op needs no per-module split."""
    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


def _layer_key(node: fx.Node) -> str:
    """``layers.3`` for a node inside the 4th module of a ``ModuleList`` (the deepest
    ``<name>.<index>`` in its ``nn_module_stack``), else ``""``."""
    stack = node.meta.get("nn_module_stack") or {}
    key = ""
    for path, _cls in stack.values():
        path = re.sub(r"^(?:L\['self'\]|L__self__)\.?", "", str(path))
        match = re.match(r"^(.*?[A-Za-z_][\w]*)\.(\d+)(?:$|\.)", path)
        if match and not key:
            key = f"{match.group(1)}.{match.group(2)}"
    return key


def layer_placement(graph: Graph, layers_per_ipu: Sequence[int],
                    head_ipu: Optional[int] = None) -> Dict[str, Tuple[int, int]]:
    """A pipeline placement from a layers-per-IPU list, as optimum-graphcore's
    ``layers_per_ipu`` does: the repeated layers (the entries of the model's largest
    ``ModuleList``) go to IPUs in order, ops before the first layer (embeddings) to IPU
    0 and ops after the last layer (heads) to ``head_ipu``. IPU ``i`` is stage ``i``;
    a head on an earlier IPU (BERT's masked-LM head, tied to the embeddings on IPU 0)
    is one more stage.

    Args:
        graph: the captured program.
        layers_per_ipu: layers on each IPU, e.g. ``[3, 7, 7, 7]``.
        head_ipu: IPU of the ops after the last layer (default: the last IPU).

    Returns:
        Node name → ``(ipu, stage)``.

    Raises:
        Error: the list does not add up to the number of layers of the model.
    """
    nodes = [n for n in graph.module.graph.nodes if n.op == "call_function"]
    keys = [_layer_key(n) for n in nodes]
    by_prefix: Dict[str, List[str]] = {}
    for key in keys:
        if key:
            prefix = key.rsplit(".", 1)[0]
            if key not in by_prefix.setdefault(prefix, []):
                by_prefix[prefix].append(key)
    layers = max(by_prefix.values(), key=len) if by_prefix else []
    if sum(layers_per_ipu) != len(layers):
        raise backend_error(
            f"layers_per_ipu {list(layers_per_ipu)} places {sum(layers_per_ipu)} layers but "
            f"the model has {len(layers)}: make the entries add up to {len(layers)}.")
    ipu_of: Dict[str, int] = {}
    index = 0
    for ipu, count in enumerate(layers_per_ipu):
        for _ in range(count):
            ipu_of[layers[index]] = ipu
            index += 1
    last_ipu = len(layers_per_ipu) - 1
    head = last_ipu if head_ipu is None else head_ipu
    head_place = (head, last_ipu if head == last_ipu else last_ipu + 1)
    last_layer_node = max((i for i, key in enumerate(keys) if key in ipu_of), default=-1)
    placement: Dict[str, Tuple[int, int]] = {}
    current = 0
    for i, (node, key) in enumerate(zip(nodes, keys)):
        if key in ipu_of:
            current = ipu_of[key]
        placement[node.name] = head_place if i > last_layer_node >= 0 else (current, current)
    return placement


def _placement(node: fx.Node, override: Optional[Dict[str, Tuple[int, int]]]
               ) -> Tuple[int, int]:
    placed = node.meta.get("placement")
    if placed is not None:
        return int(getattr(placed, "ipu", 0)), int(getattr(placed, "stage", 0))
    if override is not None and node.name in override:
        return override[node.name]
    return 0, 0


def collect(graph: Graph, layers_per_ipu: Optional[Sequence[int]] = None,
            head_ipu: Optional[int] = None) -> ProgramCosts:
    """Cost every op and weight of ``graph`` (one micro-batch).

    Placement: ``node.meta["placement"]`` where present (contract A); otherwise, if
    ``layers_per_ipu`` is given, :func:`layer_placement`; otherwise IPU 0 / stage 0.

    Args:
        graph: the captured program.
        layers_per_ipu: optional layers-per-IPU list used when the graph carries no
            placement.
        head_ipu: IPU of the ops after the last layer (see :func:`layer_placement`).

    Returns:
        The :class:`ProgramCosts`.

    Raises:
        Error: ``layers_per_ipu`` that does not match the model.
    """
    nodes = list(graph.module.graph.nodes)
    placed = any("placement" in n.meta for n in nodes)
    override = layer_placement(graph, layers_per_ipu, head_ipu) \
        if layers_per_ipu and not placed else None
    ops: List[OpCost] = []
    # Steering ops apply to the op that produced their input.
    memory_of: Dict[fx.Node, float] = {}
    for node in nodes:
        if steering_op(node) == AVAILABLE_MEMORY_OP and node.args:
            source = node.args[0]
            if isinstance(source, fx.Node):
                memory_of[source] = float(node.args[1])
    ipus_of: Dict[fx.Node, set] = {}
    state_nodes = set(graph.placeholders[:len(graph.parameters) + len(graph.buffers)])
    for node in nodes:
        if node.op != "call_function":
            continue
        ipu, stage = _placement(node, override)
        for arg in node.all_input_nodes:
            ipus_of.setdefault(arg, set()).add(ipu)
        val = node.meta.get("val")
        steer = steering_op(node)
        view = _is_view(node) or steer == AVAILABLE_MEMORY_OP
        tensors = _tensors(val)
        elements = sum(t.numel() for t in tensors)
        # reductions (sums, losses) do one operation per element read
        read = max((t.numel() for a in node.all_input_nodes if a not in state_nodes
                    for t in _tensors(a.meta.get("val"))), default=0)
        flops = 0.0 if view else _flops(node)
        cost = OpCost(
            name=node.name, op=_op_name(node), ipu=ipu, stage=stage,
            layer=_layer_key(node),
            out_bytes=0 if view else _bytes(val),
            in_bytes=sum(_bytes(a.meta.get("val")) for a in node.all_input_nodes),
            weight_bytes=sum(_bytes(a.meta.get("val")) for a in node.all_input_nodes
                             if a in state_nodes),
            elements=elements, flops=flops,
            vector_ops=0.0 if view or flops else
            float(max(elements, read)) * (4.0 if _op_name(node) in _TRANSCENDENTAL else 1.0),
            half=any(t.dtype == torch.float16 for t in tensors), view=view,
            checkpoint=steer == CHECKPOINT_OP,
            available_memory=memory_of.get(node, node.meta.get("available_memory_proportion")),
            inputs=tuple(a.name for a in node.all_input_nodes))
        if steer == SERIALIZED_MATMUL_OP:
            mode = str(node.args[2]) if len(node.args) > 2 else "Disabled"
            factor = int(node.args[3]) if len(node.args) > 3 else 1
            cost.serialization = (mode, max(1, factor))
        ops.append(cost)
    weights = []
    state = set(graph.parameters) | set(graph.buffers)
    trainable = {p for p, t in zip(graph.parameters, graph.trainable) if t}
    names = graph.parameters + graph.buffers
    for node, name in zip(graph.placeholders, names):
        val = node.meta.get("val")
        if name not in state or not isinstance(val, torch.Tensor):
            continue
        weights.append(WeightCost(name, val.numel(), _bytes(val),
                                  tuple(sorted(ipus_of.get(node, {0}))),
                                  name in trainable, val.element_size()))
    user = graph.placeholders[len(graph.placeholders) - graph.num_user_inputs:]
    input_bytes = sum(_bytes(n.meta.get("val")) for n in user)
    output_bytes = sum(_bytes(n.meta.get("val")) for n in graph.output_nodes
                       if isinstance(n, fx.Node))
    stages = sorted({(op.stage, op.ipu) for op in ops}) or [(0, 0)]
    num_ipus = max([ipu for _, ipu in stages] + [i for w in weights for i in w.ipus]) + 1
    return ProgramCosts(ops, weights, input_bytes, output_bytes, num_ipus, stages)
