"""poptorch.AsynchronousDataAccessor and DataLoader Async modes (docs/api-sections.md api §7.1,
§7.2)."""
import gc
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import pytest
import torch
import torch.utils.data

import poptorch
from poptorch._data.dataloader import AsynchronousDataAccessor, DataLoader
from poptorch._capture.custom_parsers import ICustomArgParser, registerCustomArgParser
from poptorch.enums import DataLoaderMode, SharingStrategy
from poptorch.options import Options

pytestmark = pytest.mark.timeout(600)  # hang guard only; slow machines are fine

# Workers started with the spawn / forkserver strategies unpickle the datasets defined
# here by module name, but pytest runs with --import-mode=importlib (sys.path untouched,
# module named "tests.poptorch...."). Make this file importable as a top-level module;
# the classes are re-labelled at the end of the file.
_ALIAS = "test_async_dataloader"
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)
sys.modules.setdefault(_ALIAS, sys.modules[__name__])

FORK = {"sharing_strategy": SharingStrategy.Fork}


# ----------------------------------------------------------------------- datasets
class IndexDataset(torch.utils.data.Dataset):
    """Element i = (float row [i, i, i], int64 label i); optional per-item sleep."""

    def __init__(self, size, delay=0.0):
        self.size, self.delay = size, delay

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        if self.delay:
            time.sleep(self.delay)
        return torch.full((3, ), float(index)), torch.tensor(index)


class CountingDataset(IndexDataset):
    """Counts the items fetched (in shared memory, visible from the test)."""

    def __init__(self, size):
        super().__init__(size)
        self.count = torch.zeros(1, dtype=torch.int64).share_memory_()

    def __getitem__(self, index):
        self.count += 1
        return super().__getitem__(index)


class FailingDataset(IndexDataset):
    def __getitem__(self, index):
        if index == 5:
            raise ValueError(f"boom at index {index}")
        return super().__getitem__(index)


class NestedDataset(IndexDataset):
    def __getitem__(self, index):
        return (torch.tensor(index), (torch.tensor(index), ))


class VaryingShapeDataset(IndexDataset):
    def __getitem__(self, index):
        return torch.zeros(index + 1)


class BrokenUnpickle(IndexDataset):
    def __reduce__(self):
        return (_raise_on_load, ("cannot rebuild this dataset", ))


def _raise_on_load(message):
    raise RuntimeError(message)


class Unpicklable(IndexDataset):
    def __init__(self, size):
        super().__init__(size)
        self.fn = lambda: None


class RangeIterable(torch.utils.data.IterableDataset):
    def __init__(self, size):
        self.size = size

    def __iter__(self):
        return iter(torch.arange(self.size).unbind(0))


class EmptyIterable(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([])


class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b


class PairParser(ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.a
        yield struct.b

    def reconstruct(self, original_structure, tensor_iterator):
        return Pair(next(tensor_iterator), next(tensor_iterator))


class PairDataset(IndexDataset):
    def __getitem__(self, index):
        return Pair(torch.tensor([index]), torch.tensor([index * 10]))


for _obj in list(globals().values()):
    if getattr(_obj, "__module__", None) == __name__ and callable(_obj):
        _obj.__module__ = _ALIAS


# ----------------------------------------------------------------------- helpers
def opts(D=1, R=1, A=1, seed=None):
    o = Options()
    o.deviceIterations(D)
    o.replicationFactor(R)
    o.Training.gradientAccumulation(A)
    if seed is not None:
        o.randomSeed(seed)
    return o


def cloned(loader):
    out = []
    for element in loader:
        if isinstance(element, torch.Tensor):
            out.append(element.clone())
        elif isinstance(element, dict):
            out.append({k: v.clone() for k, v in element.items()})
        else:
            out.append([t.clone() for t in element])
    return out


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        elif isinstance(x, dict):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        else:
            assert len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y))


def shm_entries():
    """Entries of /dev/shm that this test process or its workers may have left: torch
    names them ``torch_<creator pid>_...``. Entries of other processes (other test
    runs on a shared machine create and remove their own at any time) are left out:
    a creator that is alive and not this process or its child."""
    def ours(name):
        match = re.match(r"torch_(\d+)_", name)
        if match is None:
            return False
        pid = int(match.group(1))
        if pid == os.getpid():
            return True
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                return int(f.read().rpartition(")")[2].split()[1]) == os.getpid()
        except OSError:  # the creator has gone: a leak if it was ours
            return True
    return {name for name in os.listdir("/dev/shm") if ours(name)}


