"""Anchors (docs/semantics.md S-15) and tensor names (docs/semantics.md S-16).

:func:`resolve_anchors` sorts the requested anchors into state anchors (weights,
gradients, updated weights, optimizer state, loss scaling: read by the session after
each step) and activation anchors, whose graph values are appended to the graph's
outputs after the user outputs, in order. :func:`name_tensors` lists every tensor
name of the program (``PoplarExecutor.getTensorNames()``).
"""
from __future__ import annotations

import dataclasses
from typing import List

import torch.fx as fx

from popart_compiler.errors import backend_error
from popart_compiler.ir import Graph
from popart_compiler.passes.base import Compilation, PassResult, derived
from popart_compiler.session_options import Anchor

__all__ = ["resolve_anchors", "name_tensors", "STATE_PREFIXES", "LOSS_SCALING_NAMES"]

#: PopART name prefixes of per-parameter state: ``<prefix>___<parameter>``.
STATE_PREFIXES = ("Gradient", "UpdatedVar", "Accl", "Accl1", "Accl2", "Accum", "Step")
#: Tensors of automatic loss scaling (docs/semantics.md S-57).
LOSS_SCALING_NAMES = ("finalLossScale", "lossScaleUpdateFactor")


def resolve_anchors(graph: Graph, c: Compilation) -> PassResult:
    """Sort ``c.options.anchors`` into ``state_anchors`` and ``activation_anchors``
    (returned on the compilation); append the activations to the graph's outputs.

    Raises:
        Error: an anchor names no tensor of the program.
    """
    options, training = c.options, c.training
    activation_names = graph.activation_names()
    activation: List[Anchor] = []
    state: List[Anchor] = []
    weights = set(graph.parameters) | set(graph.buffers)
    trainable = {p for p, t in zip(graph.parameters, graph.trainable) if t}
    new_outputs: List[fx.Node] = []
    for anchor in options.anchors:
        name = anchor.name
        prefix, _, base = name.partition("___")
        if name in weights or (training and base in trainable and prefix in STATE_PREFIXES):
            state.append(anchor)
        elif training and options.auto_loss_scaling and name in LOSS_SCALING_NAMES:
            state.append(anchor)
        elif name in activation_names:
            activation.append(anchor)
            new_outputs.append(activation_names[name])
        else:
            raise backend_error(
                f"Anchored tensor {name} not found in the graph. Valid names are listed "
                "by PoplarExecutor.getTensorNames().")
    result = derived(graph, c, activation_anchors=activation, state_anchors=state)
    if not new_outputs:
        return result
    out = graph.output_node
    out.args = (tuple(out.args[0]) + tuple(new_outputs),)
    graph.module.recompile()
    return dataclasses.replace(result, changed=True)


def name_tensors(graph: Graph, c: Compilation) -> PassResult:
    """``tensor_names`` (returned on the compilation): parameters, buffers, loss
    scaling, gradients and updated weights of trainable parameters (training), then
    every activation (docs/semantics.md S-16)."""
    names = list(graph.parameters) + list(graph.buffers)
    if c.training and c.options.auto_loss_scaling:
        names += list(LOSS_SCALING_NAMES)
    if c.training:
        for p, trainable in zip(graph.parameters, graph.trainable):
            if trainable:
                names += [f"Gradient___{p}", f"UpdatedVar___{p}"]
    names += list(graph.activation_names())
    return derived(graph, c, tensor_names=names)
