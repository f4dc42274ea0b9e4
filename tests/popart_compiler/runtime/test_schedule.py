"""popart_compiler/runtime/schedule.py: the pipeline's execution order and a staged
program run micro-batch by micro-batch (compared with the unsplit model)."""
import torch

from popart_compiler.runtime.schedule import StagedProgram, stage_order


def test_pipelined_order_runs_micro_batch_t_minus_s_in_stage_s():
    assert stage_order(2, 3, pipelined=True) == [
        (0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (1, 2)]
    assert stage_order(2, 2, pipelined=False) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert stage_order(1, 2, pipelined=True) == [(0, 0), (0, 1)]


def test_a_staged_program_computes_what_the_model_computes(pipelined):
    model, exe = pipelined
    staged = StagedProgram(exe.stages)
    assert staged.num_stages == 3 and staged.pipelined
    state = [v.detach() for v in exe.graph.state_values().values()]
    xs = [torch.randn(2, 4) for _ in range(3)]
    done = []
    replicas = [[state + [x], state + [2 * x]] for x in xs]
    staged.run(replicas, lambda m, rep, outs: done.append((m, rep, outs)))
    # micro-batch m leaves the last stage at clock m + 2, replicas in lock-step
    assert [(m, rep) for m, rep, _ in done] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0),
                                                (2, 1)]
    for m, rep, outs in done:
        torch.testing.assert_close(outs[0], model.reference(xs[m] * (rep + 1)))
