"""dynamic_slice / dynamic_update and runtime-offset slicing (docs/api-sections.md api §8.6, §8.7,
docs/semantics.md S-102); ctc_beam_search_decoder, fps and nearest
(docs/api-sections.md api §8.14–§8.16)."""
import copy
import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch


def quiet(opts=None):
    return (opts or poptorch.Options()).showCompilationProgressBar(False)


class Window(nn.Module):
    def forward(self, t, x):
        return t[x:x + 4]


def test_runtime_offset_slice_wraps_and_new_offsets_need_no_recompile():
    t = torch.arange(8.0)
    executor = poptorch.inferenceModel(Window(), quiet())
    # docs/semantics.md S-102 example
    assert executor(t, torch.tensor(6)).tolist() == [6.0, 7.0, 0.0, 1.0]
    exe = executor._state.executable
    assert executor(t, torch.tensor(1)).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert executor(t, torch.tensor(3)).tolist() == [3.0, 4.0, 5.0, 6.0]
    assert executor._state.executable is exe
    assert torch.equal(Window()(t, torch.tensor(6)), torch.tensor([6.0, 7.0]))  # CPU


def test_runtime_offset_slice_other_dims_steps_and_offsets():
    class Model(nn.Module):
        def forward(self, t, x):
            return t[:, x - 1:x + 3:2], t[1, x:x + 2]  # sizes 4 and 2: factors of 8
    t = torch.arange(24.0).reshape(3, 8)
    a, b = poptorch.inferenceModel(Model(), quiet())(t, torch.tensor(2))
    assert torch.equal(a, t[:, 1:5:2])
    assert torch.equal(b, t[1, 2:4])


def test_runtime_offset_slice_trains_and_vectorises():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6))

        def forward(self, x, t):
            window = self.w[x:x + 3]
            return F.mse_loss(window, t)
    model = Model()
    ref = copy.deepcopy(model)
    executor = poptorch.trainingModel(model, quiet(), torch.optim.SGD(model.parameters(),
                                                                      lr=0.5))
    target = torch.randn(3)
    executor(torch.tensor(2), target)
    loss = F.mse_loss(ref.w[2:5], target)
    loss.backward()
    with torch.no_grad():
        ref.w -= 0.5 * ref.w.grad
    executor.copyWeightsToHost()
    torch.testing.assert_close(model.w.detach(), ref.w.detach())

    inference = poptorch.inferenceModel(Window(), quiet(poptorch.Options().deviceIterations(3)))
    t = torch.arange(24.0)
    out = inference(t, torch.tensor([0, 5, 2]))
    # micro-batches t[0:8], t[8:16], t[16:24] with offsets 0, 5 (wraps) and 2
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0, 13.0, 14.0, 15.0, 8.0, 18.0, 19.0, 20.0,
                            21.0]
    assert inference._state.executable.vectorized is not None


def test_runtime_offset_slice_errors():
    class Unrelated(nn.Module):
        def forward(self, t, x, y):
            return t[x:y + 2]
    with pytest.raises(poptorch.Error, match="differ by a compile-time constant"):
        poptorch.inferenceModel(Unrelated(), quiet())(torch.arange(8.0), torch.tensor(1),
                                                      torch.tensor(1))

    class OneBound(nn.Module):
        def forward(self, t, x):
            return t[x:5]
    with pytest.raises(poptorch.Error):  # a data-dependent shape
        poptorch.inferenceModel(OneBound(), quiet())(torch.arange(8.0), torch.tensor(1))


class Dynamic(nn.Module):
    def forward(self, t, start, src):
        return (poptorch.dynamic_slice(t, 1, start, 4, 2),
                poptorch.dynamic_update(t, src, 1, start, 3))


