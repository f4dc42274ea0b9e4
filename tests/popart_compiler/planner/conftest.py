"""A small planning problem: a 4-layer MLP (one unit per layer) costed as the planner
costs a program, without the planner's markers (a capture of ``nn.Linear`` layers)."""
import dataclasses

import pytest
import torch
import torch.nn as nn

from popart_compiler.cost.cost_model import cycle_settings, memory_settings
from popart_compiler.cost.ipu_model import target_for
from popart_compiler.cost.op_costs import collect
from popart_compiler.ir import Graph
from popart_compiler.planner.problem import Problem, Unit
from popart_compiler.planner.variants import Variants
from popart_compiler.session_options import SessionOptions

WIDTH, LAYERS, MICRO = 64, 4, 8


class Mlp(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def units_of(costs):
    """One unit per linear layer: from its matmul to the next one's."""
    starts = [i for i, op in enumerate(costs.ops) if op.flops]
    starts[0] = 0
    ends = starts[1:] + [len(costs.ops)]
    return [Unit(f"layers.{k}", True, lo, hi) for k, (lo, hi) in enumerate(zip(starts, ends))]


def make_problem(training: bool, proportions=(0.3, 0.6), small: bool = False,
                 width: int = WIDTH) -> Problem:
    """The MLP's problem on the GC200 IPU Model (``small``: the 4-tile one)."""
    torch.manual_seed(0)
    graph = Graph(torch.export.export(Mlp(width), (torch.randn(MICRO, width),),
                                      strict=False))
    costs = collect(graph)
    options = SessionOptions(gradient_accumulation=8 if training else 1, device_iterations=8)
    memory = dataclasses.replace(memory_settings(options, training), pipelined=True)
    cycles = cycle_settings(memory, options, training, None, MICRO)
    return Problem(Variants(costs, costs, ()), units_of(costs), costs,
                   target_for("ipu2", small=small),
                   memory, cycles, proportions=proportions)


@pytest.fixture(scope="module")
def inference_problem():
    return make_problem(False)


@pytest.fixture(scope="module")
def training_problem():
    return make_problem(True)


@pytest.fixture(scope="module")
def small_problem():
    """Inference of 4 MB layers on the 4-tile IPU Model (2.5 MB): no placement fits."""
    return make_problem(False, small=True, width=1024)
