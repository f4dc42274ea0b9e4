"""What each operation of a captured program costs, read from shapes alone.

The IPU Model's memory and cycle estimates (:mod:`.memory_model`, :mod:`.cycle_model`)
start here. For every node of the graph this module records where it runs (the
``node.meta["placement"]`` written by the placement pass, or a layer → IPU mapping
computed from ``nn_module_stack``), the bytes it produces and reads (from the fake
tensors in ``node.meta["val"]``), its FLOPs (``torch.utils.flop_counter`` evaluated on
``meta`` tensors: no kernel runs at full size), and the IPU-compiler steering ops
around it (``recomputation_checkpoint``, ``set_available_memory``,
``serialized_matmul``, matched by op name; docs/api-sections.md api §8).
"""
from __future__ import annotations

import dataclasses
import operator
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from popart_compiler.errors import backend_error
from popart_compiler.ir import Graph, _aliased_base, _op_name
from popart_compiler.cost.matmul_shapes import Product, products

__all__ = ["OpCost", "WeightCost", "ProgramCosts", "collect", "steering_op",
           "layer_placement", "merge_stages", "with_serialization"]

#: Steering ops (docs/api-sections.md api §8) by op name; any namespace (``poptorch::<name>``).
CHECKPOINT_OP = "recomputation_checkpoint"
AVAILABLE_MEMORY_OP = "set_available_memory"
SERIALIZED_MATMUL_OP = "serialized_matmul"

#: Ops whose output aliases an input: no new memory, no compute.
_VIEW_TAG = "view"
#: Element-wise ops PopART runs in place when their input has no other reader and
#: their backward does not read that input (``mul`` / ``div`` only by a scalar).
_INPLACE = frozenset({"relu", "relu_", "add", "add_", "sub", "sub_", "dropout",
                      "mul", "mul_", "div", "div_", "neg", "hardtanh", "clamp"})
_SCALAR_ONLY = frozenset({"mul", "mul_", "div", "div_"})


#: Look-ups whose weight gradient PopART accumulates row by row (``SparseAccumulate``).
_LOOKUPS = frozenset({"embedding", "gather", "index_select", "take", "embedding_bag",
                      "_embedding_bag"})


def _weight_grad_bytes(node: fx.Node, found: Sequence[Product], trainable: set) -> int:
    """Bytes of the weight gradient ``node`` produces at once (``OpCost``)."""
    if _op_name(node) in _LOOKUPS or _is_view(node):
        return 0
    if found:
        size = 2 if found[0].problem.half else 4
        return max((p.problem.depth * p.problem.cols * size for p in found
                    if p.grad_cols and not p.problem.exchange_cols), default=0)
    return sum(_bytes(a.meta.get("val")) for a in node.all_input_nodes if a in trainable)


def _memory_owner(node: fx.Node) -> fx.Node:
    """The op whose buffer ``node``'s value lives in: views and in-place ops are
    followed back to the op that allocated it."""
    while True:
        base = _aliased_base(node)
        if base is node and not (node.op == "call_function" and _inplace(node)):
            return node
        node = base if base is not node else node.args[0]


def _inplace(node: fx.Node) -> bool:
    """Whether PopART's in-place transform overwrites ``node``'s first input."""
    name = _op_name(node)
    if name not in _INPLACE or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    source = node.args[0]
    if source.op != "call_function" or len(source.users) != 1 or _is_view(source):
        return False
    return not (name in _SCALAR_ONLY and len(node.args) > 1 and
                isinstance(node.args[1], fx.Node))


#: Vector operations per element of a transcendental op (exp, gelu, norms, ...).
TRANSCENDENTAL_OPS = 4.0
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
        checkpoint: its output is a ``recomputation_checkpoint``: kept for backward,
            never recomputed (the checkpoint op itself is an alias, ``view``).
        available_memory: ``set_available_memory`` proportion applied to it, if any.
        serialization: ``(mode, factor)`` of a ``serialized_matmul``, if any.
        inputs: names of the nodes it reads.
        products: its matrix products (:mod:`.matmul_shapes`); empty for other ops.
        requires_grad: its output depends on a trainable weight (it has a backward).
        saved: backward may read its output (it requires grad, or an op that
            requires grad reads it); other outputs are never stashed or recomputed.
        inplace: PopART computes it in place (its output overwrites its only input's
            buffer, :data:`_INPLACE`): it needs no memory of its own.
        weight_grad_bytes: the gradient of its trainable weights it produces at once
            (a serialised product: one slice; a look-up table: none, PopART adds the
            rows into the accumulator).
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
    products: Tuple[Product, ...] = ()
    requires_grad: bool = True
    saved: bool = True
    inplace: bool = False
    weight_grad_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        """Bytes of memory its output takes (0 for views and in-place ops)."""
        return 0 if self.inplace else self.out_bytes

    @property
    def signature(self) -> Tuple:
        """What makes two ops share code after outlining: op and output size."""
        return (self.op, self.out_bytes, self.in_bytes)