def test_dynamic_slice_and_update_device_wrap_and_cpu_behaviour():
    t = torch.arange(16.0).reshape(2, 8)  # slice size 4: a factor of 8, as PopTorch needs
    src = -torch.ones(2, 3)
    executor = poptorch.inferenceModel(Dynamic(), quiet())
    sliced, updated = executor(t, torch.tensor(6), src)
    assert torch.equal(sliced, t[:, [6, 0]])  # window 6, 7, 0, 1; every second
    expected = t.clone()
    expected[:, [6, 7, 0]] = -1
    assert torch.equal(updated, expected)
    sliced, updated = executor(t, torch.tensor(1), src)
    assert torch.equal(sliced, t[:, 1:5:2])
    cpu_slice, cpu_update = Dynamic()(t, torch.tensor(1), src)
    assert torch.equal(cpu_slice, t[:, 1:5:2]) and torch.equal(cpu_update, updated)


def test_dynamic_update_trains():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 3))

        def forward(self, t, start, target):
            out = poptorch.dynamic_update(t, self.w * 2, 1, start, 3)
            return F.mse_loss(out, target)
    model = Model()
    ref = copy.deepcopy(model)
    executor = poptorch.trainingModel(model, quiet(), torch.optim.SGD(model.parameters(),
                                                                      lr=1.0))
    t, target = torch.randn(2, 5), torch.randn(2, 5)
    executor(t, torch.tensor(1), target)
    F.mse_loss(t.slice_scatter(ref.w * 2, 1, 1, 4), target).backward()
    executor.copyWeightsToHost()
    torch.testing.assert_close(model.w.detach(), (ref.w - ref.w.grad).detach())


@pytest.mark.parametrize("call,message", [
    (lambda t, s: poptorch.dynamic_slice([1], 0, s, 2, 1), "input must be a tensor"),
    (lambda t, s: poptorch.dynamic_slice(t, 0.0, s, 2, 1), "Dimension must be an integer."),
    (lambda t, s: poptorch.dynamic_slice(t, 0, 1, 2, 1), "start must be a tensor"),
    (lambda t, s: poptorch.dynamic_slice(t, 0, s, 2.0, 1), "size must be an integer"),
    (lambda t, s: poptorch.dynamic_slice(t, 0, s, 2, 1.0), "step must be an integer"),
    (lambda t, s: poptorch.dynamic_slice(t, 0, s, 0, 1), "start and end of a slice must "
                                                         "be different"),
    (lambda t, s: poptorch.dynamic_slice(t, 0, s, -1, 1), "Taking a slice of a tensor "
                                                          "with the end less than the start"),
    (lambda t, s: poptorch.dynamic_slice(t, 0, s, 2, 0), "Slicing step must be at least 1"),
    (lambda t, s: poptorch.dynamic_slice(t, 0, s.float(), 2, 1), "integer dtype"),
    (lambda t, s: poptorch.dynamic_update(t, t[None], 0, s, 2), "input and src tensors must "
                                                                "have same dimensionality"),
    (lambda t, s: poptorch.dynamic_update(t, t.int(), 0, s, 2), "same dtype"),
    (lambda t, s: poptorch.dynamic_update(t, 1.0, 0, s, 2), "src must be a tensor"),
    (lambda t, s: poptorch.dynamic_update(t, t, 0, s, 0), "start and end of a slice"),
])
def test_dynamic_slice_and_update_errors(call, message):
    with pytest.raises(poptorch.Error, match=message):
        call(torch.arange(6.0), torch.tensor(1))


# -- CTC beam search: independent references ------------------------------------------------

def exact_decode(log_probs, blank):
    """Every alignment enumerated, collapsed and summed: the exact label sequence
    probabilities (the beam search equals this when the beam never prunes)."""
    totals = {}
    steps, classes = log_probs.shape
    probs = log_probs.double().exp()
    for alignment in itertools.product(range(classes), repeat=steps):
        p = 1.0
        for s, c in enumerate(alignment):
            p *= float(probs[s, c])
        labels = tuple(c for k, c in enumerate(alignment)
                       if c != blank and (k == 0 or alignment[k - 1] != c))
        totals[labels] = totals.get(labels, 0.0) + p
    return sorted(totals.items(), key=lambda kv: -kv[1])


