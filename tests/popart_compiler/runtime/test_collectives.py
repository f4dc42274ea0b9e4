"""The cross-process reduction of weight updates (docs/semantics.md S-28, S-41, S-57) without
launching
processes: two "processes" are two threads whose ``StepSettings.all_reduce`` meets at a
barrier and sums their tensors, as ``collectives.ProcessGroup.all_reduce_sum`` does.
Nothing here imports ``poptorch``."""
import threading

import torch

from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.optim.device_optimizer import FLOAT16_MAX, DeviceOptimizer, StepSettings
from popart_compiler.runtime.device_state import DeviceRng


class _ThreadAllReduce:
    """Sums lists of tensors between ``n`` threads; counts the calls."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots = [None] * n
        self.calls = [0] * n

    def for_rank(self, rank):
        def all_reduce(tensors):
            self.calls[rank] += 1
            self.slots[rank] = [t.clone() for t in tensors]
            self.barrier.wait()
            out = [sum(parts) for parts in zip(*self.slots)]
            self.barrier.wait()
            return out
        return all_reduce


def _description(**hyper):
    return OptimizerDescription("SGD", defaults=dict(hyper), groups=[], group_of={})


def _train(desc_fn, settings, grads_of, steps, w0):
    """Run ``steps`` updates; ``grads_of(step, a, r)`` gives replica ``r``'s gradient
    (before loss scaling)."""
    w = w0.clone()
    opt = DeviceOptimizer(desc_fn(), ["w"], [w], settings)
    for step in range(steps):
        opt.begin_step()
        for a in range(settings.accumulation):
            for r in range(settings.replicas):
                opt.accumulate(r, a, [grads_of(step, a, r) * opt.loss_scale])
        opt.finish_step([w])
    return w, opt


def _two_processes(desc_fn, grads_of, steps, w0, **settings):
    """2 processes × R replicas; process ``p``'s replica ``r`` is global replica
    ``p × R + r``."""
    r = settings.pop("replicas")
    reduce = _ThreadAllReduce(2)
    results = [None, None]

    def run(rank):
        s = StepSettings(replicas=r, global_replicas=2 * r,
                         all_reduce=reduce.for_rank(rank), **settings)
        results[rank] = _train(desc_fn, s, lambda st, a, k: grads_of(st, a, rank * r + k),
                               steps, w0)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, reduce.calls


def _grads(step, a, r):
    return torch.tensor([1.0 + r, -2.0 * a, 0.5 * step + r * r])


def test_two_processes_update_like_one_process_with_all_replicas():
    """Separate and combined SGD variants, Mean and Sum: same weights as one process
    with 2R replicas; one all_reduce per weight update."""
    w0 = torch.tensor([0.5, -1.0, 2.0])
    for combined in (False, True):
        for mean in (True, False):
            def desc():
                d = _description(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01)
                d.use_combined_accum = combined
                return d
            ref, _ = _train(desc, StepSettings(accumulation=2, replicas=4, global_replicas=4,
                                               mean=mean), _grads, 3, w0)
            results, calls = _two_processes(desc, _grads, 3, w0, replicas=2,
                                            accumulation=2, mean=mean)
            for w, _ in results:
                torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-6)
            assert calls == [3, 3]


def test_automatic_loss_scaling_decides_on_all_processes_statistics():
    """Process 1's float16 gradients are near overflow, process 0's are small: both
    halve the factor, as one process with all the replicas does (without the
    reduction, process 0 would double it)."""
    def grads(step, a, r):
        big = 0.5 * FLOAT16_MAX / 1024 if r >= 2 else 1e-3
        return torch.full((4,), big, dtype=torch.float16)

    def desc():
        d = _description(lr=0.0)
        d.loss_scaling = 512.0
        return d

    w0 = torch.zeros(4, dtype=torch.float16)
    _, ref = _train(desc, StepSettings(replicas=4, global_replicas=4,
                                       auto_loss_scaling=True), grads, 1, w0)
    assert float(ref.state["lossScaleUpdateFactor"]) == 0.5
    results, _ = _two_processes(desc, grads, 1, w0, replicas=2, auto_loss_scaling=True)
    for _, opt in results:
        assert float(opt.state["lossScaleUpdateFactor"]) == 0.5


def test_each_process_has_its_own_random_stream():
    """Same seed: process 0 keeps the seed's stream; process 1 draws other numbers,
    reproducibly; the reported seed stays the user's."""
    def draw(stream):
        rng = DeviceRng(7, "cpu", stream=stream)
        with rng.active():
            values = torch.rand(4)
        return values, rng.to_list()[0]

    first, seed0 = draw(0)
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(7)))
    other, seed1 = draw(1)
    assert not torch.equal(first, other)
    assert torch.equal(other, draw(1)[0])
    assert seed0 == seed1 == 7
