"""The chunk pool: whole blocks of a remote store fetched in the background onto local disk.

Rows are grouped in *blocks* of ``block_rows`` consecutive global rows (a whole
number of every column's chunks, about ``PoolConfig.block_bytes`` decoded over the
data columns, so a refill is a few large reads). The live blocks of the snapshot are
put in a random order keyed by ``(seed, epoch)``, the same on every process; the
process that is shard ``index`` of ``count`` ((rank, DataLoader worker) pairs) takes
every ``count``-th block from position ``index``: shards read disjoint blocks, and
together they visit every live block once per epoch (a store of fewer live blocks
than shards cannot be split: shard ``index`` then reads block ``index mod n``). A shard holds ``blocks`` of its
blocks (decoded, in a file under the cache directory, read like a memory map) and
fetches the next ``prefetch`` in background threads (two blocks at a time). Every ``rotate_every`` draws
the oldest block leaves and the next one in the order enters; the draw waits for it
if it is not fetched yet, so what a shard holds at its ``k``-th draw depends only on
``(seed, epoch, index, count, k)``, never on timing.

How this changes the sampling distribution (against i.i.d. over the whole store):
a draw is the sampler's own distribution *conditioned on the pool*: items (a
transition, or a whole window) whose rows all lie in held blocks keep their relative
probabilities, every other item has probability 0 for that draw
(:class:`PooledSampler` draws from the full sampler and keeps what the pool holds).
Over an epoch every item gets its turn, but draws close in time are correlated
(they share ``blocks`` blocks, a few contiguous stretches of a few episodes), like
a shuffle buffer. A window that crosses a block boundary is drawable only while both
blocks are held. Importance weights are those of the full distribution. Use
``pool=None`` for the exact distribution (on-demand chunk reads, slow).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import errors
from .._disk.columns.remote import RemoteArray
from .._ledger.snapshot import Draw, ReadableStore, View
from ..samplers import Sampler, SamplerState
from ._cache import Cache, disk_errors, reserved_file
from ._verified import ChunkRows

__all__ = ["ChunkPool", "PoolConfig", "PooledSampler"]

_MAX_ROUNDS = 64
_MAX_DRAW = 1 << 20


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """How a remote store is sampled: a rotating pool of whole blocks (module docstring).

    >>> PoolConfig(blocks=4).blocks
    4
    >>> PoolConfig(blocks=0)
    Traceback (most recent call last):
    ...
    mmbuffer.errors.InvalidArgumentError: pool.blocks: expected an integer >= 1, got 0
    """

    blocks: int = 8
    block_bytes: int = 16 << 20
    rotate_every: int = 32
    prefetch: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("blocks", 1), ("block_bytes", 1), ("rotate_every", 1), ("prefetch", 0), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise errors.InvalidArgumentError(f"pool.{name}: expected an integer >= {low}, got {value!r}")


class ChunkPool:
    """The blocks one shard holds; serves rows to :class:`RemoteArray` (``RowSource``)."""

    def __init__(self, columns: dict[str, RemoteArray], snapshot: View, capacity: int, config: PoolConfig,
                 directory: Path, cache: Cache, readers: Mapping[str, ChunkRows] | None = None) -> None:
        self.config = config
        self.columns = columns
        self._readers = dict(readers or {})  # columns whose blocks are fetched as one batch and decoded in place
        self.capacity = capacity
        unit = max(c.chunk_rows for c in columns.values())
        row_bytes = sum(max(1, int(np.prod(c.row_shape, dtype=np.int64))) * c.dtype.itemsize for c in columns.values())
        self.block_rows = int(min(max(1, config.block_bytes // (row_bytes * unit)) * unit, -(-capacity // unit) * unit))
        self.num_blocks = -(-capacity // self.block_rows)
        self.live = _live_blocks(snapshot, self.block_rows)
        self.live_rows = max(1, sum(int(lv.visible_end - lv.first_start) for lv in snapshot.lanes))
        self.shard = (0, 1)
        self.epoch = 0
        self.draws = 0
        self._skip = 0
        self.fetched_bytes = 0
        self._cache = cache
        self._reserved = 0
        with disk_errors(cache.base, 0):
            directory.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix="pool-", dir=directory))
        self._pin = cache.pin(self._dir / ".pin", exclusive=True)  # eviction leaves a live pool alone
        self._slot_of = np.full(self.num_blocks, -1, dtype=np.int64)
        self._maps: dict[str, np.ndarray] = {}
        # two blocks fetched at once: one's requests are in flight while the other decodes
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mmbuffer-pool")
        self._lock = threading.Lock()
        self._started = False

    # -- order ---------------------------------------------------------------------------
    def order(self, epoch: int) -> np.ndarray:
        """This shard's blocks of ``epoch``, in the order they enter the pool."""
        index, count = self.shard
        perm = np.random.default_rng([self.config.seed, epoch]).permutation(self.live)
        if 0 < len(perm) < count:  # fewer blocks than shards: they cannot be disjoint
            return perm[[index % len(perm)]]
        return perm[index::count]

    def set_shard(self, index: int, count: int, *, epoch: int = 0, draws: int = 0) -> None:
        """Become shard ``index`` of ``count``, from ``epoch``; the pool refills lazily.
        ``draws``: start as the pool is after that many draws (a resumed pass: the
        blocks it holds then, not those before)."""
        if not (0 <= index < count):
            raise errors.InvalidArgumentError(f"shard: expected 0 <= index < count, got ({index}, {count})")
        self._stop()
        self.shard, self.epoch, self.draws = (index, count), epoch, 0
        self._skip = draws
        self._started = False

    # -- life cycle ----------------------------------------------------------------------
    def _start(self) -> None:
        self._seq = self.order(self.epoch)
        if len(self._seq) == 0:
            raise errors.EmptyBufferError(
                f"pool: expected at least one live block, got none (an empty snapshot: {len(self.live)} live blocks)"
            )
        self._pos = 0
        held = min(self.config.blocks, len(self._seq))
        slots = held + (self.config.prefetch if len(self._seq) > held else 0)
        if self._skip and slots > held:  # a resumed pass: the blocks rotated in by its earlier draws
            turns = (self._skip - 1) // self.config.rotate_every
            self.epoch += turns // len(self._seq)
            self._seq, self._pos = self.order(self.epoch), turns % len(self._seq)
        self._unmap()
        shapes = {name: (slots * self.block_rows, *col.row_shape) for name, col in self.columns.items()}
        sizes = {name: int(np.prod(shape, dtype=np.int64)) * self.columns[name].dtype.itemsize
                 for name, shape in shapes.items()}

        def allocate() -> None:  # allocated before mapped: a full disk never faults a map
            try:
                for name in self.columns:
                    reserved_file(self._dir / f"{name}.bin", sizes[name], self._cache.base)
            except BaseException:
                for path in self._dir.glob("*.bin"):
                    path.unlink()
                raise

        self._cache.admit(sum(sizes.values()), allocate)  # within cache_limit, or a CacheError naming it
        self._reserved = sum(sizes.values())
        for name, col in self.columns.items():
            self._maps[name] = np.memmap(self._dir / f"{name}.bin", mode="r+", dtype=col.dtype, shape=shapes[name]) \
                if sizes[name] else np.zeros(shapes[name], dtype=col.dtype)
        self._slot_of[:] = -1
        self._free = deque(range(slots))
        self._pending: deque[tuple[int, int, Future[None]]] = deque()
        self._held: deque[tuple[int, int]] = deque()
        for _ in range(slots):
            self._submit()
        for _ in range(held):
            self._promote()
        self._started = True

    def _next_block(self) -> int:
        if self._pos == len(self._seq):
            self.epoch += 1
            self._seq, self._pos = self.order(self.epoch), 0
        self._pos += 1
        return int(self._seq[self._pos - 1])

    def _submit(self) -> None:
        block, slot = self._next_block(), self._free.popleft()
        self._pending.append((block, slot, self._executor.submit(self._fetch, block, slot)))

    def _promote(self) -> None:
        block, slot, future = self._pending.popleft()
        future.result()  # waits: the pool's content never depends on timing
        self._slot_of[block] = slot
        self._held.append((block, slot))

    def _fetch(self, block: int, slot: int) -> None:
        start = block * self.block_rows
        stop = min(start + self.block_rows, self.capacity)
        at = slot * self.block_rows
        for name, reader in self._readers.items():  # every column's requests in flight before the first decodes
            reader.ahead(np.arange(start, stop, self.columns[name].chunk_rows, dtype=np.int64))  # a row per chunk
        left = dict(self._readers)
        try:
            for name, col in self.columns.items():
                into = self._maps[name][at : at + stop - start]
                if name in left:
                    left.pop(name).read_into(start, stop, into)
                else:
                    into[...] = col.read_block(start, stop)
                with self._lock:
                    self.fetched_bytes += into.nbytes
        except BaseException:
            for reader in left.values():  # the columns not read yet: their fetches awaited and dropped
                reader.abandon(start, stop)
            raise

    def advance(self) -> None:
        """One draw: start the pool, or every ``rotate_every`` draws rotate one block."""
        if not self._started:
            self._start()
            if not self._skip:
                return
            self.draws, self._skip = self._skip - 1, 0  # then this draw counts as draw number _skip
        self.draws += 1
        if self.draws % self.config.rotate_every or not self._pending:
            return
        block, slot = self._held.popleft()
        if self._slot_of[block] == slot:
            self._slot_of[block] = -1
        self._promote()
        self._free.append(slot)
        self._submit()

    def _stop(self) -> None:
        if self._started:
            for _, _, future in self._pending:
                future.cancel()
            for _, _, future in self._pending:
                if not future.cancelled():
                    future.exception()
            self._slot_of[:] = -1
            self._unmap()

    def _unmap(self) -> None:
        self._maps.clear()

        def drop() -> None:
            for path in self._dir.glob("*.bin"):
                path.unlink()

        self._cache.remove(drop, self._reserved)
        self._reserved = 0

    def close(self) -> None:
        self._stop()
        self._started = False
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._unmap()
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._pin >= 0:
            os.close(self._pin)
            self._pin = -1

    # -- reading -------------------------------------------------------------------------
    def held_blocks(self) -> list[int]:
        """The blocks sampleable now, oldest first."""
        return [b for b, s in self._held if self._slot_of[b] == s] if self._started else []

    def holds(self, rows: np.ndarray) -> np.ndarray:
        """Whether each row lies in a held block."""
        found: np.ndarray = self._slot_of[np.asarray(rows, dtype=np.int64) // self.block_rows] >= 0
        return found

    def fraction(self) -> float:
        """About the share of live rows the pool holds (to size the rejection draws)."""
        return min(1.0, len(self._held) * self.block_rows / self.live_rows)

    def release(self) -> None:
        """Nothing: the held blocks are files under the cache directory (page cache)."""

    def ahead(self, rows: np.ndarray) -> None:
        """Nothing: the pool fetches blocks in its own order, never for a batch."""

    def serve(self, name: str, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` at the rows the pool holds; return that mask (``RowSource``)."""
        if not self._started or name not in self._maps:
            return np.zeros(len(rows), dtype=bool)
        slots = self._slot_of[rows // self.block_rows]
        ok: np.ndarray = slots >= 0
        if ok.any():
            out[ok] = self._maps[name][slots[ok] * self.block_rows + rows[ok] % self.block_rows]
        return ok


def _live_blocks(snapshot: View, block_rows: int) -> np.ndarray:
    """The blocks that hold at least one sampleable row of ``snapshot``."""
    found = []
    for lane, lv in enumerate(snapshot.lanes):
        for a, b in snapshot.layout.segments(lane, lv.first_start, lv.visible_end):
            if b > a:
                found.append(np.arange(a // block_rows, (b - 1) // block_rows + 1))
    return np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class PooledSampler(Sampler):
    """``inner``'s distribution conditioned on the rows ``pool`` holds (module docstring)."""

    inner: Sampler
    pool: ChunkPool = field(repr=False)

    @property
    def slices(self) -> bool:  # type: ignore[override]
        return self.inner.slices

    def check(self, store: ReadableStore) -> None:
        self.inner.check(store)

    def indices(self, snapshot: View, n: int, generator: torch.Generator | None, state: SamplerState) -> Draw:
        self.pool.advance()
        frac = self.pool.fraction()
        rows_out, w_out, m_out = [], [], []
        need = n
        written = None
        for _ in range(_MAX_ROUNDS):
            k = min(_MAX_DRAW, max(2 * need, math.ceil(need / max(frac, 1e-9) * 1.25) + 16))
            rows, weights, mask, written = self.inner.indices(snapshot, k, generator, state)
            keep = np.flatnonzero(self.pool.holds(rows.reshape(k, -1)).all(axis=1))[:need]
            rows_out.append(rows[keep])
            w_out.append(weights[keep])
            if mask is not None:
                m_out.append(mask[keep])
            need -= len(keep)
            if need == 0:
                assert written is not None
                return Draw(np.concatenate(rows_out), np.concatenate(w_out),
                            np.concatenate(m_out) if m_out else None, written)
        raise errors.EmptyBufferError(
            f"pool: expected items inside the {len(self.pool.held_blocks())} held blocks, got {n - need} of {n} "
            f"in {_MAX_ROUNDS} rounds of draws (windows longer than a block of {self.pool.block_rows} rows, "
            "or blocks holding no sampleable item: raise PoolConfig.block_bytes or blocks)"
        )
