"""The compiler's view of a captured program.

:class:`Graph` wraps a ``torch.export`` program (training IR: ATen ops, parameters,
buffers and constants lifted to placeholders, in-place mutations kept in place) whose
user inputs and outputs are flat tensors, and records what the compiler and runtime
need to know about it: the placeholder layout, which buffers / inputs / constants are
written in place, random ops, loss markers and the op names used for anchors.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Sequence

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

__all__ = ["Graph", "LOSS_OPS", "LOSS_ARITHMETIC_OPS", "IDENTITY_LOSS_OP",
           "register_per_micro_batch_op", "annotation_text", "uses_random_numbers"]

#: ATen ops that mark a loss (docs/semantics.md S-40), by overload packet name.
LOSS_OPS = frozenset({
    "l1_loss", "mse_loss", "cross_entropy_loss", "nll_loss", "nll_loss_nd",
    "nll_loss2d", "nll_loss_forward", "nll_loss2d_forward", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss",
    "hinge_embedding_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss",
    "cosine_embedding_loss", "margin_ranking_loss", "triplet_margin_loss",
    "multilabel_soft_margin_loss", "multilabel_margin_loss", "multi_margin_loss",
    "ctc_loss", "gaussian_nll_loss",
})
#: Ops after which a loss is still the loss (docs/semantics.md S-40): scalar arithmetic (``loss *
#: 0.5``, ``loss / n``, ``KLDivLoss(reduction="batchmean")``'s division by the batch size),
#: element-wise math (``torch.sqrt(mse)`` for RMSE, ``loss ** 2``), reductions of an unreduced loss,
#: views and casts. Back-propagation starts from the value the model returns, so the gradient
#: carries the factor.
LOSS_ARITHMETIC_OPS = frozenset({
    "mul", "div", "true_divide", "add", "sub", "rsub", "neg", "sum", "mean",
    "pow", "sqrt", "rsqrt", "log", "exp", "abs", "square",
    "view", "reshape", "_unsafe_view", "squeeze", "unsqueeze", "flatten", "clone",
    "contiguous", "alias", "_to_copy", "to", "type_as",
})
#: Qualified name of the ``poptorch.identity_loss`` custom op.
IDENTITY_LOSS_OP = "poptorch::identity_loss"

#: Qualified names of ops with a host side effect (printing, host callbacks): a graph
#: holding one runs micro-batch by micro-batch, so the effect happens once per
#: micro-batch and replica (docs/api-sections.md api §8.2, §8.13).
_PER_MICRO_BATCH_OPS: set = set()


def register_per_micro_batch_op(qualname: str) -> None:
    """Declare that the op ``qualname`` (``"namespace::name"``) must execute once per
    micro-batch and replica: graphs that contain it are never vectorised."""
    _PER_MICRO_BATCH_OPS.add(qualname)


def _op_name(node: fx.Node) -> str:
    """``aten::linear`` → ``linear``; ``poptorch::identity_loss`` → ``identity_loss``."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _qualified_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return ""


