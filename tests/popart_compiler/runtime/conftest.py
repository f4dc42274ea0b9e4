"""A program pipelined over 3 stages (IPUs 0, 1, 0) compiled by the compiler alone,
for the runtime's pipeline tests (nothing here imports ``poptorch``)."""
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
import torch.fx.traceback as fx_traceback

from popart_compiler import compiler
from popart_compiler.ir import Graph
from popart_compiler.passes.placement import BLOCK_KEY, Placement
from popart_compiler.session_options import SessionOptions

BLOCKS = {"a": Placement(0, 0), "b": Placement(1, 1), "c": Placement(0, 2)}


class Tagged(torch.nn.Module):
    """Linear + ReLU layers, layer ``i`` in block ``blocks[i]``. Its ``forward`` writes
    ``torch.fx.traceback.current_meta``, which only the capture restores: outside it,
    compute with :meth:`reference`."""

    def __init__(self, blocks):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in blocks)
        self.blocks = blocks

    def forward(self, x):
        for layer, block in zip(self.layers, self.blocks):
            fx_traceback.current_meta.setdefault("custom", {})[BLOCK_KEY] = block
            x = torch.relu(layer(x))
        return x

    def reference(self, x):
        """What ``forward`` computes, without the block tags."""
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def compile_tagged(blocks, **options):
    """``(model, executable)`` of :class:`Tagged` ``blocks`` (inference)."""
    torch.manual_seed(0)
    model = Tagged(blocks)
    with fx_traceback.preserve_node_meta():
        program = torch.export.export(model, (torch.randn(2, 4),), strict=False)
    graph = Graph(program, blocks=BLOCKS)
    options.setdefault("device_iterations", 3)
    return model, compiler.compile(graph, SessionOptions(**options), False)


@pytest.fixture(scope="module")
def pipelined():
    """The 3-stage model and its executable."""
    return compile_tagged(["a", "b", "c"])


@pytest.fixture
def compile_blocks():
    """``compile_blocks(blocks, **options) -> (model, executable)``."""
    return compile_tagged


@pytest.fixture(scope="session")
def four_processes():
    """What each of 4 processes of ``pipeline_worker.py`` (2 replicas × 2 stages)
    printed, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = pathlib.Path(__file__).with_name("pipeline_worker.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(worker), str(rank), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for rank in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results
