"""``retarget_device`` (passes/dtypes.py): a program compiled for another torch device
than the CPU it was captured on gets that device in its op arguments."""
import torch
import torch.nn as nn

from models import export
from popart_compiler.passes.base import Compilation
from popart_compiler.passes.dtypes import retarget_device
from popart_compiler.session_options import SessionOptions


class Factory(nn.Module):
    def forward(self, x):
        return x + torch.ones(3, device="cpu") + torch.arange(3)


def devices(graph):
    return {n.name: n.kwargs["device"] for n in graph.module.graph.nodes
            if "device" in n.kwargs}


def test_cpu_session_leaves_the_graph_unchanged(run_pass):
    g = export(Factory(), torch.zeros(3))
    before = g.module.code
    result = run_pass(retarget_device, g, Compilation(SessionOptions(device="cpu"), False))
    assert result.graph is g and result.changed is False and g.module.code == before


def test_cuda_session_gets_cuda_in_every_device_argument(run_pass):
    """Only the pass, not a run: no CUDA device is needed."""
    g = export(Factory(), torch.zeros(3))
    cpu = torch.device("cpu")
    assert set(devices(g).values()) == {cpu} and len(devices(g)) >= 2
    result = run_pass(retarget_device, g, Compilation(SessionOptions(device="cuda"),
                                                      False))
    assert result.changed is True
    assert set(devices(g).values()) == {torch.device("cuda")}
    assert "device(type='cuda')" in g.module.code
    again = run_pass(retarget_device, g, Compilation(SessionOptions(device="cuda"), False))
    assert again.changed is False  # nothing left on the CPU
