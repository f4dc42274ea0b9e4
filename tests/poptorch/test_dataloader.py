"""poptorch.DataLoader in Sync mode (docs/api-sections.md api §7.1, docs/semantics.md S-11, S-13,
S-28)."""
import logging

import pytest
import torch
import torch.utils.data

import poptorch
from poptorch._data.dataloader import DataLoader
from poptorch.enums import CommGroupType, DataLoaderMode
from poptorch.options import Options

pytestmark = pytest.mark.timeout(600)  # hang guard only; slow machines are fine


class IndexDataset(torch.utils.data.Dataset):
    """Element i = (float row [i, i], int64 label i)."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return torch.full((2, ), float(index)), torch.tensor(index)


class RangeIterable(torch.utils.data.IterableDataset):
    def __init__(self, size):
        self.size = size

    def __iter__(self):
        return iter(torch.arange(self.size).unbind(0))


class GeneratorBatchSampler:
    """A batch sampler without __len__."""

    def __init__(self, num_batches, size):
        self.num_batches, self.size = num_batches, size

    def __iter__(self):
        for b in range(self.num_batches):
            yield list(range(b * self.size, (b + 1) * self.size))


@pytest.fixture
def warnings_log():
    """Messages logged by poptorch's Python logger during the test."""
    records = []

    class Handler(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Handler(level=logging.WARNING)
    poptorch_logger = logging.getLogger("poptorch::python")
    poptorch_logger.addHandler(handler)
    yield records
    poptorch_logger.removeHandler(handler)


def make_opts(D=1, R=1, A=1, g=None, n=1, pid=0, seed=None):
    opts = Options()
    opts.deviceIterations(D)
    opts.replicationFactor(R)
    if g is not None:
        opts.inputReplicaGrouping(g, CommGroupType.Consecutive)
    opts.Training.gradientAccumulation(A)
    if n > 1:
        opts.Distributed.configureProcessId(pid, n)
    if seed is not None:
        opts.randomSeed(seed)
    return opts


def labels(loader):
    return [b[1].tolist() for b in loader]


# --------------------------------------------------------------------- batch sizes
@pytest.mark.parametrize("B,D,R,g,A", [(1, 1, 1, None, 1), (2, 3, 1, None, 1),
                                       (1, 2, 2, None, 2), (3, 2, 4, 2, 1),
                                       (2, 4, 2, 1, 3), (1, 1, 4, 4, 1)])
def test_combined_batch_size_and_shapes(B, D, R, g, A):
    opts = make_opts(D=D, R=R, A=A, g=g)
    groups = R // (g or 1)
    combined = B * D * groups * A
    data = IndexDataset(5 * combined + combined // 2)
    loader = DataLoader(opts, data, batch_size=B)
    assert loader.combinedBatchSize == combined
    batches = list(loader)
    assert len(loader) == len(batches) == 5
    for k, (x, y) in enumerate(batches):
        assert x.shape == (combined, 2) and x.dtype == torch.float32
        assert y.shape == (combined, ) and y.dtype == torch.int64
        # docs/semantics.md S-13: rows are laid out contiguously, iteration-major.
        assert y.tolist() == list(range(k * combined, (k + 1) * combined))


def test_s11_example_numbers():
    opts = make_opts(D=4, R=2, A=3)
    assert DataLoader(opts, IndexDataset(48), batch_size=2).combinedBatchSize == 48


def test_options_checked_and_frozen():
    with pytest.raises(AssertionError):
        DataLoader(object(), IndexDataset(4))
    opts = make_opts(D=2)
    loader = DataLoader(opts, IndexDataset(4))
    assert loader.options is opts
    with pytest.raises(AttributeError, match="frozen"):
        opts.deviceIterations(4)


def test_batch_size_none_quirks():
    opts = make_opts()
    loader = DataLoader(opts, IndexDataset(3), batch_size=None)
    assert loader.combinedBatchSize is None
    with pytest.raises(AttributeError):
        loader.options  # pylint: disable=pointless-statement
    # No automatic batching: the elements come back one by one.
    assert [y.item() for _, y in loader] == [0, 1, 2]


def test_drop_last_true_drops_the_remainder(warnings_log):
    loader = DataLoader(make_opts(D=2), IndexDataset(11), batch_size=2)
    assert labels(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(loader) == 2
    assert not warnings_log


def test_drop_last_false_keeps_final_short_batch_with_warning(warnings_log):
    loader = DataLoader(make_opts(D=2), IndexDataset(11), batch_size=2, drop_last=False)
    assert labels(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert len(warnings_log) == 1
    assert "not divisible" in warnings_log[0] and "batch size of 3" in warnings_log[0]


def test_drop_last_false_divisible_no_warning(warnings_log):
    DataLoader(make_opts(D=2), IndexDataset(12), batch_size=2, drop_last=False)
    assert not warnings_log


def test_persistent_workers_default():
    opts = make_opts()
    assert DataLoader(opts, IndexDataset(4)).persistent_workers is False
    loader = DataLoader(opts, IndexDataset(8), batch_size=2, num_workers=1)
    assert loader.persistent_workers is True
    assert labels(loader) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert labels(loader) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_kwargs_collate_fn_and_dict_structure():
    def collate(samples):
        return {"x": torch.stack([s[0] for s in samples]),
                "y": torch.stack([s[1] for s in samples])}

    loader = DataLoader(make_opts(D=2), IndexDataset(4), collate_fn=collate)
    out = list(loader)
    assert [sorted(b.keys()) for b in out] == [["x", "y"], ["x", "y"]]
    assert out[1]["y"].tolist() == [2, 3]


def test_terminate_is_a_no_op_in_sync_mode():
    loader = DataLoader(make_opts(), IndexDataset(2))
    loader.terminate()
    assert labels(loader) == [[0], [1]]


def test_rebatched_worker_size_checked():
    with pytest.raises(AssertionError, match="rebatched_worker_size"):
        DataLoader(make_opts(D=2), IndexDataset(8), batch_size=2,
                   mode=DataLoaderMode.AsyncRebatched, rebatched_worker_size=5)


def test_async_options_must_not_contain_rebatched_size():
    with pytest.raises(AssertionError, match="rebatched_size"):
        DataLoader(make_opts(), IndexDataset(8), mode=DataLoaderMode.Async,
                   async_options={"rebatched_size": 2})


# --------------------------------------------------------------------- batch sampler
def test_batch_sampler_exclusive_with_batch_size_and_shuffle():
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(8)), 2,
                                            False)
    with pytest.raises(poptorch.Error, match="mutually exclusive with batch_size, shuffle"):
        DataLoader(make_opts(), IndexDataset(8), batch_size=2, batch_sampler=sampler)
    with pytest.raises(poptorch.Error, match="mutually exclusive with batch_size, shuffle"):
        DataLoader(make_opts(), IndexDataset(8), shuffle=True, batch_sampler=sampler)


def test_batch_sampler_exclusive_with_distributed_partitioning():
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(8)), 2,
                                            False)
    with pytest.raises(poptorch.Error, match="auto_distributed_partitioning"):
        DataLoader(make_opts(n=2), IndexDataset(8), batch_sampler=sampler)
    loader = DataLoader(make_opts(n=2), IndexDataset(8), batch_sampler=sampler,
                        auto_distributed_partitioning=False)
    assert labels(loader) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("drop_last", [True, False])