@dataclasses.dataclass
class WeightCost:
    """A parameter or buffer (tied names that hold one tensor are one weight).

    Attributes:
        name: its ``state_dict`` name (the first of tied names).
        elements / bytes: its size.
        ipus: the IPUs whose ops read it (a weight read on several IPUs lives on each
            of them, once).
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
        stages: forward pipeline stages in order, each ``(stage, ipu)``, after
            merging consecutive stages on one IPU (:func:`merge_stages`); ``op.stage``
            is the index into this list.
        user_inputs: bytes of each user input (placeholder name → bytes).
        weight_of: placeholder name of a parameter or buffer → the ``name`` of its
            :class:`WeightCost`.
    """
    ops: List[OpCost]
    weights: List[WeightCost]
    input_bytes: int
    output_bytes: int
    num_ipus: int
    stages: List[Tuple[int, int]]
    user_inputs: Dict[str, int] = dataclasses.field(default_factory=dict)
    weight_of: Dict[str, str] = dataclasses.field(default_factory=dict)


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
    try:
        with _FlopCount() as counter:
            target(*args, **kwargs)
    except Exception:  # an op without a meta kernel counts as vector work
        return 0.0
    return float(counter.flops)


class _FlopCount(TorchDispatchMode):
    """FLOPs of the ATen ops run inside, by ``torch.utils.flop_counter``'s formulas
    (ops without one are decomposed, as its ``FlopCounterMode`` does). Not
    ``FlopCounterMode`` itself: its module tracker installs process-wide ``nn.Module``
    hooks while counting, which put gradient hooks on the tensors of any model running
    meanwhile in another thread; that thread's ``torch.autograd.grad`` then failed ("A
    leaf node was passed to _will_engine_execute_node")."""

    _SKIP = (torch.ops.prim.device.default,)

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        formula = flop_registry.get(func._overloadpacket)
        if formula is None and func not in self._SKIP:
            with self:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        out = func(*args, **kwargs)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


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


def merge_stages(stages: Sequence[Tuple[int, int]]) -> Dict[Tuple[int, int], int]:
    """Pipeline stages as PopART runs them: consecutive stages (in stage order) on the
    same IPU are one stage (PopART's ``Pipeline::withStages``: a pipeline cycle runs
    each IPU's consecutive stages back to back, so they hold no stash between them).

    Args:
        stages: ``(stage, ipu)`` pairs of the placement (any order, repeats allowed).

    Returns:
        ``(stage, ipu)`` → index of the merged stage (0, 1, ... in pipeline order).

    Example: ``[(0, 0), (1, 0), (2, 1), (3, 0)]`` → indices ``0, 0, 1, 2``: BERT's
    embeddings and first layers on IPU 0, the layers of IPU 1, the heads on IPU 0.
    """
    merged: Dict[Tuple[int, int], int] = {}
    index, last_ipu = -1, None
    for stage, ipu in sorted(set(stages)):
        if ipu != last_ipu:
            index += 1
            last_ipu = ipu
        merged[(stage, ipu)] = index
    return merged


def _tied_groups(graph: Graph) -> Dict[str, str]:
    """State name → the first name holding the same tensor (tied weights share one
    tensor in the exported program's ``state_dict``)."""
    first: Dict[int, str] = {}
    canonical: Dict[str, str] = {}
    values = graph.program.state_dict
    for name in graph.parameters + graph.buffers:
        value = values.get(name)
        key = id(value) if value is not None else id(name)
        canonical[name] = first.setdefault(key, name)
    return canonical


