"""``BufferDataset``: a store path as a ``torch.utils.data.IterableDataset``.

Use it with ``DataLoader(ds, batch_size=None, num_workers=k)``: the dataset
yields whole :class:`~mmbuffer.Batch` objects (``batch_size=None`` turns off the
loader's own batching). Each worker process opens the store read-only itself
(``mb.open(path, "r")``); the columns are memory-mapped, so all workers and ranks
on a machine share one copy in the page cache and each process's memory stays
flat. Each batch is gathered straight into one flat block (a
:class:`~mmbuffer._feed.blocks.PackedBatch`, a ``Batch`` whose tensors are views into
it), so a batch crosses from a worker as one shared-memory segment (one file
descriptor, one map in the main process, whatever the number of columns),
``DataLoader``'s ``pin_memory=True`` pins one tensor (it calls
``Batch.pin_memory()``), and ``b.to("cuda", non_blocking=True)`` is one copy.
``DataLoader``'s default conversion passes a ``Batch`` through unchanged.

Random mode (``epoch=False``, the default): every worker draws i.i.d. batches
(``sample`` / ``sample_slices``) from its own ``torch.Generator``, seeded from
``seed``, the ``set_epoch`` value, the rank, the worker id and the pass: the
``DataLoader``'s per-pass base seed (drawn from torch's global RNG, as for any
dataset, so ``torch.manual_seed`` makes a run reproducible) and the number of
passes this process made (persistent workers, in-process iteration). Workers,
ranks and passes never repeat each other's draws. Every ``refresh_every`` batches a worker calls
``refresh()`` and then samples the rows committed since (a writer in another
process may append while training reads).

Epoch mode (``epoch=True``): items (transitions, or strict windows of
``slice_len`` rows) are visited without replacement by
:class:`~mmbuffer.EpochSampler`, the epoch split over the ``world_size *
num_workers`` (rank, worker) pairs with ``shard=(rank * num_workers + worker,
world_size * num_workers)``: the shards are disjoint and together cover every
item exactly once. One pass over the ``DataLoader`` finishes the current epoch.
Each shard keeps its position in ``sampler/<name>-<i>of<n>.json`` inside the
store, so a restarted run continues the epoch (positions run ahead of the
training loop by the loader's prefetch, ``prefetch_factor * num_workers``
batches, which a restart skips); :meth:`BufferDataset.reset` forgets them.
Exactly-once needs every worker to see the same store: use it on stores that are
not being written (offline training).

>>> import tempfile, numpy as np, torch, mmbuffer as mb
>>> from mmbuffer.data import BufferDataset
>>> path = tempfile.mkdtemp() + "/d"
>>> with mb.create(path, {"x": ((), "int64")}, capacity=64, next_keys=()) as buf:
...     buf.extend({"x": np.arange(20), "truncated": np.arange(20) % 5 == 4})
>>> loader = torch.utils.data.DataLoader(BufferDataset(path, 8, num_batches=3), batch_size=None)
>>> [tuple(b["x"].shape) for b in loader]
[(8,), (8,), (8,)]
>>> ds = BufferDataset(path, 6, epoch=True)
>>> sorted(torch.cat([b["x"] for b in ds]).tolist()) == list(range(20))
True
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import errors, samplers
from ._disk.checks import check_int
from ._feed.blocks import BlockLayout, PackedBatch, read_into
from .buffer import Buffer
from ._feed.epochs import EpochSampler
from ._read import frames
from ._read.gather import Batch, resolve_keys
from .opening import open_buffer as open_store
from .samplers import Sampler
from ._disk.urls import is_url, location

__all__ = ["BufferDataset"]

DEFAULT_REFRESH_EVERY = 100


class BufferDataset(IterableDataset[Batch]):
    """Batches sampled from the store at ``path``, for ``DataLoader(batch_size=None)``.

    Parameters
    ----------
    path:
        The store directory. It is opened read-only in each process that iterates.
    batch_size:
        Transitions per batch, or slices when ``slice_len`` is given.
    slice_len:
        None for transitions, else ``[batch_size, slice_len]`` windows.
    keys:
        Columns to read (default: all, with ``next_*``).
    epoch:
        False: i.i.d. batches; True: epochs without replacement split over
        workers and ranks (see the module docstring).
    seed:
        Mixed into every worker's seed (random mode); the key of the epoch
        permutation, the same for every shard (epoch mode).
    num_batches:
        Batches per pass over the loader, per rank, split over its workers.
        None: endless in random mode, one epoch in epoch mode.
    refresh_every:
        Random mode: call ``refresh()`` every that many batches (per worker) to
        see new commits; 0 refreshes only at the start of each pass.
    prioritized, beta, strict:
        As in ``sample`` / ``sample_slices`` (random mode). Priorities are read
        as last committed by the writer; readers cannot update them.
    sampler:
        A spec of :mod:`mmbuffer.samplers` instead of ``slice_len`` and the flags
        above (picklable: it travels to the workers). ``samplers.Epoch(...)`` is
        epoch mode with its ``slice_len``, ``seed`` and ``name``.
    name:
        Epoch mode: prefix of the state files ``sampler/<name>-<i>of<n>.json``.
    cache_dir, storage_options, pool:
        For a URL (``s3://...``): as ``mb.open(url, "r", ...)``. In random mode each
        (rank, worker) pair samples its own disjoint blocks of the chunk pool
        (``mmbuffer.remote``); epoch mode reads exactly, chunk by chunk.
    rank, world_size:
        Override the ``torch.distributed`` rank and world size (default: from
        the initialized process group, else ``0`` and ``1``).
    stack, stack_pad:
        Frame stacks, as in ``Buffer.sample`` (``mmbuffer._read.frames``).

    Raises
    ------
    InvalidArgumentError
        Bad sizes or options (at construction).
    StoreNotFoundError, FormatVersionError
        From opening the store (when iterating).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        batch_size: int,
        slice_len: int | None = None,
        *,
        keys: Iterable[str] | None = None,
        epoch: bool = False,
        seed: int = 0,
        num_batches: int | None = None,
        refresh_every: int = DEFAULT_REFRESH_EVERY,
        prioritized: bool = False,
        beta: float = 0.4,
        strict: bool = True,
        name: str = "dataloader",
        rank: int | None = None,
        world_size: int | None = None,
        sampler: Sampler | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        pool: Any = "default",
        stack: Mapping[str, int] | None = None,
        stack_pad: str = "first",
    ) -> None:
        super().__init__()
        self.path = location(path)
        self.remote = {"cache_dir": cache_dir, "storage_options": storage_options, "pool": pool} if is_url(path) else {}
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.slice_len = None if slice_len is None else check_int("slice_len", slice_len, 1)
        self.keys = None if keys is None else ([keys] if isinstance(keys, str) else list(keys))
        self.stack = frames.check(stack, stack_pad)  # column names checked against the store when iterating
        self.epoch = bool(epoch)
        self.seed = check_int("seed", seed, 0)
        self.num_batches = None if num_batches is None else check_int("num_batches", num_batches, 0)
        self.refresh_every = check_int("refresh_every", refresh_every, 0)
        sampler = samplers.resolve(sampler, self.slice_len, prioritized=bool(prioritized), beta=beta, strict=bool(strict))
        if isinstance(sampler, samplers.Slices):
            self.slice_len = sampler.slice_len
        elif isinstance(sampler, samplers.Epoch):  # epoch mode, sharded over workers and ranks here
            if (seed, name, sampler.shard) != (0, "dataloader", (0, 1)):
                raise errors.InvalidArgumentError(f"sampler: expected seed, name and no shard in the Epoch spec only, got {sampler!r}")
            self.epoch, self.slice_len, self.seed, name = True, sampler.slice_len, sampler.seed, sampler.name
            sampler = samplers.from_flags(self.slice_len)
        self.sampler = sampler
        if self.epoch and not (
            isinstance(sampler, samplers.Uniform)
            or (isinstance(sampler, samplers.Slices) and sampler.strict and sampler.weighting == "windows")
        ):
            raise errors.InvalidArgumentError(
                "epoch: expected a uniform sampler of transitions or strict windows (an epoch visits every "
                f"strict window once), got {sampler!r}"
            )
        self.name = str(name)
        if (rank is None) != (world_size is None):
            raise errors.InvalidArgumentError(
                f"rank, world_size: expected both or neither, got rank={rank!r}, world_size={world_size!r}"
            )
        if world_size is not None:
            world_size = check_int("world_size", world_size, 1)
            rank = check_int("rank", rank, 0)
            if rank >= world_size:
                raise errors.InvalidArgumentError(f"rank: expected an integer in [0, {world_size}), got {rank}")
        self._shard_override = None if world_size is None else (int(rank), world_size)  # type: ignore[arg-type]
        self._set_epoch = 0
        self._passes = 0
        self._buf: Buffer | None = None
        self._pid = -1

    # -- configuration -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Mix ``epoch`` into the random-mode seeds (as ``DistributedSampler.set_epoch``)."""
        self._set_epoch = check_int("epoch", epoch, 0)

    def reset(self) -> None:
        """Epoch mode: forget the saved epoch positions; the next pass starts epoch 0."""
        for f in (Path(self._open().path) / "sampler").glob(f"{self.name}-*of*.json"):
            f.unlink(missing_ok=True)

    def shard(self) -> tuple[int, int]:
        """``(index, count)`` of the calling process among all (rank, worker) pairs."""
        rank, world = self._rank_world()
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        return rank * nw + wid, world * nw

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        buf = self._open()
        buf.refresh()
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        rank, world = self._rank_world()
        passes = self._passes
        self._passes += 1
        budget = None if self.num_batches is None else _split(self.num_batches, wid, nw)
        if buf.remote is not None:  # a remote store's chunk pool: each (rank, worker) reads its own blocks
            buf.remote.set_shard(rank * nw + wid, world * nw, epoch=self._set_epoch)
        if self.epoch:
            return self._epoch(buf, rank * nw + wid, world * nw, budget)
        # DataLoader draws a fresh base seed per pass from torch's global RNG (so
        # torch.manual_seed makes runs reproducible); persistent workers and
        # in-process iteration count their passes
        base = 0 if info is None else (int(info.seed) - int(info.id)) % 2**63
        seq = np.random.SeedSequence([self.seed, self._set_epoch, rank, wid, base, passes])
        generator = torch.Generator().manual_seed(int(seq.generate_state(1, np.uint64)[0]))
        return self._random(buf, generator, budget)

    def _random(self, buf: Buffer, generator: torch.Generator, budget: int | None) -> Iterator[Batch]:
        names = resolve_keys(buf.store, self.keys)
        stack = frames.for_store(self.stack, buf.store)
        self.sampler.check(buf)
        layout: BlockLayout | None = None
        n = 0
        while budget is None or n < budget:
            if self.refresh_every and n and n % self.refresh_every == 0:
                buf.refresh()
            block = None if layout is None else layout.empty()
            batch = read_into(buf, self.sampler, self.batch_size, names, generator, block=block, layout=layout, stack=stack)
            if not isinstance(batch, PackedBatch):  # the first batch fixes the layout
                own = BlockLayout.of(batch)
                layout = layout or own
                batch = own.pack(batch)
            yield batch
            n += 1

    def _epoch(self, buf: Buffer, index: int, count: int, budget: int | None) -> Iterator[Batch]:
        sampler = EpochSampler(
            buf, self.batch_size, self.slice_len, seed=self.seed,
            name=f"{self.name}-{index}of{count}", shard=(index, count), keys=self.keys, stack=self.stack,
        )
        for n, batch in enumerate(sampler):
            if budget is not None and n >= budget:
                return
            yield BlockLayout.of(batch).pack(batch)

    # -- helpers -------------------------------------------------------------------------
    def _open(self) -> Buffer:
        """This process's read-only handle (reopened after a fork or unpickling)."""
        if self._buf is None or self._pid != os.getpid():
            self._buf = open_store(self.path, mode="r", **self.remote)
            self._pid = os.getpid()
        return self._buf

    def _rank_world(self) -> tuple[int, int]:
        if self._shard_override is not None:
            return self._shard_override
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_buf"] = None  # an open store (file handles, maps) never travels
        state["_pid"] = -1
        return state

    def __repr__(self) -> str:
        mode = "epoch" if self.epoch else "random"
        return (
            f"BufferDataset({str(self.path)!r}, batch_size={self.batch_size}, slice_len={self.slice_len}, "
            f"mode={mode}, seed={self.seed})"
        )


def _split(total: int, index: int, count: int) -> int:
    """Share of ``total`` items for part ``index`` of ``count`` (earlier parts get the rest)."""
    return total // count + (1 if index < total % count else 0)


