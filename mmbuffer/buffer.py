"""``Buffer``: the user-facing store (docs/api.md): write, inspect, sample, reprioritize.

``Buffer`` composes a ``Store`` (columns, manifest, index, tree: ``store.py``), the
single writer's ``Writer`` (cursors, reservation, commits: ``writer.py``) and the
read side: it asks a sampler spec (``mmbuffer.samplers``) for indices, gathers
them (``gather.py``) and, in a reader, re-checks them against the writer
(``recheck.py``).

>>> import tempfile, numpy as np, mmbuffer as mb
>>> path = tempfile.mkdtemp() + "/replay"
>>> buf = mb.create(path, {"obs": ((3,), "float32"), "action": ((), "int64"),
...                        "reward": ((), "float32")}, capacity=1000)
>>> T = 50
>>> steps = {"obs": np.random.rand(T, 3), "action": np.arange(T), "reward": np.ones(T),
...          "terminated": np.arange(T) % 10 == 9}
>>> buf.extend(steps, final_obs={"obs": np.zeros((5, 3))})
>>> buf.commit()
1
>>> len(buf), buf.num_episodes
(50, 5)
>>> b = buf.sample_slices(4, 8, generator=torch.Generator().manual_seed(0))
>>> tuple(b.data["obs"].shape), tuple(b.indices.shape)
((4, 8, 3), (4, 8))
>>> buf.close()
>>> mb.open(path, mode="r").num_episodes
5
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import torch

from . import errors, samplers
from ._disk.checks import check_int
from ._disk.guards import Closed
from ._ledger.manifest import load_manifest
from ._disk.columns import ColumnArray
from ._read.gather import Batch, gather, resolve_keys
from ._ledger.index import Lane
from ._read import frames
from ._read.batch import SampledBatches, read_batch, read_spec
from .samplers import Draw, Sampler
from ._ledger.store import Column, Store, View, locked
from ._ledger.writer import Writer, priority_shape, release_lock, take_lock

if TYPE_CHECKING:
    from .remote import RemoteSource

__all__ = ["Buffer"]


class Buffer:
    """An on-disk, memory-mapped trajectory store (use ``mb.create`` / ``mb.open``).

    A facade: the columns and the ledger are a :class:`~mmbuffer._ledger.store.Store`
    (:attr:`store`), the single writer's cursors, reservation and commits a
    :class:`~mmbuffer._ledger.writer.Writer` (``mode="a"`` only), the draws a sampler spec
    (:mod:`mmbuffer.samplers`), the reads ``gather``. Every method that reads or
    changes cursors, index, tree or rows holds :attr:`lock` (re-entrant), so a
    prefetching thread may sample while the training thread extends, commits and
    updates priorities.
    """

    def __init__(self, path: str | os.PathLike[str], mode: str = "a", *, source: RemoteSource | None = None) -> None:
        if mode not in ("r", "a"):
            raise errors.InvalidArgumentError(f"mode: expected 'r' or 'a', got {mode!r}")
        #: the re-entrant lock every method that reads or changes cursors, index, tree or
        #: rows holds: hold it to make several calls one step (a prefetch thread); the
        #: facade's own, handed to every store it opens, so it never changes
        self.lock = self._lock = threading.RLock()
        self._source = source  # a published store's snapshots (mmbuffer.remote), or None
        self._writer: Writer | None = None
        if source is not None:
            self._adopt(source.open(self.lock, self._swap))
        else:
            self._adopt(self._open_local(Path(path), mode))
        self._sampler_state = samplers.SamplerState()  # what specs derive from the index (slice counts, epochs)
        self._sampled = SampledBatches()  # lane cursors of recent batches, for update_priorities

    def _open_local(self, path: Path, mode: str) -> Store:
        manifest = load_manifest(path)  # before the LOCK file: a missing store creates nothing
        lock_fd = take_lock(path) if mode == "a" else None
        try:
            store = Store(path, mode, manifest, lock=self.lock)
        except BaseException:
            if lock_fd is not None:
                release_lock(lock_fd)
            raise
        if lock_fd is not None:
            try:
                self._writer = Writer(store, lock_fd)  # owns the lock from here; recovers the store
            except BaseException:
                store.close()
                raise
        return store

    def _adopt(self, store: Store) -> None:
        """Read through ``store`` from now on (a remote buffer's refresh swaps it)."""
        self._store = store
        self.path, self.mode, self.layout = store.path, store.mode, store.layout
        self.capacity, self.num_streams, self.lane_size = store.capacity, store.num_streams, store.lane_size
        self.compression, self.priorities = store.compression, store.priorities
        self.columns: dict[str, Column] = store.columns  # name -> mb.Column(shape, dtype)
        self.next_keys = store.next_keys

    def __repr__(self) -> str:
        where = str(self.path) if self._source is None else f"{self._source.url}@{self._source.snapshot}"
        if isinstance(self._store, Closed):
            return f"Buffer({where!r}, mode={self.mode!r}, closed)"
        return (
            f"Buffer({where!r}, mode={self.mode!r}, rows={len(self)}, "
            f"episodes={self.num_episodes}, capacity={self.capacity}, streams={self.num_streams})"
        )

    # -- the parts -------------------------------------------------------------------------
    @property
    def store(self) -> Store:
        """The columns and the ledger (manifest, index, tree) this buffer reads."""
        return self._store

    @property
    def remote(self) -> RemoteSource | None:
        """The published store's snapshots (``url``, ``snapshot``, ``pool``, ``set_shard``) from a URL, else None."""
        return self._source

    def _writing(self, what: str) -> Writer:
        if self._writer is None:
            how = "closed" if isinstance(self._store, Closed) else "opened with mode='r'; open it with mode='a' to write"
            raise errors.ReadOnlyError(f"{what}: store {self.path} is {how}")
        return self._writer

    # -- what the store is (what changes is read from the store each time) ---------------
    @property
    def attrs(self) -> dict[str, Any]:
        """JSON-able user metadata, saved at commit (a reader sees the last commit's)."""
        return self._store.attrs

    @attrs.setter
    def attrs(self, value: dict[str, Any]) -> None:
        self._store.attrs = value

    @property
    def generation(self) -> int:
        """The last commit's counter."""
        return self._store.generation

    # -- reading -----------------------------------------------------------------------
    def __len__(self) -> int:
        """Live rows: rows of live complete episodes plus the open episodes' rows."""
        return len(self._store)

    @property
    def num_episodes(self) -> int:
        """Live complete episodes over all lanes."""
        return self._store.num_episodes

    def view(self) -> View:
        """The snapshot samplers draw from now (``mmbuffer._ledger.store.View``)."""
        return self._store.view()

    def episode_bounds(self, view: View | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Global start row and length of every live complete episode (lane order), numpy."""
        return self._store.episode_bounds(view)

    def reservation(self) -> np.ndarray:
        """The writer's reservation per lane, read now: rows below ``reservation()[lane] - lane_size`` may be rewritten."""
        return self._store.reservation()

    def tree_spans(self) -> list[tuple[int, int]]:
        """The rows whose priority a writer may have set (``Store.tree_spans``)."""
        return self._store.tree_spans()

    def column(self, name: str) -> ColumnArray:
        """The backend array of a stored column or of ``final/<name>`` (what the kernels read: ``.mapped()``)."""
        return self._store.column(name)

    def read(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of a stored column, or the final observations at episode-end ``rows`` (``"final/obs"``: ``Store.read``)."""
        return self._store.read(name, rows)

    def read_range(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` of a stored column (see ``Store.read_range``)."""
        return self._store.read_range(name, start, stop, out)

    def leaf_priorities(self, rows: Any) -> np.ndarray:
        """The stored priorities ``(p + eps) ** alpha`` of ``rows`` (see ``Store.leaf_priorities``)."""
        return self._store.leaf_priorities(rows)

    def refresh(self, wait: bool = True) -> bool:
        """Reload the last commit (readers); return whether it changed. From a URL: move to the
        newest snapshot, fetched and opened while samples read the old one, swapped in under
        :attr:`lock` (another schema: ``CorruptStoreError``, nothing moves). ``wait=False``: in a
        background thread, False at once; a later call adopts it (True) or raises its error."""
        if self._source is None:
            return self._store.refresh()
        return self._source.refresh(wait)

    def _swap(self, store: Store) -> None:  # the source's newer snapshot, with the lock held
        old = self._store
        self._adopt(store)
        self._sampler_state.clear()
        old.close()

    def warm(self, columns: bool | Iterable[str] = False) -> None:
        """Read the priority tree (and ``columns``) into memory and map them (``Store.warm``)."""
        self._store.warm(columns)

    def release_memory(self) -> None:
        """Drop this process's mappings of the store's pages (see ``Store.release_memory``)."""
        self._store.release_memory()

    def drop_cache(self, start: int, stop: int) -> None:
        """Write rows ``[start, stop)`` behind and drop them from the page cache (``Store.drop_cache``)."""
        self._store.drop_cache(start, stop)

    @locked
    def episodes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(starts, lengths)`` of live complete episodes as int64 tensors. An episode's rows are
        ``start + arange(length)``, wrapping inside its lane (``capacity // num_streams`` rows)."""
        starts, lengths = self._store.episode_bounds()
        return torch.from_numpy(starts), torch.from_numpy(lengths)

    def episode(self, i: int, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The ``i``-th live episode (``episodes()`` order) as ``{key: tensor [length, ...]}``, wrap undone."""
        from ._read.episodes import episode

        return episode(self._store, i, keys)

    def iter_episodes(self, keys: Iterable[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Every live episode as of the call, in ``episode(i)`` order (``episodes.py``)."""
        from ._read.episodes import iter_episodes

        return iter_episodes(self._store, keys)

    @locked
    def get(self, index: Any, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Rows at global ids ``index`` (any integer shape) as ``{key: tensor}``.

        ``keys`` may name stored columns and ``next_<col>`` for next-derived ones.
        The ``next_<col>`` of an open episode's last row is not known until the
        next ``extend`` (it reads whatever the following ring row holds); the
        samplers never return that row.
        """
        idx = torch.as_tensor(index).numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        if idx.dtype.kind not in "iu":
            raise errors.InvalidArgumentError(f"index: expected integer row ids, got dtype {idx.dtype}")
        return gather(self._store, idx, keys)

    # -- writing -----------------------------------------------------------------------
    def extend(self, steps: Mapping[str, Any], stream: int | Sequence[int] | np.ndarray = 0, final_obs: Mapping[str, Any] | None = None) -> None:
        """Append ``T`` consecutive rows of one lane, or of each of ``K`` lanes at once.

        Parameters
        ----------
        steps:
            Column name -> array ``[T, *shape]`` (``[K, T, *shape]`` for K streams; numpy, torch or nested lists). ``terminated`` / ``truncated`` may be omitted (then False).
        stream:
            The lane, ``0 <= stream < num_streams``, or K distinct lanes: as K calls in order, checked first.
        final_obs:
            Next-derived column -> ``[E, *shape]``: the observation after the last step of each of the ``E`` episodes that end inside ``steps``, in order (lane by lane).

        Raises
        ------
        ReadOnlyError, SchemaError, InvalidArgumentError, CapacityError
            Before anything is written.
        DiskFullError
            No disk space for the rows (``Writer._reserve_space``); the store is as before the call, and the call may be repeated once space is freed.

        A block that would leave more than a lane of a stream's rows uncommitted commits the rows extended before it first.

        >>> import tempfile, mmbuffer as mb; b = mb.create(tempfile.mkdtemp() + "/e", {"x": ((), "int64")}, capacity=4, num_streams=2, next_keys=())
        >>> b.extend({"x": [[1, 2], [3, 4]]}, stream=[1, 0]); b.get(np.arange(4), ["x"])["x"].tolist()
        [3, 4, 1, 2]
        """
        self._writing("extend").extend(steps, stream, final_obs)

    def commit(self) -> int:
        """Make every extended row durable and visible to readers; return the generation.

        Raises
        ------
        DiskFullError
            No space for the new manifest: the last commit stays in place, the
            generation is unchanged, the extended rows stay extended, and
            ``commit`` may be called again once space is freed.
        """
        return self._writing("commit").commit()

    @locked
    def update_priorities(self, indices: Any, priorities: Any) -> None:
        """Set the priorities of sampled rows (before ``eps`` and ``alpha``).

        ``indices`` is a batch's ``indices`` (or the ``Batch``); ``priorities``
        has its shape, a leading part of it (one value per slice, say), or its
        shape plus trailing dimensions of size 1 (``[B, 1]`` from a TD-error head
        for ``[B]`` indices). Rows overwritten or evicted since the batch was
        sampled are ignored; duplicates resolve to the last value. NaN, inf or
        negative values raise ``InvalidPriorityError`` and change nothing.
        """
        written_at = None
        if isinstance(indices, Batch):
            written_at, indices = indices.written_at, indices.indices
        elif isinstance(indices, torch.Tensor):
            written_at = self._sampled.written_at(indices)
        idx = torch.as_tensor(indices).cpu().numpy()
        pri = np.asarray(priorities if isinstance(priorities, np.ndarray) else torch.as_tensor(priorities).detach().cpu().numpy())
        self._writing("update_priorities").update_priorities(idx, priority_shape(pri, idx.shape), written_at)

    def set_leaf_priorities(self, rows: Any, values: Any) -> None:
        """Set stored priorities directly, already ``(p + eps) ** alpha``: for instance
        values read with :meth:`leaf_priorities` from a store with the same
        ``PriorityConfig`` (``mmbuffer copy`` does this). Rows not live are
        ignored; checks and errors as :meth:`update_priorities`.
        """
        self._writing("set_leaf_priorities").set_leaf_priorities(rows, values)

    @locked
    def rewrite_derived(self, ends: np.ndarray, lanes: list[Lane]) -> int:
        """Replace the live episodes' index by ``ends``/``lanes`` recomputed from the data, rebuild
        the priority tree from its leaves, and commit; return the generation (``verify --repair``)."""
        generation = self._writing("verify --repair").rewrite_derived(ends, lanes)
        self._sampler_state.clear()  # slice counts came from the old index
        return generation

    # -- closing -----------------------------------------------------------------------
    def close(self) -> None:
        """Commit (writer) and release the lock; the object is unusable afterwards.

        If that commit fails (``DiskFullError``), the lock is released all the
        same: the rows extended since the last commit are lost, and the next
        writer recovers the store as after a crash. To keep them, free space and
        call ``commit`` before ``close``. A writer still open at interpreter exit
        is closed this way then (``mmbuffer/_ledger/closing.py``). Its maps are released here:
        ``len``, ``num_episodes``, ``generation`` and ``attrs`` answer what it held, any
        other later call is an ``InvalidArgumentError`` (a write: ``ReadOnlyError``).
        """
        if isinstance(self._store, Closed):
            return
        if self._source is not None:
            self._source.stop()  # a background refresh ends first (what it opened is closed)
        with self.lock:
            try:
                if self._writer is not None:
                    self._writer.close()
            finally:
                closed = Closed.keeping(f"store {self.path}", self._store, ("num_episodes", "generation", "attrs"))
                self._store.close()
                if self._source is not None:
                    self._source.close()
                self._store, self._writer = closed, None  # type: ignore[assignment]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sampling ----------------------------------------------------------------------
    @locked
    def sample(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        prioritized: bool = False,
        beta: float = 0.4,
        keys: Iterable[str] | None = None,
        sampler: Sampler | None = None,
        stack: Mapping[str, int] | None = None,
        stack_pad: str = "first",
    ) -> Batch:
        """``batch_size`` items drawn by ``sampler`` (default: uniform transitions).

        ``sampler`` is any spec of :mod:`mmbuffer.samplers` (``Slices(16)`` gives
        ``[B, 16]`` windows); ``prioritized=True, beta=...`` is the shorthand for
        ``sampler=samplers.Prioritized(beta)``. Uniform: every sampleable row
        (complete episodes, and the open episodes up to their last row with a
        known next observation) equally likely. Prioritized: probability
        ``p_i / sum p`` with importance weights ``(N P(i))^-beta`` normalized by
        their maximum over live rows.

        ``stack={"pixels": 4}``: ``data["pixels"]`` is ``[B, 4, ...]``, the frames of
        the row's last 4 steps, oldest first, padded before the episode's first
        step (``stack_pad="first"`` repeats its first frame, ``"zero"`` zeros), and
        ``next_pixels`` the stack as of the next observation (``_read/frames.py``).
        """
        spec = samplers.resolve(sampler, prioritized=prioritized, beta=beta)
        return self._draw(spec, check_int("batch_size", batch_size, 1), generator, keys, stack, stack_pad)

    @locked
    def sample_slices(
        self,
        num_slices: int,
        slice_len: int,
        strict: bool = True,
        generator: torch.Generator | None = None,
        *,
        prioritized: bool = False,
        beta: float = 0.4,
        weighting: str = "windows",
        keys: Iterable[str] | None = None,
        stack: Mapping[str, int] | None = None,
        stack_pad: str = "first",
    ) -> Batch:
        """``[num_slices, slice_len]`` windows of consecutive rows of one episode:
        ``sample(num_slices, sampler=samplers.Slices(slice_len, strict, weighting))``,
        or ``samplers.PrioritizedSlices(slice_len, beta, strict)`` when prioritized.

        ``strict=True``: every valid window (inside one live episode) is equally
        likely: an episode of ``n >= L`` rows offers ``n - L + 1`` starts, shorter
        ones none. ``strict=False``: every row may start a window; the window is
        cut at its episode's end and padded to ``L`` (padding repeats the index
        of the last real row, its data is zero and ``mask`` is False there).
        ``weighting="episodes"`` draws the episode uniformly first, then a start
        inside it (TorchRL's SliceSampler convention). ``prioritized=True``: a
        window's probability is proportional to the priority of its start row
        among valid starts (invalid starts have probability exactly 0).
        ``stack``, ``stack_pad``: as in ``sample``; a stacked column is ``[B, L, k, ...]``.
        """
        spec = samplers.resolve(None, slice_len, prioritized=prioritized, beta=beta, strict=strict, weighting=weighting)
        return self._draw(spec, check_int("num_slices", num_slices, 1), generator, keys, stack, stack_pad)

    @locked
    def indices(self, sampler: Sampler, n: int, generator: torch.Generator | None = None) -> samplers.Draw:
        """The index half of sampling with any spec: numpy ``(rows, weights, mask or None, lane cursors)``."""
        n = check_int("n", n, 1)
        spec = self._route(samplers.resolve(sampler))
        spec.check(self)
        drawn = spec.plan(self, n, generator, self._sampler_state)(np.arange(n))
        return samplers.Draw(*drawn[:3], drawn.written.copy())  # the caller's (the view's is read-only)

    def sample_indices(self, batch_size: int, generator: torch.Generator | None = None, *, prioritized: bool = False,
                       beta: float = 0.4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The index half of ``sample``: ``(rows [B], weights [B], lane cursors)``."""
        spec = samplers.resolve(None, prioritized=prioritized, beta=beta)
        rows, weights, _, written = self.indices(spec, check_int("batch_size", batch_size, 1), generator)
        return rows, weights, written

    def slice_indices(self, num_slices: int, slice_len: int, strict: bool = True, generator: torch.Generator | None = None,
                      *, prioritized: bool = False, beta: float = 0.4, weighting: str = "windows",
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The index half of ``sample_slices``: ``(rows [B, L], weights [B], mask [B, L], lane cursors)``."""
        spec = samplers.resolve(None, slice_len, prioritized=prioritized, beta=beta, strict=strict, weighting=weighting)
        rows, weights, mask, written = self.indices(spec, check_int("num_slices", num_slices, 1), generator)
        assert mask is not None  # slices always have a mask
        return rows, weights, mask, written

    def _draw(
        self, spec: Sampler, n: int, generator: torch.Generator | None, keys: Iterable[str] | None,
        stack: Mapping[str, int] | None = None, stack_pad: str = "first",
    ) -> Batch:
        names = resolve_keys(self._store, keys)
        stacks = frames.check(stack, stack_pad, self._store.columns)
        spec = self._route(spec)
        spec.check(self)
        return self._remember(read_spec(self, spec, n, generator, self._sampler_state, names, stacks))

    # -- helpers -----------------------------------------------------------------------
    def read_batch(
        self,
        draw: Callable[[np.ndarray], Draw],
        size: int,
        names: list[str],
        *,
        out: Mapping[str, torch.Tensor] | None = None,
        recheck: bool | None = None,
        stack: frames.Stacks | None = None,
    ) -> Batch:
        """Gather the rows that ``draw`` picks for batch positions ``arange(size)``.

        ``draw(positions)`` returns ``(rows, weights, mask or None, lane cursors)``
        for those positions, from the store's current ``view()`` (a sampler, or a
        rank lookup). In a reader the copy is re-checked against the writer and
        what it may have rewritten meanwhile is drawn and read again
        (``mmbuffer._read.recheck``). Padded window positions read as zeros.
        ``out``: caller tensors the columns are gathered into. ``recheck=True``
        gathers without holding the store's lock and re-checks the items as a
        reader does, also in the writer's process (``mb.stream``'s parallel
        workers: their gathers run beside each other and beside ``extend``).
        ``stack``: frame stacks (``mmbuffer._read.frames``).
        """
        return self._remember(read_batch(self._store, draw, size, names, out=out, recheck=bool(recheck), stack=stack))

    def _remember(self, batch: Batch) -> Batch:
        if self.priorities is not None:
            with self.lock:  # stream workers read batches concurrently
                self._sampled.remember(batch.indices, batch.written_at)
        return batch

    def _route(self, spec: Sampler) -> Sampler:
        """``spec`` as this buffer draws it: through a remote store's chunk pool."""
        return spec if self._source is None else self._source.route(spec)
