"""``rewrite_args`` (passes/dtypes.py), the rewrite under ``demote_float64`` and
``retarget_device``: replace dtypes / devices in the arguments of every op of a module
and of its sub-graphs, in place."""
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from popart_compiler.passes.dtypes import rewrite_args


def test_nested_arguments_and_kwargs_are_rewritten():
    def fn(x):
        y = x.to(torch.float64)
        return torch.cat([y, torch.zeros(2, dtype=torch.float64)]), \
            torch.full((2,), 1.0, dtype=torch.float16)

    gm = make_fx(fn)(torch.ones(2))
    assert rewrite_args(gm, {torch.float64: torch.float32}) is True
    targets = {n.target: (n.args, n.kwargs) for n in gm.graph.nodes
               if n.op == "call_function"}
    assert targets[torch.ops.aten._to_copy.default][1]["dtype"] == torch.float32
    assert targets[torch.ops.aten.zeros.default][1]["dtype"] == torch.float32
    assert targets[torch.ops.aten.full.default][1]["dtype"] == torch.float16  # untouched
    a, b = gm(torch.ones(2))
    assert a.dtype == torch.float32 and b.dtype == torch.float16
    assert rewrite_args(gm, {torch.float64: torch.float32}) is False


def test_list_arguments_keep_their_type():
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten._to_copy.default, (x,),
                               {"dtype": torch.float64})
    stack = graph.call_function(torch.ops.aten.stack.default,
                                ([node, node],))
    graph.output(stack)
    gm = fx.GraphModule({}, graph)
    assert rewrite_args(gm, {torch.float64: torch.float16}) is True
    assert node.kwargs["dtype"] == torch.float16
    assert isinstance(stack.args[0], list) and stack.args[0] == [node, node]
    assert gm(torch.ones(1)).dtype == torch.float16


def test_sub_graphs_of_cond_are_rewritten():
    class Branches(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0,
                              lambda a: a.to(torch.float64).float() * 2,
                              lambda a: a - 1, (x,))

    program = torch.export.export(Branches(), (torch.ones(2),), strict=False)
    gm = program.graph_module
    subs = [m for name, m in gm.named_modules() if name]
    assert subs and any("torch.float64" in m.code for m in subs)
    assert rewrite_args(gm, {torch.float64: torch.float32}) is True
    assert not any("torch.float64" in m.code for m in gm.modules()
                   if isinstance(m, fx.GraphModule))
