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

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from .. import errors
from .._disk.checks import check_int
from .._ledger.snapshot import Draw, View
from .._read import frames
from .._read.frames import Stacks
from .._read.gather import Batch, resolve_keys
from ..buffer import Buffer
from ..samplers.epoch import EpochCursor, shard_size
from .resume import Lanes, remap


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
        self._lanes: Lanes | None = None  # set by restore()

    @property
    def epoch(self) -> int:
        """Completed epochs."""
        return self._cursor.state.epoch

    @property
    def num_items(self) -> int:
        """Items of the current epoch (-1 before it starts)."""
        return self._cursor.state.num_items

    @property
    def position(self) -> int:
        """Items of the current epoch already delivered to this shard."""
        return self._cursor.state.position

    def start(self, view: View) -> Lanes | None:
        """Fix the current epoch's item count from ``view`` if it has not started;
        return ``(first row, items, fingerprint)`` per stream when ``view`` holds
        exactly the epoch's items (else None: the epoch started on another snapshot).
        The fingerprint is a digest of the stored columns at the rows of the stream's
        first and last items (2 items read per stream)."""
        self._cursor.begin(view)
        items = self._cursor.lane_items(view)
        if int(items.sum()) != self._cursor.state.num_items:
            return None
        cum = np.concatenate([[0], np.cumsum(items)])
        prints = self._fingerprints(view, [np.array([cum[i], cum[i + 1] - 1]) for i in range(len(items))])
        return tuple((int(f), int(n), p) for f, n, p in zip(view.first_starts, items, prints))

    def restore(self, epoch: int, position: int, num_items: int, lanes: Lanes | None) -> None:
        """Go to ``position`` of epoch ``epoch`` of ``num_items`` items (saved), whose
        streams were ``lanes`` (:meth:`start`) when it started: on a newer snapshot the
        remaining items are served at the same rows (``_feed/resume.py`` :func:`remap`);
        a snapshot that lost them, or holds other data at their rows (a store rewritten,
        or republished with its rows renumbered), raises ``RowNotLiveError``."""
        st = self._cursor.state
        st.epoch, st.position, st.num_items = epoch, position, num_items
        self._lanes = lanes
        view = self.buf.view()
        if lanes is None:
            if num_items > self._cursor.items(view):
                raise errors.RowNotLiveError(
                    f"{self.buf.path}: resuming an epoch: expected its {num_items} items, got {self._cursor.items(view)}")
        else:
            cum = np.concatenate([[0], np.cumsum([n for _, n, _ in lanes])])
            ends = [self._map_ranks(view, np.array([cum[i], cum[i + 1] - 1])) for i in range(len(lanes))]
            for lane, (old, new) in enumerate(zip(lanes, self._fingerprints(view, ends))):
                if old[2] != new:
                    raise errors.RowNotLiveError(
                        f"{self.buf.path}: resuming an epoch: stream {lane}: expected the data fingerprinted {old[2]!r} "
                        f"at its first and last items, got {new!r}: the store was rewritten or republished with its "
                        "rows renumbered; the rest of this epoch cannot be served (start a new epoch: drop the state)")
        self._cursor.save()

    def _fingerprints(self, view: View, ends: list[np.ndarray]) -> list[str]:
        """A digest of the stored columns at the rows of item ranks ``ends[lane]`` per stream."""
        keys = [k for k in self.buf.columns if k not in ("terminated", "truncated")]
        out = []
        for ranks in ends:
            if len(ranks) == 0 or ranks[-1] < ranks[0]:
                out.append("")
                continue
            rows = np.asarray(self._cursor.resolve(view, ranks).rows)
            data = self.buf.get(torch.from_numpy(rows.reshape(-1)), keys=keys)
            digest = hashlib.blake2b(rows.shape.__repr__().encode(), digest_size=8)
            for k in sorted(data):
                digest.update(data[k].numpy().tobytes())
            out.append(digest.hexdigest())
        return out

    def _map_ranks(self, view: View, ranks: np.ndarray) -> np.ndarray:
        if self._lanes is None:
            return ranks
        first, items = view.first_starts, self._cursor.lane_items(view)
        old = tuple((f, n) for f, n, _ in self._lanes)
        if tuple((int(f), int(n)) for f, n in zip(first, items)) == old:
            return ranks
        return remap(ranks, old, first, items, f"{self.buf.path}: resuming an epoch")

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
        self._lanes = None
        cur.save()

    def _batch(self, ranks: np.ndarray) -> Batch:
        with self.buf.lock:
            # ranks resolve against the view of now: a reader re-reads overwritten items this way
            def draw(p: np.ndarray) -> Draw:
                view = self.buf.view()
                return self._cursor.resolve(view, self._map_ranks(view, ranks[p]))

            return self.buf.read_batch(draw, len(ranks), self.keys, stack=self.stack)