def probability_beam_search(log_probs, blank, width):
    """Prefix beam search in probability space (as in the CTC literature)."""
    beams = {(): (1.0, 0.0)}
    for frame in log_probs.double().exp().tolist():
        nxt = {}
        for prefix, (pb, pnb) in beams.items():
            for c, p in enumerate(frame):
                if c == blank:
                    b, nb = nxt.get(prefix, (0.0, 0.0))
                    nxt[prefix] = (b + (pb + pnb) * p, nb)
                    continue
                new = prefix + (c,)
                b, nb = nxt.get(new, (0.0, 0.0))
                extra = pb * p if prefix and prefix[-1] == c else (pb + pnb) * p
                nxt[new] = (b, nb + extra)
                if prefix and prefix[-1] == c:
                    b, nb = nxt.get(prefix, (0.0, 0.0))
                    nxt[prefix] = (b, nb + pnb * p)
        ranked = sorted(nxt.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:width]
        beams = dict(ranked)
    return [(k, v[0] + v[1]) for k, v in sorted(beams.items(), key=lambda kv: -sum(kv[1]))]


class Decoder(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, probs, lengths):
        return poptorch.ctc_beam_search_decoder(probs, lengths, **kwargs_of(self))


def kwargs_of(module):
    return module.kwargs


def check_against(reference, scores, sizes, paths, b, top):
    for k, (labels, p) in enumerate(reference[:top]):
        assert sizes[b, k] == len(labels)
        assert paths[b, k, :len(labels)].tolist() == list(labels)
        assert math.isclose(float(scores[b, k]), math.log(p), rel_tol=1e-4, abs_tol=1e-5)


def test_ctc_beam_search_equals_exhaustive_decoding():
    torch.manual_seed(3)
    steps, batch, classes = 5, 3, 3
    log_probs = torch.randn(steps, batch, classes).log_softmax(-1)
    lengths = torch.tensor([5, 3, 4])
    executor = poptorch.inferenceModel(Decoder(blank=0, beam_width=100, top_paths=3), quiet())
    scores, sizes, paths = executor(log_probs, lengths)
    assert scores.shape == (3, 3) and sizes.shape == (3, 3) and paths.shape == (3, 3, 5)
    for b in range(batch):
        check_against(exact_decode(log_probs[:lengths[b], b], 0), scores, sizes, paths, b, 3)


def test_ctc_beam_search_narrow_beam_other_blank_matches_reference():
    torch.manual_seed(4)
    steps, batch, classes = 8, 2, 5
    log_probs = torch.randn(steps, batch, classes).mul(2).log_softmax(-1)
    lengths = torch.tensor([8, 6])
    executor = poptorch.inferenceModel(Decoder(blank=2, beam_width=3, top_paths=2), quiet())
    scores, sizes, paths = executor(log_probs, lengths)
    for b in range(batch):
        reference = probability_beam_search(log_probs[:lengths[b], b], 2, 3)
        check_against(reference, scores, sizes, paths, b, 2)


def test_ctc_beam_search_cpu_placeholder_and_errors():
    scores, sizes, paths = Decoder(top_paths=2)(torch.randn(4, 3, 5), torch.tensor([4, 4, 4]))
    assert torch.equal(scores, torch.zeros(3, 2)) and torch.equal(paths, torch.zeros(
        3, 2, 4, dtype=torch.int32)) and sizes.dtype == torch.int32
    with pytest.raises(poptorch.Error, match="must be tensors"):
        poptorch.ctc_beam_search_decoder([1.0], torch.ones(1))
    with pytest.raises(poptorch.Error, match=r"must be \[T, B, C\]"):
        poptorch.ctc_beam_search_decoder(torch.ones(2, 3), torch.ones(1))


# -- fps / nearest -------------------------------------------------------------------------------

