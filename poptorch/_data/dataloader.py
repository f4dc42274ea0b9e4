"""``poptorch.DataLoader`` (docs/api-sections.md api §7): batches of ``batch_size ×
deviceIterations
× replicationFactor × gradientAccumulation`` samples, optionally through an
:class:`AsynchronousDataAccessor`, and per-process partitioning for distributed runs
(docs/semantics.md S-28). Follows PopTorch 3.x.
"""
from __future__ import annotations

import collections.abc
import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import torch
import torch.utils.data
from tqdm import tqdm

from popart_compiler.errors import py_error
from poptorch._capture.custom_parsers import getCustomArgParser
from poptorch._data.accessor import AsynchronousDataAccessor
from poptorch._logging import logger
from poptorch.enums import DataLoaderMode
from poptorch.options import Options

__all__ = ["DataLoader", "AsynchronousDataAccessor"]


# --------------------------------------------------------------------------------------
# DataLoader
# --------------------------------------------------------------------------------------
def _num_processes(options) -> int:
    """Parts the data set is split into: one per process, or one per pipeline replica
    when each pipeline stage runs in its own process (its processes all read the same
    data)."""
    try:
        return int(options.Distributed.numProcesses) // \
            int(options.Distributed.pipelineProcessesPerReplica)
    except Exception:  # pylint: disable=broad-except
        return 1


def _process_part(options) -> int:
    """This process's part of the data set (see :func:`_num_processes`)."""
    return int(options.Distributed.processId) // \
        int(options.Distributed.pipelineProcessesPerReplica)


class _DistributedSubset(torch.utils.data.Dataset):
    """This process's contiguous slice of a map-style dataset (docs/semantics.md S-28).

    With ``drop_last`` each process gets ``combined × floor(len / (combined × n))``
    elements starting at ``id ×`` that amount; otherwise elements are split as evenly as
    possible (the first ``len % n`` processes get one more). When shuffling, every epoch
    (:meth:`next_epoch`) draws a global permutation from ``seed + epoch`` (identical in
    all processes) and, with ``drop_last``, the slices shift by the number of leftover
    elements on odd epochs so that those elements rotate in.
    """

    def __init__(self, dataset, process_id: int, num_processes: int, combined: int,
                 drop_last: bool, shuffle: bool, seed: Optional[int]):
        num_elts = len(dataset)
        if drop_last:
            per_proc = combined * (num_elts // (combined * num_processes))
            self._base_offset = process_id * per_proc
            self._length = per_proc
            self._leftovers = num_elts - per_proc * num_processes
        else:
            base, rem = divmod(num_elts, num_processes)
            self._base_offset = process_id * base + min(process_id, rem)
            self._length = base + (1 if process_id < rem else 0)
            self._leftovers = 0
        self._offset = self._base_offset
        self._dataset = dataset
        self._shuffle = shuffle
        self._seed = seed
        self._epoch = -1
        self._indices: Optional[torch.Tensor] = None

    @property
    def offset(self) -> int:
        """Global index of this process's first element (before shuffling)."""
        return self._offset

    def next_epoch(self) -> bool:
        """Advance to the next epoch; returns True if the indices changed."""
        if not self._shuffle:
            return False
        self._epoch += 1
        generator = torch.Generator()
        generator.manual_seed(int(self._seed) + self._epoch)
        self._indices = torch.randperm(len(self._dataset), generator=generator)
        self._offset = self._base_offset + (self._leftovers if self._epoch % 2 else 0)
        return True

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int):
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"index {index} out of range for a subset of length "
                             f"{self._length}")
        global_index = self._offset + index
        if self._indices is not None:
            global_index = int(self._indices[global_index])
        return self._dataset[global_index]


def _concat(items: List[Any]):
    """Concatenate consecutive collated batches along dim 0, keeping their structure."""
    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([t.reshape(1) if t.dim() == 0 else t for t in items])
    parser = getCustomArgParser(first)
    if parser is not None:
        columns = list(zip(*[list(parser.yieldTensors(it)) for it in items]))
        return parser.reconstruct(first, iter([_concat(list(c)) for c in columns]))
    if isinstance(first, collections.abc.Mapping):
        out = {k: _concat([it[k] for it in items]) for k in first}
        try:
            return type(first)(out)
        except TypeError:
            return out
    if isinstance(first, (list, tuple)):
        if any(isinstance(x, (torch.Tensor, collections.abc.Mapping, list, tuple))
               for x in first):
            columns = [_concat(list(c)) for c in zip(*items)]
            if hasattr(first, "_fields"):  # namedtuple
                return type(first)(*columns)
            return type(first)(columns)
        merged = [x for it in items for x in it]
        return type(first)(merged) if isinstance(first, tuple) else merged
    return items