def mapped_shm_files():
    """/dev/shm files (not yet unlinked) mapped by this process."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        return {line.split()[-1] for line in f
                if "/dev/shm/" in line and "(deleted)" not in line}


def async_workers():
    return [p for p in multiprocessing.active_children()
            if p.name == "PopTorchAsyncDataWorker"]


@pytest.fixture(autouse=True)
def no_leftover_workers():
    """Every test must leave no worker process behind."""
    yield
    gc.collect()
    assert not async_workers()


# ----------------------------------------------------------------------- values
@pytest.mark.parametrize("mode", [DataLoaderMode.Async, DataLoaderMode.AsyncRebatched])
@pytest.mark.parametrize("drop_last", [True, False])
def test_values_equal_sync(mode, drop_last):
    data = IndexDataset(29)
    sync = cloned(DataLoader(opts(D=2, R=2), data, batch_size=2, drop_last=drop_last))
    loader = DataLoader(opts(D=2, R=2), data, batch_size=2, drop_last=drop_last, mode=mode,
                        async_options=FORK, rebatched_worker_size=3)
    assert len(loader) == len(sync) == (3 if drop_last else 4)
    for _ in range(2):  # two epochs
        assert_same(cloned(loader), sync)
    loader.terminate()


def test_values_equal_sync_with_shuffle_and_workers():
    data = IndexDataset(40)
    # torch draws the workers' base seed from the same generator: compare like with like.
    sync_loader = DataLoader(opts(D=2, seed=7), data, batch_size=2, shuffle=True,
                             num_workers=2)
    sync = [cloned(sync_loader) for _ in range(2)]
    del sync_loader
    loader = DataLoader(opts(D=2, seed=7), data, batch_size=2, shuffle=True, num_workers=2,
                        mode=DataLoaderMode.Async, async_options=FORK)
    assert_same(cloned(loader), sync[0])
    assert_same(cloned(loader), sync[1])
    loader.terminate()


def test_iterable_dataset_async():
    loader = DataLoader(opts(D=2, R=2), RangeIterable(19), batch_size=2,
                        mode=DataLoaderMode.Async, async_options=FORK)
    assert [b.tolist() for b in loader] == [list(range(0, 8)), list(range(8, 16))]
    loader.terminate()
    loader = DataLoader(opts(D=2, R=2), RangeIterable(19), batch_size=2, drop_last=False,
                        mode=DataLoaderMode.Async, async_options=FORK)
    assert [b.tolist() for b in loader][-1] == [16, 17, 18]
    loader.terminate()


@pytest.mark.parametrize("strategy", list(SharingStrategy))
def test_each_sharing_strategy(strategy):
    # Shuffled with a seed: the sampler's generator must reach the worker intact.
    data = IndexDataset(20)
    sync = cloned(DataLoader(opts(D=2, seed=3), data, batch_size=2, shuffle=True))
    loader = DataLoader(opts(D=2, seed=3), data, batch_size=2, shuffle=True,
                        mode=DataLoaderMode.Async,
                        async_options={"sharing_strategy": strategy})
    assert_same(cloned(loader), sync)
    temp_file = loader._accessor._temp_file  # pylint: disable=protected-access
    loader.terminate()
    if strategy == SharingStrategy.FileSystem:
        assert temp_file is not None and not os.path.exists(temp_file)


def test_default_sharing_strategy_is_forkserver():
    accessor = AsynchronousDataAccessor(IndexDataset(3))
    try:
        # pylint: disable=protected-access
        assert accessor._sharing_strategy == SharingStrategy.ForkServer
        assert [y.item() for _, y in accessor] == [0, 1, 2]
    finally:
        accessor.terminate()


def test_element_structures():
    tensor_loader = torch.utils.data.DataLoader(torch.arange(6), batch_size=2)
    acc = AsynchronousDataAccessor(tensor_loader, **FORK)
    assert [t.tolist() for t in acc] == [[0, 1], [2, 3], [4, 5]]
    acc.terminate()

    tuple_acc = AsynchronousDataAccessor(IndexDataset(2), **FORK)
    first = next(iter(tuple_acc))
    assert isinstance(first, list) and len(first) == 2  # tuples come back as lists
    tuple_acc.terminate()

    def to_dict(samples):
        return {"x": torch.stack([s[0] for s in samples]),
                "y": torch.stack([s[1] for s in samples])}

    dict_loader = DataLoader(opts(D=2), IndexDataset(4), collate_fn=to_dict,
                             mode=DataLoaderMode.Async, async_options=FORK)
    out = cloned(dict_loader)
    assert [d["y"].tolist() for d in out] == [[0, 1], [2, 3]]
    dict_loader.terminate()

    registerCustomArgParser(Pair, PairParser())
    try:
        pair_acc = AsynchronousDataAccessor(PairDataset(3), **FORK)
        pairs = [(p.a.item(), p.b.item()) for p in pair_acc]
        assert pairs == [(0, 0), (1, 10), (2, 20)]
        pair_acc.terminate()
    finally:
        registerCustomArgParser(Pair, None)


def test_returned_tensors_are_ring_buffer_views():
    """Buffer reuse rule: a slot is released by the next __next__ and later rewritten."""
    loader = torch.utils.data.DataLoader(IndexDataset(8), batch_size=1)
    acc = AsynchronousDataAccessor(loader, buffer_size=2, **FORK)
    it = iter(acc)
    kept = [next(it)[1] for _ in range(5)]  # no clone: views of the two slots
    assert kept[0].untyped_storage().data_ptr() == kept[2].untyped_storage().data_ptr()
    assert kept[0].untyped_storage().data_ptr() == kept[4].untyped_storage().data_ptr()
    # Slot 0 now holds element 4: the element-0 view was overwritten.
    assert kept[0].item() == kept[4].item() == 4
    assert kept[4].is_shared()
    acc.terminate()


# ----------------------------------------------------------------------- rebatching
def test_standalone_rebatching_and_len():
    for drop_last, expected in [(True, [[0, 1, 2, 3], [4, 5, 6, 7]]),
                                (False, [[0, 1, 2, 3], [4, 5, 6, 7], [8]])]:
        loader = torch.utils.data.DataLoader(IndexDataset(9), batch_size=3,
                                             drop_last=drop_last)
        acc = AsynchronousDataAccessor(loader, rebatched_size=4, **FORK)
        assert len(acc) == (len(loader) * 3) // 4
        assert [y.tolist() for _, y in acc] == expected
        assert [y.tolist() for _, y in acc] == expected
        acc.terminate()


def test_async_drop_last_false_resolves_to_rebatching():
    loader = DataLoader(opts(D=4), IndexDataset(10), batch_size=1, drop_last=False,
                        mode=DataLoaderMode.Async, async_options=FORK)
    # pylint: disable=protected-access
    assert loader._rebatched_size == 4 and loader.batch_size == 4
    assert len(loader) == 3
    assert [y.tolist() for _, y in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    loader.terminate()


def test_async_rebatched_worker_size():
    loader = DataLoader(opts(D=3), IndexDataset(20), batch_size=2,
                        mode=DataLoaderMode.AsyncRebatched, rebatched_worker_size=4,
                        async_options=FORK)
    assert loader.batch_size == 4 and loader.combinedBatchSize == 6
    assert len(loader) == 3
    assert [y.tolist() for _, y in loader] == [list(range(k, k + 6)) for k in (0, 6, 12)]
    loader.terminate()


# ----------------------------------------------------------------------- preload options
def wait_for(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("early_preload", [False, True])
def test_early_preload(early_preload):
    data = CountingDataset(10)
    acc = AsynchronousDataAccessor(data, buffer_size=3, early_preload=early_preload, **FORK)
    if early_preload:
        assert wait_for(lambda: data.count.item() >= 3)
    else:
        time.sleep(0.3)
        assert data.count.item() == 0
    assert [y.item() for _, y in acc] == list(range(10))
    acc.terminate()


@pytest.mark.parametrize("load_indefinitely", [False, True])
def test_load_indefinitely(load_indefinitely):
    data = CountingDataset(4)
    acc = AsynchronousDataAccessor(data, buffer_size=3, load_indefinitely=load_indefinitely,
                                   **FORK)
    assert [y.item() for _, y in acc] == [0, 1, 2, 3]
    if load_indefinitely:  # the next pass is prefetched
        assert wait_for(lambda: data.count.item() > 4)
    else:
        time.sleep(0.3)
        assert data.count.item() == 4
    assert [y.item() for _, y in acc] == [0, 1, 2, 3]
    assert [y.item() for _, y in acc] == [0, 1, 2, 3]
    acc.terminate()


def test_new_epoch_after_break_mid_epoch():
    data = IndexDataset(12)
    sync = cloned(DataLoader(opts(D=2), data, batch_size=1))
    for load_indefinitely in (True, False):
        loader = DataLoader(opts(D=2), data, batch_size=1, mode=DataLoaderMode.Async,
                            async_options=dict(FORK, load_indefinitely=load_indefinitely,
                                               buffer_size=2))
        for i, _ in enumerate(loader):
            if i == 2:
                break
        assert_same(cloned(loader), sync)
        with pytest.raises(KeyboardInterrupt):
            for i, _ in enumerate(loader):
                if i == 1:
                    raise KeyboardInterrupt  # in the loop body: the worker keeps running
        assert_same(cloned(loader), sync)
        loader.terminate()


def test_len_and_restart_after_terminate():
    acc = AsynchronousDataAccessor(IndexDataset(5), **FORK)
    assert len(acc) == 5
    assert [y.item() for _, y in acc] == list(range(5))
    acc.terminate()
    acc.terminate()  # idempotent
    assert [y.item() for _, y in acc] == list(range(5))  # a new worker is started
    acc.terminate()


# ----------------------------------------------------------------------- errors
def test_dataloader_with_internal_accessor_rejected():
    loader = DataLoader(opts(), IndexDataset(4), mode=DataLoaderMode.Async,
                        async_options=FORK)
    with pytest.raises(poptorch.Error, match="already uses an AsynchronousDataAccessor"):
        AsynchronousDataAccessor(loader)
    loader.terminate()


def test_argument_checks():
    sync_loader = DataLoader(opts(D=2), IndexDataset(5), drop_last=False)
    with pytest.raises(AssertionError, match="drop_last=False"):
        AsynchronousDataAccessor(sync_loader, **FORK)
    with pytest.raises(AssertionError, match="rebatched_size"):
        AsynchronousDataAccessor(IndexDataset(4), rebatched_size=1, **FORK)


def test_non_flat_element_is_an_assertion_error():
    acc = AsynchronousDataAccessor(NestedDataset(4), **FORK)
    with pytest.raises(AssertionError, match="flat 1D container of tensors"):
        next(iter(acc))
    acc.terminate()


def test_varying_shapes_rejected():
    acc = AsynchronousDataAccessor(VaryingShapeDataset(4), **FORK)
    with pytest.raises(AssertionError, match="shape"):
        list(acc)
    acc.terminate()


def test_empty_dataset():
    acc = AsynchronousDataAccessor(EmptyIterable(), **FORK)
    with pytest.raises(poptorch.Error, match="The Dataset is empty"):
        next(iter(acc))
    acc.terminate()


def test_worker_exception_reraised_with_traceback():
    acc = AsynchronousDataAccessor(FailingDataset(10), **FORK)
    received = []
    with pytest.raises(ValueError, match="boom at index 5") as info:
        for _, y in acc:
            received.append(y.item())
    assert received == [0, 1, 2, 3, 4]
    text = "".join(traceback.format_exception(info.value))
    assert "in __getitem__" in text
    assert 'raise ValueError(f"boom at index {index}")' in text
    assert "worker process" in text
    assert not multiprocessing.active_children()  # the worker was stopped
    # A new iteration starts a fresh worker (and fails again at the same place).
    with pytest.raises(ValueError):
        list(acc)
    acc.terminate()


@pytest.mark.parametrize("strategy", [SharingStrategy.SharedMemory, SharingStrategy.ForkServer])
def test_worker_failed_to_start(strategy):
    with pytest.raises(poptorch.Error, match="worker thread failed to start") as info:
        AsynchronousDataAccessor(BrokenUnpickle(4), sharing_strategy=strategy)
    assert "cannot rebuild this dataset" in "".join(traceback.format_exception(info.value))
    with pytest.raises(poptorch.Error, match="worker thread failed to start"):
        AsynchronousDataAccessor(Unpicklable(4), sharing_strategy=strategy)


def test_worker_pid_is_logged_at_debug(poptorch_logs):
    """As PopTorch: "AsynchronousDataAccessor worker process: <pid>" at debug level."""
    acc = AsynchronousDataAccessor(IndexDataset(4), **FORK)
    try:
        found = re.findall(r"AsynchronousDataAccessor worker process: (\d+)",
                           poptorch_logs.text)
        assert found == [str(acc._process.pid)]  # pylint: disable=protected-access
        assert f"AsynchronousDataAccessor parent process: {os.getpid()}" in \
            poptorch_logs.text
    finally:
        acc.terminate()


def test_killed_worker_raises_instead_of_hanging():
    acc = AsynchronousDataAccessor(IndexDataset(1000, delay=0.01), buffer_size=2, **FORK)
    it = iter(acc)
    next(it)
    os.kill(acc._process.pid, signal.SIGKILL)  # pylint: disable=protected-access
    start = time.monotonic()
    with pytest.raises(AssertionError, match="An error occurred in the data fetcher"):
        sum(1 for _ in it)
    assert time.monotonic() - start < 5
    assert not multiprocessing.active_children()


# ----------------------------------------------------------------------- cleanup
def test_terminate_leaves_no_process_or_shared_memory():
    before = shm_entries()
    loader = DataLoader(opts(D=2), IndexDataset(40, delay=0.001), batch_size=2,
                        mode=DataLoaderMode.Async, async_options=FORK)
    it = iter(loader)
    next(it)
    pid = loader._accessor._process.pid  # pylint: disable=protected-access
    assert multiprocessing.active_children()
    loader.terminate()
    assert not multiprocessing.active_children()
    assert not os.path.exists(f"/proc/{pid}")
    assert shm_entries() - before == set()
    assert not mapped_shm_files()


def test_garbage_collection_terminates_worker():
    loader = DataLoader(opts(), IndexDataset(10), mode=DataLoaderMode.Async,
                        async_options=FORK)
    next(iter(loader))
    pid = loader._accessor._process.pid  # pylint: disable=protected-access
    del loader
    gc.collect()
    assert not os.path.exists(f"/proc/{pid}")


def test_keyboard_interrupt_while_waiting_cleans_up_and_can_restart(default_sigint):
    before = shm_entries()
    # The pass lasts 240 s, so the interrupt lands inside it even when a busy machine
    # starts the timer's thread late.
    acc = AsynchronousDataAccessor(IndexDataset(600, delay=0.4), buffer_size=2, **FORK)
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident,
                                                       signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        sum(1 for _ in acc)
    timer.join()
    assert not multiprocessing.active_children()
    assert shm_entries() - before == set()
    # The next epoch starts a new worker.
    acc2 = AsynchronousDataAccessor(IndexDataset(3), **FORK)
    assert [y.item() for _, y in acc2] == [0, 1, 2]
    acc2.terminate()
    acc.terminate()


def test_keyboard_interrupt_at_top_level_of_a_script(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent("""
        import sys, time, torch
        from poptorch._data.dataloader import AsynchronousDataAccessor
        from poptorch.enums import SharingStrategy

        class Slow(torch.utils.data.Dataset):
            def __len__(self):
                return 1000
            def __getitem__(self, i):
                time.sleep(0.01)
                return torch.tensor([i])

        if __name__ == "__main__":
            acc = AsynchronousDataAccessor(Slow(), sharing_strategy=SharingStrategy.Fork)
            for i, x in enumerate(acc):
                if i == 3:
                    print(acc._process.pid, flush=True)
                    raise KeyboardInterrupt
    """))
    before = shm_entries()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr
    pid = int(proc.stdout.split()[0])
    assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"))
    assert shm_entries() - before == set()


class FailsAt37(torch.utils.data.Dataset):
    """Elements 0…36 load; element 37 raises."""

    def __len__(self):
        return 100

    def __getitem__(self, index):
        if index == 37:
            raise ValueError("broken element 37")
        return torch.full((3,), float(index))


FailsAt37.__module__ = IndexDataset.__module__


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", [DataLoaderMode.Sync, DataLoaderMode.Async])
def test_batches_loaded_before_a_dataset_error_are_delivered_first(mode):
    """Found by a user: Async raised at once and dropped the 3 good batches when the
    worker had already failed before the loop started."""
    import time
    loader = DataLoader(opts(D=2), FailsAt37(), batch_size=5, mode=mode)
    iterator = iter(loader)
    time.sleep(1.0)  # let the worker run into the error
    delivered = []
    with pytest.raises(ValueError, match="broken element 37"):
        for batch in iterator:
            delivered.append(batch[:, 0].clone())
    assert [b.tolist() for b in delivered] == [
        [float(i) for i in range(k * 10, k * 10 + 10)] for k in range(3)]
    loader.terminate()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", [DataLoaderMode.Async, DataLoaderMode.AsyncRebatched])
def test_unnamed_async_loader_stays_alive_while_iterated(mode):
    """``for x in poptorch.DataLoader(...)`` once failed in the Async modes: the loader was
    garbage collected (stopping its worker) while its iterator was still in use."""
    count = sum(1 for _ in DataLoader(opts(D=2), IndexDataset(40), batch_size=4, mode=mode,
                                      async_options=FORK))
    assert count == 5
