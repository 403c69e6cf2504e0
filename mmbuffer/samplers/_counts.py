"""Per-lane counts of eligible slice starts, kept in RAM beside the persisted episode index.

A slice draw maps a rank to the episode holding it: a search over the lane's cumulative
counts. ``LaneCounts`` keeps those counts, each episode's end beside its count, and a
guide of buckets over the counts (``kernels.sampling.fill_buckets``) so that a search
costs two dependent loads whatever the number of episodes.

>>> lc = LaneCounts()
>>> lc.append(np.array([4, 4, 10]), np.array([5, 7, 14]))  # three episodes: 4, 0, 6 starts
>>> lc.cum.tolist(), lc.guide.tolist(), lc.shift  # bucket b: the counts up to item 4 * b
([0, 4, 4, 10], [1, 3, 3], 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .._ledger import index
from .._ledger.snapshot import LaneView, View
from ..kernels import load

_INT32_MAX = np.iinfo(np.int32).max


@dataclass(slots=True)
class LaneCounts:
    """``cum[i]``: eligible items in episodes ``base .. base + i - 1`` of a lane;
    ``ends[i]``: the end row of episode ``base + i - 1`` (where episode ``base + i``
    starts); ``guide[b]``: the counts up to bucket ``b``'s first item, ``cum[0] + (b << shift)``
    (``kernels.sampling.fill_buckets``), for every bucket that starts below ``cum[-1]``.

    ``cum`` and ``ends`` sit side by side in one ``[n, 2]`` buffer, so that the slice
    kernel finds an episode's two ends in the cache lines its search just read. Both
    buffers grow by doubling, so adding an episode costs O(1) amortized (an online
    learner adds one per step), never a copy of all. The buckets are about one episode
    wide (``shift`` from the mean count, one item at least), re-cut when the mean has moved
    by 2x or 4x (a bucket then holds few episodes again, and there are at most about two
    per episode).
    """

    base: int = 0  # episode sequence number of cum[0]
    store: np.ndarray = field(default_factory=lambda: np.zeros((1024, 2), dtype=np.int64))  # cum[0] = 0
    size: int = 1
    shift: int = 0
    buckets: np.ndarray = field(default_factory=lambda: np.zeros(1024, dtype=np.int32))
    covered: int = 0  # buckets in use

    @property
    def counts(self) -> np.ndarray:
        """``[size, 2]``: ``cum`` and ``ends`` side by side (what the kernel reads)."""
        return self.store[: self.size]

    @property
    def cum(self) -> np.ndarray:
        return self.store[: self.size, 0]

    @property
    def guide(self) -> np.ndarray:
        """The buckets in use (what the kernel reads with ``shift``)."""
        return self.buckets[: self.covered]

    @property
    def upto(self) -> int:
        return self.base + self.size - 1

    @property
    def last_end(self) -> int:
        """The end of episode ``upto - 1`` when it was counted."""
        return int(self.store[self.size - 1, 1])

    def append(self, cum: np.ndarray, ends: np.ndarray) -> None:
        need = self._room(len(cum))
        self.store[self.size : need, 0] = cum
        self.store[self.size : need, 1] = ends
        self.size = need
        self._cover(len(cum))

    def append_one(self, weight: int, end: int) -> None:
        """One episode more, of ``weight`` items, ending at row ``end`` (plain integers)."""
        need = self._room(1)
        self.store[self.size] = self.store[self.size - 1, 0] + weight, end
        self.size = need
        self._cover(1)

    def _room(self, count: int) -> int:
        need = self.size + count
        if need > len(self.store):
            grown = np.empty((max(need, 2 * len(self.store)), 2), dtype=np.int64)
            grown[: self.size] = self.counts
            self.store = grown
        return need

    def undo_last(self) -> None:
        """Forget the newest episode (its end was undone; it is counted anew): the
        buckets that start past the counts left go with it."""
        self.size -= 1
        self.covered = min(self.covered, self._needed())

    def drop_front(self, count: int) -> None:
        self.store = self.store[count : self.size].copy()
        self.size -= count
        self.base += count
        self._cut()

    def _span(self) -> int:
        """Items counted from the first count to the last."""
        return int(self.store[self.size - 1, 0] - self.store[0, 0])

    def _needed(self) -> int:
        """Buckets that start below the last count (those an item can fall in)."""
        span = self._span()
        return ((span - 1) >> self.shift) + 1 if span > 0 else 0

    def _cover(self, added: int) -> None:
        """Add the buckets the ``added`` new counts reach; re-cut them all when their width is off."""
        needed = self._needed()
        if self.covered == 0 or needed > 2 * self.size + 1024 or (self.shift and 4 * needed + 1024 < self.size):
            self._cut()
        elif needed > self.covered:
            self._fill(self.covered, needed, added == 1)

    def _cut(self) -> None:
        """Buckets about one episode wide, from the mean count, all built anew."""
        mean = self._span() / max(self.size - 1, 1)
        self.shift = int(np.ceil(np.log2(mean))) if mean > 1 else 0
        self._fill(0, self._needed())

    def _fill(self, first: int, stop: int, after_one: bool = False) -> None:
        """Buckets ``first`` to ``stop``. ``after_one``: the buckets one new count reached,
        each starting at or past the count before it and below the new one, so each holds
        the counts but the new one (no search)."""
        dtype = np.int32 if self.size <= _INT32_MAX else np.int64  # half the cache lines while it fits
        if stop > len(self.buckets) or self.buckets.dtype != dtype:
            grown = np.empty(max(stop, 2 * len(self.buckets)), dtype=dtype)
            grown[:first] = self.buckets[:first]
            self.buckets = grown
        if after_one:
            self.buckets[first:stop] = self.size - 1
        else:
            load("sampling").fill_buckets(self.cum, self.shift, self.buckets, first, stop)
        self.covered = stop


@dataclass(slots=True)
class SliceCounts:
    """Cumulative counts of eligible slice starts per live episode, per lane.

    ``per_episode=False``: an episode of ``n`` rows counts ``max(0, n - L + 1)``
    window starts (strict) or ``n`` (non-strict: every row may start a window).
    ``per_episode=True``: it counts 1 if eligible (TorchRL's convention).
    Kept in RAM, derived incrementally from the persisted index (``LaneCounts``: about
    20 bytes per live episode per slice length in use: the count, the episode's end and
    its bucket of the guide).
    """

    slice_len: int
    strict: bool
    per_episode: bool
    lanes: dict[int, LaneCounts] = field(default_factory=dict)

    def weight(self, lengths: np.ndarray) -> np.ndarray:
        eligible = lengths >= (self.slice_len if self.strict else 1)
        if self.per_episode:
            return eligible.astype(np.int64)
        if self.strict:
            starts: np.ndarray = np.maximum(lengths - self.slice_len + 1, 0)
            return starts
        return lengths

    def sync(self, view: View, lane: int) -> LaneCounts:
        lv = view.lanes[lane]
        lc = self.lanes.get(lane)
        if lc is None or lv.ep_head < lc.base or lv.ep_head > lc.upto or lv.ep_tail < lc.upto:
            lc = self.lanes[lane] = LaneCounts(base=lv.ep_head)
        newest = lc.upto - 1  # the newest episode counted: a writer may have undone its end and
        # set it again later (_ledger/appending.py): then it is counted anew
        if lv.ep_head <= newest:  # its end now: where the view's open episode starts, if still the newest
            if newest == lv.ep_tail - 1:
                end = lv.open_start
            else:
                end = index.end_of(view.ends, lane, view.lane_size, newest)
            if end != lc.last_end:
                lc.undo_last()
        if lv.ep_tail == lc.upto + 1:  # one episode more (an online learner's step): plain integers
            seq = lc.upto
            start = lv.first_start if seq == lv.ep_head else index.end_of(view.ends, lane, view.lane_size, seq - 1)
            lc.append_one(self.weight_of(lv.open_start - start), lv.open_start)  # it ends where the open one starts
        elif lv.ep_tail > lc.upto:
            state = index.Lane(int(view.written[lane]), lv.ep_head, lv.ep_tail, lv.first_start)
            lo = lc.upto
            starts = index.episode_starts(view.ends, lane, view.lane_size, state, lo, lv.ep_tail)
            ends = index.episode_ends(view.ends, lane, view.lane_size, lo, lv.ep_tail)
            lc.append(np.cumsum(self.weight(ends - starts)) + lc.cum[-1], ends)
        drop = lv.ep_head - lc.base
        if drop > 1024 and drop * 2 > lc.size:  # amortized O(1) trimming
            lc.drop_front(drop)
        return lc

    def weight_of(self, n: int) -> int:
        """``weight`` of one episode of ``n`` rows, in plain integers (each draw asks)."""
        if n < (self.slice_len if self.strict else 1):
            return 0
        if self.per_episode:
            return 1
        return n - self.slice_len + 1 if self.strict else n

    def open_weight(self, lv: LaneView) -> int:
        """``weight`` of the open episode's visible rows."""
        return self.weight_of(lv.visible_end - lv.open_start)

    def totals(self, view: View) -> tuple[np.ndarray, np.ndarray]:
        """Per lane: eligible items in complete episodes, and in the open one."""
        closed = np.empty(len(view.lanes), dtype=np.int64)
        opened = np.empty(len(view.lanes), dtype=np.int64)
        for lane, lv in enumerate(view.lanes):
            lc = self.sync(view, lane)
            closed[lane] = lc.cum[lv.ep_tail - lc.base] - lc.cum[lv.ep_head - lc.base]
            opened[lane] = self.open_weight(lv)
        return closed, opened
