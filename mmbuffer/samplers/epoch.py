"""Without replacement: every item once per epoch, in a keyed order, resumable.

``Epoch(...)`` is ``mb.EpochSampler`` as a spec: each ``buf.sample(n,
sampler=Epoch(...))`` returns the next ``n`` items of the epoch's permutation
(sampleable transitions, or valid strict windows of ``slice_len`` rows; see
``mmbuffer/epoch.py``) and saves the position to ``sampler/<name>.json`` in the
store, so a restarted run goes on where it stopped, and ``mb.EpochSampler`` with
the same name resumes the same position. A batch that reaches the end of an
epoch is filled from the next one (a new permutation, its item count taken
then): batches always hold ``n`` items, and every epoch delivers each item once.
``shard=(i, k)`` takes every ``k``-th item from ``i`` (workers, ranks).
``mb.data.BufferDataset(path, n, sampler=Epoch(...))`` runs in epoch mode with the
shards of its workers and ranks.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/e", {"x": ((), "int64")}, capacity=64, next_keys=())
>>> buf.extend({"x": np.arange(10)})
>>> spec = mb.samplers.Epoch(seed=1)
>>> seen = np.concatenate([buf.sample(5, sampler=spec)["x"].numpy() for _ in range(2)])
>>> sorted(seen.tolist()) == list(range(10)), mb.EpochSampler(buf, 5, seed=1).epoch
(True, 1)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from .._disk import format as fmt
from .. import errors
from .._disk.checks import check_int
from .._ledger.snapshot import Draw, ReadableStore, View
from ._counts import SliceCounts
from .base import Sampler, SamplerState

import mmbuffer.samplers._draw as sampling  # the algorithms (not "from .": that names the package)
from .._disk import files as _files, safe_io as _safe_io
from .._disk.guards import raise_typed

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
        self.counts = SliceCounts(slice_len or 1, True, False)
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
        return int(self.lane_items(view).sum())

    def lane_items(self, view: View) -> np.ndarray:
        """Items of ``view`` per stream (ranks count them stream by stream)."""
        if self.state.slice_len is None:
            return sampling.transition_counts(view).astype(np.int64)
        closed, opened = self.counts.totals(view)
        per_lane: np.ndarray = closed + opened
        return per_lane

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
            return Draw(sampling.rows_at(view, r), weights, None, view.written)
        lane, start, avail = sampling.slice_starts(view, self.counts, r, None)
        rows, mask = sampling.window(view, lane, start, avail, slice_len)
        return Draw(rows, weights, mask, view.written)

    def reset(self) -> None:
        """Forget the position: the next item is the first of epoch 0."""
        st = self.state
        self.state = EpochState(st.seed, 0, 0, -1, st.slice_len, st.shard)

    def save(self) -> None:
        """Write the state; if it cannot be written, go back to the last state saved
        (no batch is delivered or skipped) and raise a typed error.

        Not durable, by design: the position is saved at every batch, and an fsync
        per batch would cost a disk flush each (milliseconds on a real disk). The file
        is replaced atomically (a ``.partial`` renamed over it), so a killed process
        leaves the last position saved: the page cache keeps it. Only a power cut
        or an OS crash can lose it, and what it costs is bounded and typed, never
        wrong data: the file then holds an earlier position (its items are delivered
        again; none is skipped), or, on a filesystem that does not order a file's
        data before its rename (XFS, ext4 ``data=writeback``), no valid state, which
        resuming refuses with ``CorruptStoreError`` naming the file (remove it to
        restart the epoch). The store's data and its commits are not involved:
        nothing of a commit depends on this file."""
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


@dataclass(frozen=True, slots=True)
class Epoch(Sampler):
    """Items without replacement, epoch after epoch (see the module docstring).

    ``slice_len``: None for transitions, else strict windows. ``seed``: the
    permutation key. ``name``: the state file ``sampler/<name>.json`` (a state
    saved there with another seed, ``slice_len`` or shard is refused). ``shard``:
    ``(index, count)``, this process's part of every epoch. The generator passed
    to ``sample`` is not used: the order is the seed's.
    """

    slice_len: int | None = None
    seed: int = 0
    name: str = "default"
    shard: tuple[int, int] = (0, 1)
    stateful = True

    def __post_init__(self) -> None:
        if self.slice_len is not None:
            object.__setattr__(self, "slice_len", check_int("slice_len", self.slice_len, 1))
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 1 << 63:
            raise errors.InvalidArgumentError(f"seed: expected an integer in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))
        fmt.check_column_name(self.name)
        try:
            index, count = (int(self.shard[0]), int(self.shard[1]))
        except (TypeError, ValueError, IndexError):
            index, count = -1, 0
        if count < 1 or not 0 <= index < count or len(self.shard) != 2:
            raise errors.InvalidArgumentError(f"shard: expected (index, count) with 0 <= index < count, got {self.shard!r}")
        object.__setattr__(self, "shard", (index, count))

    @property
    def slices(self) -> bool:  # type: ignore[override]
        return self.slice_len is not None

    def _cursor(self, root: Path | None, state: SamplerState) -> EpochCursor:
        """The buffer's cursor for this spec's state file (loaded from it once, when
        ``root`` is given); a spec that disagrees with it is refused."""
        cur: EpochCursor | None = state.epochs.get(self.name)
        if cur is None:  # without a root: a fresh cursor that saves nothing
            cur = state.epochs[self.name] = EpochCursor(root, self.name, seed=self.seed, slice_len=self.slice_len, shard=self.shard)
        st = cur.state
        if (st.seed, st.slice_len, st.shard) != (self.seed, self.slice_len, self.shard):
            raise errors.InvalidArgumentError(
                f"sampler: expected the seed, slice_len and shard this buffer's epoch {self.name!r} runs with "
                f"({st.seed}, {st.slice_len}, {st.shard}), got {self!r}; use another name"
            )
        return cur

    def plan(self, buf: ReadableStore, n: int, generator: torch.Generator | None, state: SamplerState) -> Callable[[np.ndarray], Draw]:
        cur = self._cursor(Path(buf.path), state)
        ranks = cur.take(n, buf.view())
        cur.save()  # a failed save restores the position and raises: no item is skipped

        def draw(positions: np.ndarray) -> Draw:
            # ranks resolve against the view of now: a reader re-reads overwritten items this way
            resolved: Draw = cur.resolve(buf.view(), ranks[positions])
            return resolved

        return draw

    def indices(self, snapshot: View, n: int, generator: torch.Generator | None, state: SamplerState) -> Draw:
        """The next ``n`` items of ``snapshot`` by the position kept in ``state``
        (nothing is loaded or saved: ``buf.sample`` does that)."""
        cur = self._cursor(None, state)
        resolved: Draw = cur.resolve(snapshot, cur.take(n, snapshot))
        return resolved


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