def reference_fps(src, ptr, ratio, starts):
    out = []
    for (lo, hi), start in zip(zip(ptr[:-1], ptr[1:]), starts):
        pts = src[lo:hi].tolist()
        k = math.ceil(ratio * (hi - lo))
        chosen = [start]
        while len(chosen) < k:
            best, best_d = None, -1.0
            for i, p in enumerate(pts):
                d = min(sum((a - b) ** 2 for a, b in zip(p, pts[j])) for j in chosen)
                if d > best_d:
                    best, best_d = i, d
            chosen.append(best)
        out.extend(lo + c for c in chosen)
    return out


def test_fps_device_and_cpu_equal_reference():
    class Model(nn.Module):
        def forward(self, src):
            return poptorch.fps(src, [0, 7, 12], 0.5)
    src = torch.randn(12, 3)
    expected = reference_fps(src, [0, 7, 12], 0.5, [0, 0])
    assert poptorch.inferenceModel(Model(), quiet())(src).tolist() == expected
    assert Model()(src).tolist() == expected

    class Random(nn.Module):
        def forward(self, src):
            return poptorch.fps(src, [0, 12], 0.25, random_start=True)
    picked = poptorch.inferenceModel(Random(), quiet())(src).tolist()
    assert picked == reference_fps(src, [0, 12], 0.25, [picked[0]])


@pytest.mark.parametrize("args,message", [
    (([1.0], [0, 1]), "src must be a tensor"), ((None, (0, 1)), "ptr must be a list"),
    ((None, [0]), "at least 2 elements"), ((None, [0, 2], 1), "ratio must be a float"),
    ((None, [0, 2], 0.5, 1), "random_start must be a bool"),
])
def test_fps_errors(args, message):
    args = (torch.randn(2, 2) if args[0] is None else args[0],) + args[1:]
    with pytest.raises(poptorch.Error, match=message):
        poptorch.fps(*args)


def test_nearest_with_batches_as_tensors_and_lists():
    class Model(nn.Module):
        def forward(self, x, y, bx, by):
            return poptorch.nearest(x, y, bx, by), poptorch.nearest(x, y, [0, 0, 1, 1],
                                                                     [0, 1, 1])
    x, y = torch.randn(4, 2), torch.randn(3, 2)
    bx, by = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 1])
    expected = []
    for i in range(4):
        candidates = [j for j in range(3) if by[j] == bx[i]]
        expected.append(min(candidates, key=lambda j: float(((x[i] - y[j]) ** 2).sum())))
    a, b = poptorch.inferenceModel(Model(), quiet())(x, y, bx, by)
    assert a.tolist() == expected and b.tolist() == expected
    assert poptorch.nearest(x, y).tolist() == torch.cdist(x, y).argmin(1).tolist()
    with pytest.raises(poptorch.Error, match="x and y must be tensors"):
        poptorch.nearest([1.0], y)
    with pytest.raises(poptorch.Error, match="batch ids must be a tensor or a list"):
        poptorch.nearest(x, y, "batch")


# -- bad arguments of dynamic slicing --------------------------------------------------

class DynamicOp(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, start):
        return self.fn(x, start)


@pytest.mark.parametrize("fn, message", [
    (lambda x, i: poptorch.dynamic_slice(x, 5, i, 2, 1),
     r"dim 5 is out of range for a tensor of shape \[8, 6\]: use a dimension in \[-2, 1\]"),
    (lambda x, i: poptorch.dynamic_update(x, torch.zeros(8, 3), 1, i, 2),
     r"src has shape \[8, 3\], but a window of size 2 along dim 1 .* has shape \[8, 2\]"),
])
def test_dynamic_slicing_bad_dim_or_src_shape_is_a_clear_error(fn, message):
    executor = poptorch.inferenceModel(DynamicOp(fn), quiet())
    with pytest.raises(poptorch.Error, match=message):
        executor(torch.randn(8, 6), torch.tensor([1]))


def test_dynamic_slice_negative_dim_wraps_like_positive():
    executor = poptorch.inferenceModel(
        DynamicOp(lambda x, i: poptorch.dynamic_slice(x, -1, i, 3, 1)), quiet())
    x = torch.arange(12.).reshape(2, 6)
    out = executor(x, torch.tensor([4]))
    assert torch.equal(out, x[:, [4, 5, 0]])