def _is_loss_node(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    # ``poptorch::ctc_loss`` and the like mirror an ATen loss as one opaque node.
    return (_qualified_name(node) == IDENTITY_LOSS_OP
            or (_qualified_name(node).startswith(("aten::", "poptorch::"))
                and _op_name(node) in LOSS_OPS))


def _aliased_base(node: fx.Node) -> fx.Node:
    """Follow view ops (outputs aliasing their first input) back to the base node."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        schema = node.target._schema
        if not schema.returns or schema.returns[0].alias_info is None:
            break
        first = node.args[0] if node.args else None
        if not isinstance(first, fx.Node):
            break
        node = first
    return node


#: Composite ops that update running statistics in place although their schema does
#: not say so: op name → (index of the ``training`` flag, indices of the mutated args).
_RUNNING_STATS_OPS = {
    "batch_norm": (5, (3, 4)),
    "instance_norm": (5, (3, 4)),
    "_batch_norm_impl_index": (5, (3, 4)),
}


def _written_nodes(graph: fx.Graph) -> List[fx.Node]:
    """Base nodes written in place by some op of ``graph`` (and its subgraphs)."""
    written = []
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        stats = _RUNNING_STATS_OPS.get(_op_name(node))
        if stats is not None and _qualified_name(node).startswith("aten::"):
            flag, indices = stats
            training = node.args[flag] if len(node.args) > flag else True
            if training is not False:
                written.extend(_aliased_base(node.args[i]) for i in indices
                               if i < len(node.args) and isinstance(node.args[i], fx.Node))
        schema = node.target._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                if isinstance(v, fx.Node):
                    written.append(_aliased_base(v))
    return written


def uses_random_numbers(module: fx.GraphModule) -> bool:
    """Whether some op of ``module`` (or of its sub-graphs) draws random numbers."""
    return any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in n.target.tags
        for gm in module.modules() if isinstance(gm, fx.GraphModule)
        for n in gm.graph.nodes)


#: Placeholder order of a :class:`Graph`: parameters, buffers, then the rest as captured.
_KIND_ORDER = {InputKind.PARAMETER: 0, InputKind.BUFFER: 1}


def _state_first(program: ExportedProgram) -> List[fx.Node]:
    """Put the parameter and buffer placeholders first, in that order (``torch.export``
    may lift a constant created in ``forward`` ahead of them); returns the placeholders.
    The signature's input specs are reordered with them."""
    graph = program.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    specs = program.graph_signature.input_specs
    pairs = sorted(zip(specs, placeholders), key=lambda p: _KIND_ORDER.get(p[0].kind, 2))
    if [node for _, node in pairs] != placeholders:
        first_op = next(n for n in graph.nodes if n.op != "placeholder")
        for _, node in pairs:
            first_op.prepend(node)
        specs[:] = [spec for spec, _ in pairs]
        program.graph_module.recompile()
    return [node for _, node in pairs]


@dataclasses.dataclass
class TensorInfo:
    """Shape and dtype of a graph value."""
    shape: torch.Size
    dtype: torch.dtype


class Graph:
    """A captured program prepared for the compiler.

    Args:
        program: a ``torch.export.ExportedProgram`` (training IR, the default of
            ``torch.export.export``) whose user inputs and user outputs are flat tensors.
        blocks: block id → ``Placement`` of the blocks the capture recorded
            (docs/api-sections.md api §9), in order of first use; empty without annotations.
        host_functions: Python callables the graph's host ops call (kept alive with
            the graph).
        input_names: the user's name of each user input (``x``, ``batch[0]``), for
            messages; default: the placeholder names.

    Attributes:
        program: the exported program.
        module: its ``fx.GraphModule``; called with the placeholders in order
            (parameters, buffers, constants, user inputs) it returns the user outputs.
        parameters / buffers / constants: state names (``state_dict`` keys or constant
            names) in placeholder order.
        trainable: for each parameter, whether it requires a gradient.
        user_inputs: shapes/dtypes of the user inputs (one micro-batch).
        user_input_names: the user's names of the user inputs.
        user_outputs: shapes/dtypes of the user outputs (one micro-batch).
        mutated_buffers / mutated_constants: names written in place by the graph.
        mutated_inputs: indices of user inputs written in place.
        random: whether the graph draws random numbers.
        loss_nodes: the loss-marker nodes (docs/semantics.md S-40).

    The analyses of the module (mutations, random ops, loss markers, user output nodes)
    are computed again by :meth:`refresh`, which the compiler calls after every pass
    that changed the graph. Outputs appended after the user outputs (anchors) never
    count as user outputs.
    """

    def __init__(self, program: ExportedProgram, blocks: Optional[Dict[str, object]] = None,
                 host_functions: Optional[Sequence[object]] = None,
                 input_names: Optional[Sequence[str]] = None):
        self.program = program
        self.module: fx.GraphModule = program.graph_module
        sig = program.graph_signature
        self.parameters: List[str] = []
        self.buffers: List[str] = []
        self.constants: List[str] = []
        self.persistent: Dict[str, bool] = {}
        user_nodes: List[fx.Node] = []
        kinds = []
        placeholders = _state_first(program)
        for spec, node in zip(sig.input_specs, placeholders):
            kinds.append(spec.kind)
            if spec.kind == InputKind.PARAMETER:
                self.parameters.append(spec.target)
            elif spec.kind == InputKind.BUFFER:
                self.buffers.append(spec.target)
                self.persistent[spec.target] = bool(spec.persistent)
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                self.constants.append(spec.target)
            elif spec.kind == InputKind.USER_INPUT:
                user_nodes.append(node)
            else:  # TOKEN
                raise ValueError(f"unsupported graph input kind {spec.kind}")
        order = [InputKind.PARAMETER] * len(self.parameters) + \
            [InputKind.BUFFER] * len(self.buffers)
        if kinds[:len(order)] != order or any(
                k not in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ, InputKind.USER_INPUT)
                for k in kinds[len(order):]):
            raise ValueError("unexpected placeholder order in the exported program")
        self.placeholders = placeholders
        for spec in sig.output_specs:
            if spec.kind != OutputKind.USER_OUTPUT:
                raise ValueError(f"the exported program must be in training IR, got an "
                                 f"output of kind {spec.kind}")
        state = program.state_dict
        self.trainable = [bool(state[p].requires_grad) for p in self.parameters]
        self.user_inputs = [self._info(n) for n in user_nodes]
        self._user_nodes = user_nodes
        self.user_input_names = list(input_names or [n.name for n in user_nodes])
        self._num_user_outputs = len(self.output_node.args[0])
        self._name_of = {node: spec.target
                         for spec, node in zip(sig.input_specs, placeholders)}
        self.blocks: Dict[str, object] = dict(blocks or {})
        self.host_functions = list(host_functions or [])
        self.refresh()

    def refresh(self) -> None:
        """Recompute what is derived from the module's ops: the user output nodes and
        their shapes, the buffers / constants / inputs written in place, whether random
        numbers are drawn and the loss markers."""
        self.output_nodes: List[Optional[fx.Node]] = \
            list(self.output_node.args[0])[:self._num_user_outputs]
        self.user_outputs = [self._info(n) if isinstance(n, fx.Node) else None
                             for n in self.output_nodes]
        written = set()
        for gm in self.module.modules():
            if isinstance(gm, fx.GraphModule):
                written.update(_written_nodes(gm.graph))
        name_of = self._name_of
        self.mutated_buffers = {name_of[n] for n in written
                                if n in name_of and name_of[n] in self.buffers}
        self.mutated_constants = {name_of[n] for n in written
                                  if n in name_of and name_of[n] in self.constants}
        self.mutated_inputs = {i for i, n in enumerate(self._user_nodes) if n in written}
        self.random = uses_random_numbers(self.module)
        self.loss_nodes = [n for n in self.module.graph.nodes if _is_loss_node(n)]

    @property
    def output_node(self) -> fx.Node:
        """The module's ``output`` node (user outputs, then anchors)."""
        return next(n for n in reversed(self.module.graph.nodes) if n.op == "output")

    @staticmethod
    def _info(node: fx.Node) -> Optional[TensorInfo]:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return TensorInfo(val.shape, val.dtype)
        return None

    # -- queries --------------------------------------------------------------------

    @property
    def num_user_inputs(self) -> int:
        return len(self.user_inputs)

    @property
    def num_user_outputs(self) -> int:
        return self._num_user_outputs

    @property
    def user_input_nodes(self) -> List[fx.Node]:
        """The placeholders of the user inputs, in order."""
        return list(self._user_nodes)

    def as_text(self) -> str:
        """The program as text: its inputs, then one line per op with its scoped name
        (docs/semantics.md S-16), placement and the compiler annotations
        (docs/api-sections.md api §8), then its outputs."""
        names = {node: name for name, node in self.activation_names().items()}
        lines = [f"graph({len(self.parameters)} parameters, {len(self.buffers)} buffers, "
                 f"{len(self.constants)} constants, {self.num_user_inputs} inputs):"]
        for node in self.module.graph.nodes:
            where = node.meta.get("placement")
            at = f"  @ ipu {where.ipu} stage {where.stage} phase {where.phase}" \
                if where is not None and node.op == "call_function" else ""
            label = f"{names[node]}: " if node in names else ""
            lines.append(f"  {label}{node.format_node()}{at}{annotation_text(node)}")
        return "\n".join(lines)

    def state_values(self) -> Dict[str, torch.Tensor]:
        """Capture-time values of parameters, buffers and constants, by name."""
        values = dict(self.program.state_dict)
        values.update(self.program.constants)
        return values

    def runs_per_micro_batch(self) -> bool:
        """Whether an op of the graph (or of its subgraphs) has a host side effect
        (:func:`register_per_micro_batch_op`)."""
        return any(n.op == "call_function" and _qualified_name(n) in _PER_MICRO_BATCH_OPS
                   for gm in self.module.modules() if isinstance(gm, fx.GraphModule)
                   for n in gm.graph.nodes)

    def has_device_work(self) -> bool:
        """False for trivial graphs that only pass inputs or constants through
        (docs/semantics.md S-6)."""
        return any(n.op == "call_function" for n in self.module.graph.nodes)

    def final_losses(self) -> List[fx.Node]:
        """Loss markers whose value does not feed another loss marker (docs/semantics.md S-40)."""
        markers = set(self.loss_nodes)
        finals = []
        for node in self.loss_nodes:
            seen, stack, feeds = set(), list(node.users), False
            while stack:
                user = stack.pop()
                if user in seen:
                    continue
                seen.add(user)
                if user in markers:
                    feeds = True
                    break
                stack.extend(user.users)
            if not feeds:
                finals.append(node)
        return finals

    def loss_outputs(self, loss: fx.Node) -> List[int]:
        """Indices of the user outputs that hold the final loss ``loss`` (docs/semantics.md S-40).

        That is ``loss`` itself if ``forward`` returns it; otherwise every returned
        value computed from ``loss`` through :data:`LOSS_ARITHMETIC_OPS` only (e.g.
        ``loss * 0.5``). Several outputs of the same value count once.
        """
        direct = [i for i, n in enumerate(self.output_nodes) if n is loss]
        if direct:
            return direct[:1]
        reached, frontier = {loss}, [loss]
        while frontier:
            for user in frontier.pop().users:
                if user not in reached and user.op == "call_function" \
                        and _op_name(user) in LOSS_ARITHMETIC_OPS:
                    reached.add(user)
                    frontier.append(user)
        first: Dict[fx.Node, int] = {}
        for i, node in enumerate(self.output_nodes):
            if node in reached:
                first.setdefault(node, i)
        return sorted(first.values())

    def activation_names(self) -> Dict[str, fx.Node]:
        """``<scope>/<OpType>:<index>`` name of every op (docs/semantics.md S-16).

        ``<scope>`` is the ``/``-joined sub-module path taken from the node's
        ``nn_module_stack`` with any ``poptorch.NameScope`` recorded in
        ``node.meta["custom"]["name_scopes"]`` inserted where it was entered);
        ``<OpType>`` is the ATen op name in
        CamelCase; ``<index>`` the output index.
        """
        names: Dict[str, fx.Node] = {}
        counts: Dict[str, int] = {}
        for node in self.module.graph.nodes:
            if node.op != "call_function" or node.target is __import__("operator").getitem:
                continue
            scope = _scope_of(node)
            op_type = "".join(p.capitalize() for p in _op_name(node).split("_") if p)
            base = f"{scope}/{op_type}" if scope else op_type
            index = counts.get(base, 0)
            counts[base] = index + 1
            name = f"{base}:{index}" if index else f"{base}:0"
            names[name] = node
        return names


