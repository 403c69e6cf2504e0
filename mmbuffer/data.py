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

Resuming (both modes, local or remote stores): :meth:`BufferDataset.state_dict`,
taken in the process that iterates (in-process, ``num_workers=0``, or in each worker
by ``torchdata``'s ``StatefulDataLoader``), is a small dict of JSON-able counters
(``_feed/resume.py``: version, configuration, the pass's key, batches delivered, and
in epoch mode the epoch's position and per-stream ``(first row, items,
fingerprint)``); :meth:`BufferDataset.load_state_dict` makes the next pass deliver
exactly the batches the saved one had not, in the same order. Random mode: batch
``k`` of a pass is drawn with a generator keyed by ``(pass key, k)``, so the
delivered batches are skipped without being drawn (a remote pool starts at its
``k``-th draw); on the same snapshot the rest is bit-identical, on a newer one the
rest is drawn by the same keys from the newer data. Epoch mode: the epoch goes on
over the items of the snapshot it started on, at the same rows, on a newer snapshot
too (its new items wait for the next epoch); if that snapshot lost some of them (a
ring that wrapped) or holds other data at their rows (a store re-created, or
republished with renumbered rows: the fingerprint tells), or the store is at an
earlier generation than the state, iterating raises ``RowNotLiveError``, never other
rows. A state of another version, store, seed, sampler, size, mode, rank, world size
or worker count is ``InvalidArgumentError`` naming the field (a change of worker
count is refused: resume with the workers the state was saved with).

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
>>> ds = BufferDataset(path, 4, num_batches=5)
>>> it = iter(ds); first = [next(it)["x"] for _ in range(2)]
>>> state = ds.state_dict()           # into the checkpoint; a crash, a new process:
>>> again = BufferDataset(path, 4, num_batches=5)
>>> again.load_state_dict(state)
>>> rest = [b["x"] for b in again]    # the 3 batches not delivered, as an uninterrupted pass
>>> len(rest), all(torch.equal(a, b["x"]) for a, b in zip(rest, it))
(3, True)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import errors, samplers
from ._disk.checks import check_int
from ._disk.urls import is_url, location
from ._feed.blocks import BlockLayout, PackedBatch, read_into
from ._feed.epochs import EpochSampler
from ._feed.resume import PassState, batch_generator, pass_key
from ._read import frames
from ._read.gather import Batch, resolve_keys
from .buffer import Buffer
from .opening import open as open_store
from .samplers import Sampler

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
        self._state: PassState | None = None  # the pass this process iterates
        self._loaded: PassState | None = None  # load_state_dict's, for the next pass

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

    # -- resuming ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this process's pass stands: a small dict of JSON-able values (module
        docstring, "Resuming"). Call it in the process that iterates: in-process, with
        ``num_workers=0``, or through ``torchdata``'s ``StatefulDataLoader``, which calls it
        in each worker.

        Raises
        ------
        InvalidArgumentError
            No pass was started in this process (with ``DataLoader`` workers, the main
            process's dataset never sees their progress).
        """
        state = self._loaded if self._loaded is not None else self._state
        if state is None:
            raise errors.InvalidArgumentError(
                "state_dict: expected a dataset iterated in this process (in-process, num_workers=0, or in a "
                "DataLoader worker through torchdata's StatefulDataLoader), got one that never started a pass here")
        return state.to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the pass ``state`` (from :meth:`state_dict`) at the next iteration:
        the batches it had not delivered, in the same order. Fields that must match
        this dataset (mode, seed, sizes, sampler, store) are checked now; the rank,
        world size and workers when the pass starts.

        Raises
        ------
        InvalidArgumentError
            A state of another version, dataset or configuration, naming the field,
            the expected and the received value.
        """
        loaded = PassState.load(dict(state) if isinstance(state, Mapping) else state, {
            "mode": "epoch" if self.epoch else "random", "seed": self.seed, "batch_size": self.batch_size,
            "slice_len": self.slice_len, "sampler": repr(self.sampler), "store": str(self.path)})
        self._set_epoch = loaded.set_epoch
        self._loaded = loaded

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        buf = self._open()
        buf.refresh()
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        rank, world = self._rank_world()
        passes = self._passes
        self._passes += 1
        loaded, self._loaded = self._loaded, None  # a loaded state resumes one pass: this one
        budget = None if self.num_batches is None else _split(self.num_batches, wid, nw)
        remote = buf.remote
        snapshot = "" if remote is None else remote.snapshot
        generation = buf.generation if remote is None else remote.sequence
        # DataLoader draws a fresh base seed per pass from torch's global RNG (so
        # torch.manual_seed makes runs reproducible); persistent workers and
        # in-process iteration count their passes
        base = 0 if info is None else (int(info.seed) - int(info.id)) % 2**63
        state = PassState(
            "epoch" if self.epoch else "random", self.seed, self._set_epoch, self.batch_size, self.slice_len,
            repr(self.sampler), str(self.path), rank, world, wid, nw, generation, snapshot,
            pass_key([self.seed, self._set_epoch, rank, wid, base, passes]), 0, 0, 0, -1, None)
        if loaded is not None:
            for name in ("rank", "world_size", "worker", "num_workers"):
                if getattr(loaded, name) != getattr(state, name):
                    raise errors.InvalidArgumentError(
                        f"state['{name}']: expected {getattr(state, name)} (this pass's), got {getattr(loaded, name)}: "
                        "resume with the ranks and DataLoader workers the state was saved with")
            if loaded.generation > generation:
                raise errors.RowNotLiveError(
                    f"{self.path}: expected a snapshot at or after generation {loaded.generation} (the state's), got "
                    f"{generation}: the store was rolled back or re-created; the pass cannot go on")
            # random mode draws the rest from the data of now; an epoch keeps the snapshot it started on
            state = loaded if self.epoch else loaded.advanced(generation=generation, snapshot=snapshot)
        if remote is not None:  # a remote store's chunk pool: each (rank, worker) reads its own blocks
            remote.set_shard(rank * nw + wid, world * nw, epoch=self._set_epoch,
                             draws=0 if self.epoch else state.delivered)
        self._state = state
        if budget is not None:
            budget = max(0, budget - state.delivered)
        if self.epoch:
            return self._epoch(buf, rank * nw + wid, world * nw, budget, loaded)
        return self._random(buf, budget)

    def _random(self, buf: Buffer, budget: int | None) -> Iterator[Batch]:
        names = resolve_keys(buf.store, self.keys)
        stack = frames.for_store(self.stack, buf.store)
        self.sampler.check(buf)
        layout: BlockLayout | None = None
        state = self._state
        assert state is not None
        first = k = state.delivered
        while budget is None or k - first < budget:
            if self.refresh_every and k and k % self.refresh_every == 0 and buf.refresh():
                remote = buf.remote
                state = state.advanced(generation=buf.generation if remote is None else remote.sequence,
                                       snapshot="" if remote is None else remote.snapshot)
            block = None if layout is None else layout.empty()
            generator = batch_generator(state.pass_key, k)  # batch k is a function of the key and k
            batch = read_into(buf, self.sampler, self.batch_size, names, generator, block=block, layout=layout, stack=stack)
            if not isinstance(batch, PackedBatch):  # the first batch fixes the layout
                own = BlockLayout.of(batch)
                layout = layout or own
                batch = own.pack(batch)
            k += 1
            self._state = state = state.advanced(delivered=k)  # counted before it leaves
            yield batch

    def _epoch(self, buf: Buffer, index: int, count: int, budget: int | None, loaded: PassState | None) -> Iterator[Batch]:
        """Set the epoch up now (so that a state taken before the first batch already
        names the epoch and its snapshot), then iterate it lazily."""
        sampler = EpochSampler(
            buf, self.batch_size, self.slice_len, seed=self.seed,
            name=f"{self.name}-{index}of{count}", shard=(index, count), keys=self.keys, stack=self.stack,
        )
        state = self._state
        assert state is not None
        if loaded is not None:
            sampler.restore(loaded.epoch, loaded.position, loaded.num_items, loaded.lanes)
        if loaded is not None and loaded.num_items >= 0:
            lanes = loaded.lanes  # the epoch's own snapshot, not this one
        else:
            lanes = sampler.start(buf.view())
            if loaded is not None:  # the state was taken before its epoch started: it starts now
                state = state.advanced(generation=buf.generation if buf.remote is None else buf.remote.sequence)
        self._state = state.advanced(epoch=sampler.epoch, position=sampler.position, num_items=sampler.num_items,
                                     lanes=lanes)
        return self._epoch_batches(sampler, budget)

    def _epoch_batches(self, sampler: EpochSampler, budget: int | None) -> Iterator[Batch]:
        state = self._state
        assert state is not None
        for n, batch in enumerate(sampler):
            if budget is not None and n >= budget:
                return
            self._state = state = state.advanced(delivered=state.delivered + 1, position=sampler.position)
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