def test_batch_sampler_recombination(drop_last, warnings_log):
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(14)), 2,
                                            False)
    loader = DataLoader(make_opts(D=3), IndexDataset(14), batch_sampler=sampler,
                        drop_last=drop_last)
    assert loader.combinedBatchSize == 6  # the sampler's batch_size is the micro-batch
    expected = [list(range(0, 6)), list(range(6, 12))]
    if not drop_last:
        expected.append([12, 13])
        assert any("final, smaller batch will combine 1 batch" in w for w in warnings_log)
    else:
        assert not warnings_log
    assert labels(loader) == expected
    assert len(loader) == len(sampler)  # torch's length, as in PopTorch


def test_batch_sampler_without_len_warns(warnings_log):
    loader = DataLoader(make_opts(D=2), IndexDataset(8),
                        batch_sampler=GeneratorBatchSampler(4, 2), drop_last=False)
    assert any("no __len__" in w for w in warnings_log)
    # No batch_size attribute: the micro-batch size stays 1 (combined = 2 rows)...
    assert loader.combinedBatchSize == 2
    # ...but two sampler batches are still concatenated per element.
    assert labels(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_batch_sampler_single_batch_per_step_passthrough():
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(5)), 2,
                                            False)
    loader = DataLoader(make_opts(), IndexDataset(5), batch_sampler=sampler)
    assert labels(loader) == [[0, 1], [2, 3], [4]]


# --------------------------------------------------------------------- distributed
def test_distributed_partition_drop_last_s28_scaled_down():
    # docs/semantics.md S-28 example scaled down by 100: 1000 samples, B=2, D=4, A=2, R=2, n=2.
    loaders = [DataLoader(make_opts(D=4, R=2, A=2, n=2, pid=pid), IndexDataset(1000),
                          batch_size=2) for pid in range(2)]
    assert loaders[0].combinedBatchSize == 32
    for pid, loader in enumerate(loaders):
        assert len(loader.dataset) == 32 * 15 == 480
        assert len(loader) == 15
        flat = [i for b in labels(loader) for i in b]
        assert flat == list(range(pid * 480, (pid + 1) * 480))


def test_distributed_partition_no_drop_last_is_even():
    sizes, starts = [], []
    for pid in range(3):
        loader = DataLoader(make_opts(n=3, pid=pid), IndexDataset(100), batch_size=1,
                            drop_last=False)
        flat = [i for b in labels(loader) for i in b]
        sizes.append(len(flat))
        starts.append(flat[0])
    assert sizes == [34, 33, 33]
    assert starts == [0, 34, 67]


def test_distributed_shuffle_requires_seed_and_batch_size():
    with pytest.raises(AssertionError, match="randomSeed"):
        DataLoader(make_opts(n=2), IndexDataset(10), shuffle=True)
    with pytest.raises(AssertionError, match="batch_size=None"):
        DataLoader(make_opts(n=2), IndexDataset(10), batch_size=None, drop_last=False)


