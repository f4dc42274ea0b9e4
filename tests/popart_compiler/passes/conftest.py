"""The pass tests' runner: one pass on a graph, as ``compile()`` runs it."""
import dataclasses

import pytest

from popart_compiler import compiler
from popart_compiler.passes.base import Compilation, Pass, PassResult
from popart_compiler.verify import verify


def _run(run, graph, c: Compilation) -> PassResult:
    """Run the pass function ``run`` on ``graph`` as :func:`popart_compiler.compiler.
    compile` does (``graph.refresh()`` after a change), then check the result with
    :func:`popart_compiler.verify.verify` and what the pass ensures (its entry in
    :data:`~popart_compiler.compiler.PASSES`). The result's ``compilation`` is the one
    the next pass would get (the given one where the pass derived nothing)."""
    p = next((q for q in compiler.PASSES if q.run is run), None) or Pass.of(run)
    result = p(graph, c)
    assert isinstance(result, PassResult)
    if result.changed:
        result.graph.refresh()
    after = result.after(c)
    verify(result.graph, after, after=p.name, ensures=p.ensures)
    return dataclasses.replace(result, compilation=after)


@pytest.fixture
def run_pass():
    """``run_pass(pass_function, graph, compilation) -> PassResult``: the pass, then the
    graph verifier on its output."""
    return _run
