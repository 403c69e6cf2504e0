"""Sampling without replacement: every item exactly once per epoch, resumable.

An epoch is a keyed pseudo-random permutation of the item ranks ``[0, N)`` (a
Feistel network on the smallest power-of-four domain holding ``N``, with cycle
walking), so its state is four integers, not an ``N``-element shuffled array:
at 346M items a stored permutation would take 2.7 GB. Items are sampleable
transitions (``slice_len=None``) or valid strict windows of ``slice_len`` rows,
ranked in index order (lane, then age); a rank maps to its row through the same
O(log episodes) lookup the samplers use.

The state (seed, epoch, position, N) is saved after every batch to
``sampler/<name>.json`` inside the store (atomic rename, no fsync; this is the one
file a ``mode="r"`` process writes), so a run that restarts continues the same
epoch where it stopped. ``shard=(i, n)`` takes every ``n``-th item of the
permutation starting at ``i``: DataLoader workers and distributed ranks split an
epoch without overlap. The epoch's ``N`` is fixed when the epoch starts; a store
that changes mid-epoch (online writes) keeps the rank space, so exactly-once holds
for stores that are not written during the epoch (offline training).

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/e", {"x": ((), "int64")}, capacity=64, next_keys=())
>>> buf.extend({"x": np.arange(10), "truncated": np.arange(10) == 9})
>>> sampler = mb.EpochSampler(buf, batch_size=4, seed=1)
>>> seen = np.concatenate([b["x"].numpy() for b in sampler])
>>> sorted(seen.tolist()) == list(range(10)), sampler.epoch
(True, 1)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from .._disk import files as _files, safe_io as _safe_io
from .. import errors
from ..samplers import _draw as sampling
from .._disk import format as fmt
from .._disk.checks import check_int
from .._disk.guards import raise_typed
from ..buffer import Buffer
from .._read import frames
from .._read.frames import Stacks
from .._read.gather import Batch, resolve_keys
from ..samplers import Draw
from .._ledger.store import View

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fast, well-mixing bijection of uint64 (wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def permute(positions: np.ndarray, n: int, key: int, rounds: int = 4) -> np.ndarray:
    """The ``key``-th pseudo-random permutation of ``[0, n)`` applied to ``positions``.

    >>> sorted(permute(np.arange(10), 10, key=3).tolist()) == list(range(10))
    True
    """
    half = max(1, ((max(n, 2) - 1).bit_length() + 1) // 2)
    low = np.uint64((1 << half) - 1)
    keys = _mix(np.arange(1, rounds + 1, dtype=np.uint64) + np.uint64(key & 0xFFFFFFFFFFFFFFFF))
    x = np.asarray(positions, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():  # cycle walking: re-permute until inside [0, n); < 4 rounds expected
        v = x[todo]
        left, right = v >> np.uint64(half), v & low
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & low)
        v = (left << np.uint64(half)) | right
        x[todo] = v
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


@dataclass(slots=True)
class EpochState:
    """Where an epoch iteration stands (``num_items`` is -1 before the epoch's start)."""

    seed: int
    epoch: int
    position: int
    num_items: int
    slice_len: int | None
    shard: tuple[int, int]


class EpochCursor:
    """The saved position of one epoch iteration: resumed from, checked against and
    saved to ``sampler/<name>.json`` of the store at ``root`` (None: a cursor that
    neither loads nor saves); the ranks it hands out
    resolve to rows in any view (:meth:`resolve`). ``EpochSampler`` and the
    ``samplers.Epoch`` spec both walk an epoch with one.

    >>> import tempfile, numpy as np, mmbuffer as mb
    >>> buf = mb.create(tempfile.mkdtemp() + "/c", {"x": ((), "int64")}, capacity=16, next_keys=())
    >>> buf.extend({"x": np.arange(5)})
    >>> cur = EpochCursor(buf.path, "c", seed=0, slice_len=None, shard=(0, 1))
    >>> sorted(cur.take(5, buf.view()).tolist()), cur.state.epoch
    ([0, 1, 2, 3, 4], 1)
    """

    def __init__(self, root: Path | None, name: str, *, seed: int, slice_len: int | None, shard: tuple[int, int]) -> None:
        index, count = (int(shard[0]), int(shard[1]))
        if count < 1 or not 0 <= index < count:
            raise errors.InvalidArgumentError(f"shard: expected (index, count) with 0 <= index < count, got {shard!r}")
        fmt.check_column_name(name)
        self.root = root
        self.file = None if root is None else root / "sampler" / f"{name}.json"
        self.counts = sampling.SliceCounts(slice_len or 1, True, False)
        fresh = EpochState(int(seed), 0, 0, -1, slice_len, (index, count))
        self.state = fresh
        old = None if root is None else _load_state(root, f"sampler/{name}.json")
        if old is not None:
            for field in ("seed", "slice_len", "shard"):
                if getattr(old, field) != getattr(fresh, field):
                    raise errors.InvalidArgumentError(
                        f"{field}: expected {getattr(old, field)!r} as saved in {self.file}, got "
                        f"{getattr(fresh, field)!r}; call reset() or use another name"
                    )
            self.state = old
        self.saved = replace(self.state)  # what the file holds (or a fresh state)

    def items(self, view: View) -> int:
        """Items of ``view``: sampleable transitions, or valid strict windows."""
        if self.state.slice_len is None:
            return int(sampling.transition_counts(view).sum())
        closed, opened = self.counts.totals(view)
        return int((closed + opened).sum())

    def begin(self, view: View) -> int:
        """Fix the epoch's item count if it has not started; return this shard's items."""
        st = self.state
        if st.num_items < 0:
            st.num_items = self.items(view)
        if st.num_items == 0:
            raise errors.EmptyBufferError(f"EpochSampler: expected items to iterate, got none (slice_len={st.slice_len})")
        return shard_size(st.num_items, *st.shard)

    def next_ranks(self, take: int) -> np.ndarray:
        """The next ``take`` ranks of this shard's part of the epoch (the position
        stays: the caller advances it once the items are delivered)."""
        st = self.state
        key = int(_mix(np.array([st.seed * 1_000_003 + st.epoch], dtype=np.uint64))[0])
        positions = st.shard[0] + st.shard[1] * np.arange(st.position, st.position + take, dtype=np.int64)
        return permute(positions, st.num_items, key)

    def end_epoch(self) -> None:
        st = self.state
        st.epoch, st.position, st.num_items = st.epoch + 1, 0, -1

    def take(self, n: int, view: View) -> np.ndarray:
        """The next ``n`` ranks, going on into the next epoch when this one runs out
        (whose item count is fixed from ``view`` then). Nothing is saved."""
        parts = []
        while n > 0:
            mine = self.begin(view)
            if mine == 0:
                raise errors.EmptyBufferError(
                    f"Epoch: expected items for shard {self.state.shard}, got none of {self.state.num_items}"
                )
            k = min(n, mine - self.state.position)
            parts.append(self.next_ranks(k))
            self.state.position += k
            n -= k
            if self.state.position == mine:
                self.end_epoch()
        return np.concatenate(parts)

    def resolve(self, view: View, ranks: np.ndarray) -> Draw:
        """The rows of items ``ranks`` in ``view`` (unit weights; a mask for windows).
        A rank past the items of ``view`` (a store that shrank) is clamped to the last."""
        weights = np.ones(len(ranks), dtype=np.float32)
        r = np.minimum(ranks, self.items(view) - 1)
        slice_len = self.state.slice_len
        if slice_len is None:
            return sampling.rows_at(view, r), weights, None, view.written
        lane, start, avail = sampling.slice_starts(view, self.counts, r, None)
        rows, mask = sampling.window(view, lane, start, avail, slice_len)
        return rows, weights, mask, view.written

    def reset(self) -> None:
        """Forget the position: the next item is the first of epoch 0."""
        st = self.state
        self.state = EpochState(st.seed, 0, 0, -1, st.slice_len, st.shard)

    def save(self) -> None:
        """Write the state; if it cannot be written, go back to the last state saved
        (no batch is delivered or skipped) and raise a typed error."""
        if self.root is None or self.file is None:
            return
        try:
            self.file.parent.mkdir(exist_ok=True)
            _files.atomic_write_json(self.file, asdict(self.state), durable=False)
        except OSError as exc:
            for f in fields(EpochState):
                setattr(self.state, f.name, getattr(self.saved, f.name))
            raise_typed(exc, f"EpochSampler: saving its state to {self.file}", self.root,
                        read_only_hint="a sampler's state cannot be saved in a store there")
            raise
        self.saved = replace(self.state)


class EpochSampler:
    """Iterate a store's items without replacement, one epoch per ``for`` loop.

    Parameters
    ----------
    buf:
        An open ``Buffer`` (``mode="r"`` is fine).
    batch_size:
        Items per batch; the epoch's last batch may be smaller.
    slice_len:
        None for transitions, else windows of ``slice_len`` rows inside one
        episode (every valid strict window once).
    seed, name:
        The permutation key, and the state file ``sampler/<name>.json``. A saved
        state with the same name is resumed; one saved with another ``seed``,
        ``slice_len`` or ``shard`` raises ``InvalidArgumentError`` (call ``reset``).
    shard:
        ``(index, count)``: this process's part of every epoch.

    ``buf.sample(n, sampler=mb.samplers.Epoch(...))`` draws the same items batch
    by batch (and runs on into the next epoch instead of a short last batch).
    """

    def __init__(
        self,
        buf: Buffer,
        batch_size: int,
        slice_len: int | None = None,
        *,
        seed: int = 0,
        name: str = "default",
        shard: tuple[int, int] = (0, 1),
        keys: Iterable[str] | None = None,
        stack: Mapping[str, int] | Stacks | None = None,
        stack_pad: str = "first",
    ) -> None:
        self.buf = buf
        self.stack = frames.check(stack, stack_pad, buf.store.columns)  # frame stacks, as Buffer.sample
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.slice_len = None if slice_len is None else check_int("slice_len", slice_len, 1)
        self._cursor = EpochCursor(Path(buf.path), name, seed=seed, slice_len=self.slice_len, shard=shard)
        self.keys = resolve_keys(buf.store, keys)

    @property
    def epoch(self) -> int:
        """Completed epochs."""
        return self._cursor.state.epoch

    @property
    def position(self) -> int:
        """Items of the current epoch already delivered to this shard."""
        return self._cursor.state.position

    def reset(self) -> None:
        """Forget the saved state: the next iteration starts epoch 0."""
        self._cursor.reset()
        self._cursor.save()

    def __len__(self) -> int:
        """Batches left in the current epoch for this shard."""
        st = self._cursor.state
        n = self._cursor.items(self.buf.view()) if st.num_items < 0 else st.num_items
        mine = shard_size(n, *st.shard)
        return -(-(mine - st.position) // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        cur = self._cursor
        mine = cur.begin(self.buf.view())
        while cur.state.position < mine:
            ranks = cur.next_ranks(min(self.batch_size, mine - cur.state.position))
            batch = self._batch(ranks)
            cur.state.position += len(ranks)
            cur.save()
            yield batch
        cur.end_epoch()
        cur.save()

    def _batch(self, ranks: np.ndarray) -> Batch:
        with self.buf.lock:
            # ranks resolve against the view of now: a reader re-reads overwritten items this way
            return self.buf.read_batch(lambda p: self._cursor.resolve(self.buf.view(), ranks[p]), len(ranks), self.keys, stack=self.stack)


def _load_state(root: Path, rel: str) -> EpochState | None:
    """The saved state ``root/rel``, or None; a link on the way, or a file that is
    not a state this class saves, is ``CorruptStoreError`` naming the file."""
    parts = rel.split("/")
    if not all(os.path.lexists(root.joinpath(*parts[:i])) for i in range(1, len(parts))):
        return None  # no state saved yet
    if not _safe_io.lexists(root, rel):  # refuses a link on the way (_save would write through it)
        return None
    obj = _files.read_json_in(root, rel)
    keys = {"seed", "epoch", "position", "num_items", "slice_len", "shard"}

    def ok_int(x: object, low: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and low <= x < 1 << 63

    if not isinstance(obj, dict) or set(obj) != keys:
        raise errors.CorruptStoreError(f"{root / rel}: expected an object with {sorted(keys)}, got {obj!r:.200}")
    shard, slice_len = obj["shard"], obj["slice_len"]
    good = (
        ok_int(obj["seed"], -(1 << 63))
        and ok_int(obj["epoch"], 0)
        and ok_int(obj["position"], 0)
        and ok_int(obj["num_items"], -1)
        and (slice_len is None or ok_int(slice_len, 1))
        and isinstance(shard, list)
        and len(shard) == 2
        and ok_int(shard[1], 1)
        and ok_int(shard[0], 0)
        and shard[0] < shard[1]
    )
    if good and obj["num_items"] >= 0:
        good = obj["position"] <= shard_size(obj["num_items"], shard[0], shard[1])
    elif good:
        good = obj["position"] == 0
    if not good:
        raise errors.CorruptStoreError(
            f"{root / rel}: expected seed, epoch >= 0, 0 <= position <= this shard's items, num_items >= -1, "
            f"slice_len null or >= 1, shard [i, n] with 0 <= i < n; got {obj!r:.300}"
        )
    return EpochState(obj["seed"], obj["epoch"], obj["position"], obj["num_items"], slice_len, (shard[0], shard[1]))


def shard_size(n: int, index: int, count: int) -> int:
    """Items of part ``index`` of ``count`` of ``n`` items (every ``count``-th from ``index``)."""
    return max(0, -(-(n - index) // count))