def test_distributed_shuffle_is_global_identical_and_reshuffled_each_epoch():
    size = 70  # combined 4 x 2 processes -> 64 used, 6 leftovers
    loaders = [DataLoader(make_opts(D=2, n=2, pid=pid, seed=11), IndexDataset(size),
                          batch_size=2, shuffle=True) for pid in range(2)]
    epochs = []
    for _ in range(3):
        per_proc = [[i for b in labels(loader) for i in b] for loader in loaders]
        assert [len(p) for p in per_proc] == [32, 32]
        assert not set(per_proc[0]) & set(per_proc[1])  # disjoint slices
        epochs.append(per_proc)
    assert epochs[0] != epochs[1] != epochs[2]
    # Same seed in another "run": identical sequence of epochs.
    again = DataLoader(make_opts(D=2, n=2, pid=1, seed=11), IndexDataset(size), batch_size=2,
                       shuffle=True)
    for e in range(3):
        assert [i for b in labels(again) for i in b] == epochs[e][1]
    # The slice of the global permutation shifts by the leftovers on odd epochs.
    perm0 = torch.randperm(size, generator=torch.Generator().manual_seed(11)).tolist()
    perm1 = torch.randperm(size, generator=torch.Generator().manual_seed(12)).tolist()
    assert epochs[0][0] == perm0[:32] and epochs[0][1] == perm0[32:64]
    assert epochs[1][0] == perm1[6:38] and epochs[1][1] == perm1[38:70]


def test_iterable_dataset_rejects_auto_distributed_partitioning():
    with pytest.raises(AssertionError, match="not supported for IterableDataset"):
        DataLoader(make_opts(n=2), RangeIterable(8))
    loader = DataLoader(make_opts(n=2), RangeIterable(4), auto_distributed_partitioning=False)
    assert [b.tolist() for b in loader] == [[0], [1], [2], [3]]


# --------------------------------------------------------------------- shuffle
def test_shuffle_reproducible_for_a_seed():
    def epochs(seed, n=3):
        loader = DataLoader(make_opts(D=2, seed=seed), IndexDataset(40), batch_size=2,
                            shuffle=True)
        return [labels(loader) for _ in range(n)]

    first = epochs(5)
    assert first == epochs(5)
    assert first[0] != first[1]
    assert first != epochs(6)
    flat = sorted(i for b in first[0] for i in b)
    assert flat == list(range(40))


def test_shuffle_without_seed_follows_torch_manual_seed():
    opts = make_opts()
    torch.manual_seed(3)
    a = labels(DataLoader(opts, IndexDataset(20), batch_size=4, shuffle=True))
    torch.manual_seed(3)
    b = labels(DataLoader(opts, IndexDataset(20), batch_size=4, shuffle=True))
    assert a == b
    assert a != [list(range(i, i + 4)) for i in range(0, 20, 4)]


# --------------------------------------------------------------------- iterable
def test_iterable_dataset_combined_batches():
    loader = DataLoader(make_opts(D=2, R=2), RangeIterable(19), batch_size=2)
    assert loader.combinedBatchSize == 8
    out = [b.tolist() for b in loader]
    assert out == [list(range(0, 8)), list(range(8, 16))]
    loader = DataLoader(make_opts(D=2, R=2), RangeIterable(19), batch_size=2,
                        drop_last=False)
    assert [b.tolist() for b in loader][-1] == [16, 17, 18]


def test_iterable_dataset_multiple_workers_warning(warnings_log):
    DataLoader(make_opts(), RangeIterable(8), num_workers=2)
    assert any("2 times" in w for w in warnings_log)
    warnings_log.clear()
    DataLoader(make_opts(), RangeIterable(8), num_workers=2, worker_init_fn=lambda _: None)
    assert not warnings_log


def test_worker_init_fn_is_passed_to_torch():
    loader = DataLoader(make_opts(), IndexDataset(4), num_workers=1,
                        worker_init_fn=lambda worker_id: None)
    assert loader.worker_init_fn is not None
    assert labels(loader) == [[0], [1], [2], [3]]


# --------------------------------------------------------------------- progress bar
def test_progress_bar_off_by_default_and_optional(capsys):
    list(DataLoader(make_opts(), IndexDataset(3)))
    assert "it/s" not in capsys.readouterr().err
    loader = DataLoader(make_opts(), IndexDataset(3), progress_bar={"desc": "train"})
    assert len(list(loader)) == 3
    err = capsys.readouterr().err
    assert "train" in err and "3/3" in err


def test_progress_bar_true_draws_a_bar_per_epoch(capsys):
    """``progress_bar=True`` (no tqdm arguments) once produced no bar at all."""
    loader = DataLoader(make_opts(), IndexDataset(3), progress_bar=True)
    for epoch in (1, 2):
        assert len(list(loader)) == 3
        err = capsys.readouterr().err
        assert f"Epoch {epoch}" in err and "3/3" in err