def collect(graph: Graph, layers_per_ipu: Optional[Sequence[int]] = None,
            head_ipu: Optional[int] = None) -> ProgramCosts:
    """Cost every op and weight of ``graph`` (one micro-batch).

    Placement: ``node.meta["placement"]`` where present (contract A); otherwise, if
    ``layers_per_ipu`` is given, :func:`layer_placement`; otherwise IPU 0 / stage 0.
    Stages are merged as PopART merges them (:func:`merge_stages`).

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
    checkpointed = set()
    for node in nodes:
        steer = steering_op(node)
        if steer in (AVAILABLE_MEMORY_OP, CHECKPOINT_OP) and node.args and \
                isinstance(node.args[0], fx.Node):
            if steer == AVAILABLE_MEMORY_OP:
                memory_of[node.args[0]] = float(node.args[1])
            else:
                checkpointed.add(_memory_owner(node.args[0]))
    ipus_of: Dict[fx.Node, set] = {}
    num_state = len(graph.parameters) + len(graph.buffers)
    state_list = graph.placeholders[:num_state]
    state_nodes = set(state_list)
    trainable_nodes = [n for n, t in zip(graph.placeholders, graph.trainable) if t]
    user = graph.placeholders[len(graph.placeholders) - graph.num_user_inputs:]
    places: List[Tuple[int, int]] = []
    trainable_set = set(trainable_nodes)
    grad = set(trainable_nodes)  # nodes whose value depends on a trainable weight
    for node in nodes:
        if node.op != "call_function":
            continue
        if any(a in grad for a in node.all_input_nodes):
            grad.add(node)
        ipu, stage = _placement(node, override)
        places.append((stage, ipu))
        for arg in node.all_input_nodes:
            ipus_of.setdefault(arg, set()).add(ipu)
        val = node.meta.get("val")
        steer = steering_op(node)
        view = _is_view(node) or steer in (AVAILABLE_MEMORY_OP, CHECKPOINT_OP)
        tensors = _tensors(val)
        elements = sum(t.numel() for t in tensors)
        # reductions (sums, losses) do one operation per element read
        read = max((t.numel() for a in node.all_input_nodes if a not in state_nodes
                    for t in _tensors(a.meta.get("val"))), default=0)
        flops = 0.0 if view else _flops(node)
        half = any(t.dtype == torch.float16 for t in tensors)
        found = tuple(products(node, half, state_list, grad)) if flops and not view else ()
        cost = OpCost(
            name=node.name, op=_op_name(node), ipu=ipu, stage=stage,
            layer=_layer_key(node),
            out_bytes=0 if view else _bytes(val),
            in_bytes=sum(_bytes(a.meta.get("val")) for a in node.all_input_nodes),
            weight_bytes=sum(_bytes(a.meta.get("val")) for a in node.all_input_nodes
                             if a in state_nodes),
            elements=elements, flops=flops,
            vector_ops=0.0 if view or flops else
            float(max(elements, read)) *
            (TRANSCENDENTAL_OPS if _op_name(node) in _TRANSCENDENTAL else 1.0),
            half=half, view=view,
            checkpoint=node in checkpointed,
            available_memory=memory_of.get(node, node.meta.get("available_memory_proportion")),
            inputs=tuple(a.name for a in node.all_input_nodes),
            products=found,
            weight_grad_bytes=_weight_grad_bytes(node, found, trainable_set),
            requires_grad=node in grad,
            saved=node in grad or any(u in grad for u in node.users),
            inplace=not view and _inplace(node))
        if steer == SERIALIZED_MATMUL_OP:
            mode = str(node.args[2]) if len(node.args) > 2 else "Disabled"
            factor = int(node.args[3]) if len(node.args) > 3 else 1
            cost.serialization = (mode, max(1, factor))
        ops.append(cost)
    merged = merge_stages(places or [(0, 0)])
    for op in ops:
        op.stage = merged[(op.stage, op.ipu)]
    stages = sorted({(index, ipu) for (_, ipu), index in merged.items()})
    weights: Dict[str, WeightCost] = {}
    trainable = {p for p, t in zip(graph.parameters, graph.trainable) if t}
    canonical = _tied_groups(graph)
    weight_of: Dict[str, str] = {}
    for node, name in zip(state_list, graph.parameters + graph.buffers):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        readers = ipus_of.get(node, set())
        key = canonical[name]
        weight_of[node.name] = key
        if key in weights:  # a tied name: the same tensor, read by more IPUs
            w = weights[key]
            w.ipus = tuple(sorted(set(w.ipus) | readers))
            w.trainable = w.trainable or name in trainable
            continue
        weights[key] = WeightCost(name, val.numel(), _bytes(val), tuple(sorted(readers)),
                                  name in trainable, val.element_size())
    for w in weights.values():
        w.ipus = w.ipus or (0,)  # a weight no op reads stays on IPU 0
    sizes = {n.name: _bytes(n.meta.get("val")) for n in user}
    input_bytes = sum(sizes.values())
    output_bytes = sum(_bytes(n.meta.get("val")) for n in graph.output_nodes
                       if isinstance(n, fx.Node))
    num_ipus = max([ipu for _, ipu in stages] +
                   [i for w in weights.values() for i in w.ipus]) + 1
    return ProgramCosts(ops, list(weights.values()), input_bytes, output_bytes, num_ipus,
                        stages, sizes, weight_of)


def with_serialization(graph: Graph, costs: ProgramCosts, op: OpCost, factor: int
                       ) -> OpCost:
    """``op``, a ``serialized_matmul`` of ``graph``, costed as if its serialisation
    factor were ``factor`` (its products and weight gradient change; nothing else).

    Raises:
        Error: ``op`` is not a ``serialized_matmul`` of ``graph``.
    """
    node = next((n for n in graph.module.graph.nodes if n.name == op.name), None)
    if node is None or steering_op(node) != SERIALIZED_MATMUL_OP or len(node.args) < 4:
        raise backend_error(f"{op.name} is not a serialized_matmul of this graph")
    num_state = len(graph.parameters) + len(graph.buffers)
    state_list = graph.placeholders[:num_state]
    trainable = {n for n, t in zip(graph.placeholders, graph.trainable) if t}
    by_name = {o.name: o for o in costs.ops}
    grad = {a for a in node.all_input_nodes
            if a in trainable or (a.name in by_name and by_name[a.name].requires_grad)}
    original = node.args
    node.args = (*original[:3], int(factor), *original[4:])
    try:
        found = tuple(products(node, op.half, state_list, grad))
        gradient = _weight_grad_bytes(node, found, trainable)
    finally:
        node.args = original
    return dataclasses.replace(op, products=found, weight_grad_bytes=gradient,
                               serialization=(str(original[2]), max(1, int(factor))))