_MODULE_PATH_RE = re.compile(r"^(?:L\['self'\]|L__self__)\.?")


def module_path_parts(path: str) -> List[str]:
    """``"L['self'].layers[0]"`` / ``"layers.0"`` → ``["layers", "0"]``."""
    path = _MODULE_PATH_RE.sub("", str(path))
    return [p for p in re.split(r"[.\[\]'\"]+", path) if p]


def _scope_of(node: fx.Node) -> str:
    """The ``/``-joined scope of ``node``: its sub-module path and its name scopes, in
    the order they were entered. ``node.meta["custom"]["name_scopes"]`` lists each name
    scope with the sub-module depth it was entered at (``[[name, depth], ...]``)."""
    parts: List[str] = []
    custom = node.meta.get("custom") or {}
    stack = node.meta.get("nn_module_stack") or {}
    if stack and not custom.get("no_module_scope", False):
        parts = module_path_parts(list(stack.values())[-1][0])
    scopes = custom.get("name_scopes") or []
    out: List[str] = []
    taken = 0
    for name, depth in scopes:
        depth = min(int(depth), len(parts))
        if depth > taken:
            out.extend(parts[taken:depth])
            taken = depth
        out.append(str(name))
    return "/".join(out + parts[taken:])


#: ``node.meta`` / ``node.meta["custom"]`` keys the IPU compiler reads
#: (docs/api-sections.md api §8).
_ANNOTATIONS = ("multi_conv", "attributes", "available_memory_proportion")


def annotation_text(node: fx.Node) -> str:
    """``"  # {...}"`` with the node's compiler annotations, or ``""`` without any."""
    custom = node.meta.get("custom") or {}
    found = {k: custom.get(k, node.meta.get(k)) for k in _ANNOTATIONS
             if custom.get(k, node.meta.get(k)) is not None}
    return f"  # {found}" if found else ""