class _OwnedIterator:
    """An epoch iterator that keeps its :class:`DataLoader` alive, so that
    ``for batch in poptorch.DataLoader(...)`` works in the asynchronous modes too (the
    loader stops its worker when it is garbage collected)."""

    def __init__(self, owner: "DataLoader", iterator):
        self._owner = owner
        self._iterator = iterator

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._iterator)


class _ProgressIterator:
    """Wraps an epoch iterator with a tqdm progress bar (closed at the end of the epoch)."""

    def __init__(self, iterator, total: Optional[int], tqdm_kwargs: Dict[str, Any]):
        self._iterator = iterator
        self._bar = tqdm(total=total, **tqdm_kwargs)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            element = next(self._iterator)
        except BaseException:
            self.close()
            raise
        self._bar.update(1)
        return element

    def close(self) -> None:
        """Close the progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


class DataLoader(torch.utils.data.DataLoader):
    """A ``torch.utils.data.DataLoader`` yielding **combined batches**: one element per
    call of a model wrapped with the same options. Follows PopTorch
    (docs/api-sections.md api §7.1).

    ``combinedBatchSize = batch_size × deviceIterations × (replicationFactor //
    input_group_size) × gradientAccumulation`` (docs/semantics.md S-11); every yielded tensor has
    that many rows in dim 0 (except a possible final short batch when ``drop_last=False``), laid out
    as described in docs/semantics.md S-13.

    Args:
        options (poptorch.Options): the options of the model the data is for; frozen by
            this call.
        dataset: a map-style or iterable ``torch.utils.data.Dataset``.
        batch_size (int or None, default 1): micro-batch size (what the model sees per
            step); ``None`` disables automatic batching (combined size ``None``).
        shuffle (bool, default None = False): reshuffle every epoch. When the options have
            a random seed (``Options.randomSeed``) and no ``generator`` is passed, the
            permutations come from a generator seeded with it, so the epochs are
            reproducible for a seed and identical in Sync and Async modes. Without a seed,
            Sync mode uses torch's global RNG at each epoch (as torch does) and Async mode
            a generator seeded from the global RNG at construction.
        num_workers (int, default 0): torch worker processes.
        drop_last (bool, default True): drop the final incomplete combined batch.
        persistent_workers (bool, default None = ``num_workers > 0``).
        auto_distributed_partitioning (bool, default True): with
            ``Distributed.numProcesses > 1``, give each process its own slice
            (docs/semantics.md S-28).
        mode (DataLoaderMode, default Sync): ``Sync``; ``Async`` (an internal
            :class:`AsynchronousDataAccessor` loads data in a worker process);
            ``AsyncRebatched`` (same, the worker loads batches of ``rebatched_worker_size``
            and the accessor assembles combined batches).
        async_options (dict, optional): keyword arguments for the internal
            :class:`AsynchronousDataAccessor` (not ``rebatched_size``).
        rebatched_worker_size (int, optional): worker-side batch size when rebatching
            (default: the combined batch size); must be <= the combined batch size.
        batch_sampler (optional): a sampler of index batches; mutually exclusive with
            ``batch_size`` and ``shuffle``. Its ``batch_size`` attribute, if any, is the
            micro-batch size; consecutive batches are concatenated into combined batches.
        progress_bar (bool or dict, keyword-only, default False): extension of this
            implementation: show a tqdm progress bar for each epoch (a dict is passed to
            ``tqdm`` as keyword arguments, e.g. ``{"desc": "train"}``).
        **kwargs: passed to ``torch.utils.data.DataLoader`` (``collate_fn``,
            ``worker_init_fn``, ``generator``, ``pin_memory``, ...).

    Raises:
        poptorch.Error: ``batch_sampler`` with ``batch_size != 1`` or ``shuffle``
            ("`batch_sampler` option is mutually exclusive with batch_size, shuffle."), or
            with distributed execution and ``auto_distributed_partitioning``.
        AssertionError: ``options`` is not a ``poptorch.Options``; an ``IterableDataset``
            with distributed execution and ``auto_distributed_partitioning``; distributed
            ``shuffle`` without a random seed; distributed ``batch_size=None``;
            ``rebatched_worker_size`` > combined batch size; ``rebatched_size`` in
            ``async_options``.
        ValueError: from torch for invalid torch arguments.
    """

    def __init__(self,
                 options,
                 dataset: torch.utils.data.Dataset,
                 batch_size: Optional[int] = 1,
                 shuffle: Optional[bool] = None,
                 num_workers: int = 0,
                 drop_last: bool = True,
                 persistent_workers: Optional[bool] = None,
                 auto_distributed_partitioning: bool = True,
                 mode: DataLoaderMode = DataLoaderMode.Sync,
                 async_options: Optional[Dict[str, Any]] = None,
                 rebatched_worker_size: Optional[int] = None,
                 batch_sampler: Optional[Union[torch.utils.data.Sampler,
                                               Iterator[Sequence]]] = None,
                 *,
                 progress_bar: Union[bool, Dict[str, Any]] = False,
                 **kwargs):
        self._accessor: Optional[AsynchronousDataAccessor] = None
        self._epoch_count = 0
        num_processes = _num_processes(options)
        # Rule 1: user batch sampler.
        self._user_batch_sampler = batch_sampler is not None
        self._user_drop_last = bool(drop_last)
        if self._user_batch_sampler:
            if batch_size != 1 or shuffle:
                raise py_error("`batch_sampler` option is mutually exclusive with "
                               "batch_size, shuffle.")
            if auto_distributed_partitioning and num_processes > 1:
                raise py_error("`batch_sampler` option is mutually exclusive with "
                               "auto_distributed_partitioning=True.")
            if getattr(batch_sampler, "batch_size", None) is not None:
                batch_size = batch_sampler.batch_size
            drop_last = None  # kept in _user_drop_last for the recombination
        if shuffle is None:
            shuffle = False
        # Rule 2.
        assert isinstance(options, Options), (
            f"Invalid type for 'options': expected poptorch.Options, got {type(options)}")
        options._freeze()  # pylint: disable=protected-access
        # Rule 3.
        if persistent_workers is None:
            persistent_workers = num_workers > 0

        steps = (options.device_iterations *
                 (options.replication_factor // options.input_group_size) *
                 options.Training.gradient_accumulation)
        self._combined_batch_size: Optional[int] = None
        if batch_size is not None:
            self._combined_batch_size = batch_size * steps
            # Reference quirk: `options` only exists when batch_size is not None.
            self._options = options
        self._batches_to_combine = steps if self._user_batch_sampler else 1

        self._is_iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if self._is_iterable:
            # Rule 4.
            if auto_distributed_partitioning:
                assert num_processes == 1, (
                    "auto_distributed_partitioning=True is not supported for "
                    "IterableDataset: partition the data yourself (using "
                    "Options.Distributed.processId / numProcesses) and pass "
                    "auto_distributed_partitioning=False")
            if num_workers > 1 and "worker_init_fn" not in kwargs:
                logger.warning(
                    "IterableDataset used with num_workers=%d but no worker_init_fn "
                    "specified: as a result the DataLoader will return every element of "
                    "the dataset %d times (once per worker).", num_workers, num_workers)
        else:
            # Rule 5.
            if not self._user_drop_last:
                self._warn_final_batch(dataset, batch_sampler, num_processes,
                                       _process_part(options),
                                       auto_distributed_partitioning)
            # Rule 6.
            if num_processes > 1 and auto_distributed_partitioning:
                if shuffle:
                    assert options.exists("random_seed"), (
                        "When using distributed execution with shuffle=True you must set "
                        "a random seed with Options.randomSeed() so that all the processes "
                        "shuffle the dataset identically")
                assert self._combined_batch_size is not None, (
                    "batch_size=None is not allowed when using distributed execution "
                    "with auto_distributed_partitioning=True")
                dataset = _DistributedSubset(
                    dataset, _process_part(options), num_processes,
                    self._combined_batch_size, self._user_drop_last, bool(shuffle),
                    options.random_seed if options.exists("random_seed") else None)
                shuffle = False  # the subset shuffles globally, per epoch

        # Rule 7: mode resolution.
        mode = DataLoaderMode(mode)
        self._rebatched_size: Optional[int] = None
        torch_batch_size = 1 if self._user_batch_sampler else self._combined_batch_size
        torch_drop_last = drop_last
        if mode != DataLoaderMode.Sync:
            wants_rebatch = (mode == DataLoaderMode.AsyncRebatched
                             or (not self._user_drop_last and self._combined_batch_size
                                 is not None and self._combined_batch_size > 1))
            if wants_rebatch and self._user_batch_sampler:
                logger.warning("Rebatching is not supported with a batch_sampler: "
                               "using DataLoaderMode.Async without rebatching.")
            elif (wants_rebatch and self._combined_batch_size is not None
                  and self._combined_batch_size > 1):
                worker_size = rebatched_worker_size or self._combined_batch_size
                assert worker_size <= self._combined_batch_size, (
                    f"rebatched_worker_size ({worker_size}) must be <= the combined batch "
                    f"size ({self._combined_batch_size})")
                torch_batch_size = worker_size
                self._rebatched_size = self._combined_batch_size
                torch_drop_last = False
            mode = DataLoaderMode.Async
        self._mode = mode

        # Reproducible shuffling: with a seed, the permutations come from a generator
        # seeded with it (identical in every mode; the generator travels with the sampler
        # to the asynchronous worker). Without a seed, Sync mode keeps torch's behaviour
        # (global RNG at each epoch) and Async mode seeds a generator from the global RNG
        # now (a spawned worker would otherwise always start from torch's default seed).
        if shuffle and not self._is_iterable and kwargs.get("generator") is None:
            seed = None
            if options.exists("random_seed"):
                seed = int(options.random_seed)
            elif mode == DataLoaderMode.Async:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
            if seed is not None:
                generator = torch.Generator()
                generator.manual_seed(seed)
                kwargs["generator"] = generator

        # Rule 8.
        super().__init__(dataset,
                         batch_size=torch_batch_size,
                         shuffle=shuffle,
                         batch_sampler=batch_sampler,
                         num_workers=num_workers,
                         # torch rejects drop_last without automatic batching
                         drop_last=bool(torch_drop_last) and torch_batch_size is not None,
                         persistent_workers=persistent_workers,
                         **kwargs)

        self._progress_bar: Optional[Dict[str, Any]] = (
            None if progress_bar in (False, None)
            else {} if progress_bar is True else dict(progress_bar))

        # Rule 9.
        if mode == DataLoaderMode.Async:
            async_options = dict(async_options or {})
            assert "rebatched_size" not in async_options, (
                "You can't provide a rebatched_size to async_options: use "
                "mode=DataLoaderMode.AsyncRebatched (and rebatched_worker_size) instead")
            accessor = AsynchronousDataAccessor(self, **async_options,
                                                rebatched_size=self._rebatched_size)
            accessor.hold_owner_weakly(self)
            self._accessor = accessor

    # ------------------------------------------------------------------ construction
    def _warn_final_batch(self, dataset, batch_sampler, num_processes: int, process_id: int,
                          auto_distributed_partitioning: bool) -> None:
        if self._user_batch_sampler:
            if not hasattr(batch_sampler, "__len__"):
                logger.warning(
                    "The batch_sampler has no __len__: unable to check whether its number "
                    "of batches is divisible by the number of batches combined per step "
                    "(%d) with drop_last=False.", self._batches_to_combine)
                return
            num_batches = len(batch_sampler)
            remainder = num_batches % self._batches_to_combine
            if remainder:
                logger.warning(
                    "The number of batches in the batch_sampler (%d) is not divisible by "
                    "the number of batches combined per step (%d) and drop_last=False: "
                    "the final, smaller batch will combine %d batch(es).", num_batches,
                    self._batches_to_combine, remainder)
            return
        if self._combined_batch_size is None:
            return
        try:
            num_elts = len(dataset)
        except TypeError:
            return
        processes = num_processes if auto_distributed_partitioning else 1
        per_step = self._combined_batch_size * processes
        if num_elts % per_step:
            local = num_elts
            if processes > 1:
                base, rem = divmod(num_elts, processes)
                local = base + (1 if process_id < rem else 0)
            logger.warning(
                "The number of elements in the dataset (%d) is not divisible by the number "
                "of elements processed per step (%d) and drop_last=False: the final, "
                "smaller batch will have a batch size of %d.", num_elts, per_step,
                local % self._combined_batch_size)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self):
        """Pickled state (sent to a spawned asynchronous worker): without the internal
        accessor and torch's persistent worker iterator."""
        state = self.__dict__.copy()
        state["_accessor"] = None
        state["_iterator"] = None
        return state

    # ------------------------------------------------------------------ properties
    @property
    def combinedBatchSize(self) -> Optional[int]:
        """``batch_size × deviceIterations × (replicationFactor // input_group_size) ×
        gradientAccumulation`` (rows of each yielded element), ``None`` if
        ``batch_size`` was ``None``."""
        return self._combined_batch_size

    @property
    def options(self):
        """The (frozen) ``poptorch.Options`` given at construction.

        Raises ``AttributeError`` if the loader was created with ``batch_size=None``
        (a quirk of the reference implementation, reproduced).
        """
        return self._options

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        """Number of elements per epoch.

        With rebatching: ``len(dataset) // combinedBatchSize`` (+1 when ``drop_last`` is
        false and there is a remainder); otherwise torch's length (with a user batch
        sampler that is the sampler's number of batches, as in PopTorch).
        """
        if self._rebatched_size is not None:
            num_elts = len(self.dataset)
            length = num_elts // self._rebatched_size
            if not self._user_drop_last and num_elts % self._rebatched_size:
                length += 1
            return length
        return super().__len__()

    # -- what the AsynchronousDataAccessor wrapping it reads (protocol.CombinedBatches) --

    @property
    def uses_async_accessor(self) -> bool:
        """It runs its own :class:`AsynchronousDataAccessor` (``DataLoaderMode.Async``)."""
        return self._accessor is not None

    @property
    def user_batch_sampler(self) -> bool:
        """The user passed a ``batch_sampler``."""
        return self._user_batch_sampler

    @property
    def user_drop_last(self) -> bool:
        """The ``drop_last`` the user asked for."""
        return self._user_drop_last

    def sync_iter(self):
        """One epoch of the synchronous pipeline (runs in the asynchronous worker in
        Async mode)."""
        if isinstance(self.dataset, _DistributedSubset):
            if self.dataset.next_epoch() and self.persistent_workers:
                self._iterator = None  # torch workers must see the new permutation
        iterator = super().__iter__()
        if self._user_batch_sampler and self._batches_to_combine > 1:
            return self._recombine(iterator)
        return iterator

    def _recombine(self, iterator):
        group = []
        for batch in iterator:
            group.append(batch)
            if len(group) == self._batches_to_combine:
                yield _concat(group)
                group = []
        if group and not self._user_drop_last:
            yield _concat(group)

    def __iter__(self):
        """Iterate over one epoch of combined batches.

        Reshuffles the distributed partition when applicable; in Async mode returns the
        internal accessor's iterator (elements are views of shared memory, valid until the
        next step); with a user batch sampler concatenates consecutive batches.
        """
        self._epoch_count += 1
        if self._accessor is not None:
            iterator = _OwnedIterator(self, iter(self._accessor))
        else:
            iterator = self.sync_iter()
        if self._progress_bar is not None:
            try:
                total = len(self)
            except TypeError:
                total = None
            kwargs = {"desc": f"Epoch {self._epoch_count}", **self._progress_bar}
            iterator = _ProgressIterator(iterator, total, kwargs)
        return iterator

    def terminate(self) -> None:
        """Stop the asynchronous worker process (no-op in Sync mode). Also called when the
        loader is garbage collected. Follows PopTorch."""
        accessor = getattr(self, "_accessor", None)
        if accessor is not None:
            accessor.terminate()

    def __del__(self):
        """Stop the asynchronous worker when the loader is garbage collected."""
        with contextlib.suppress(Exception):
            self.terminate()

