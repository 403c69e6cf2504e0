"""The slice index: its batched search guided by buckets of the counts
(``kernels.sampling._search_guided``), every item's answer ``np.searchsorted(a, x,
side="right")`` for empty, tiny and large arrays, repeated values, buckets of any width and
targets outside the range; the buckets a lane's counts keep (``samplers._counts.LaneCounts``)
through appends, undone ends and trims, always those of its counts; and ``slice_rows``, every
slice where the episodes lie, whatever the lane's wrap, and where each holds its complete
episode's last row."""

from __future__ import annotations

import numpy as np
import pytest

from mmbuffer.kernels.sampling import _search_guided, fill_buckets
from mmbuffer.samplers._counts import LaneCounts


def guide_buckets(a: np.ndarray, shift: int) -> np.ndarray:
    """The reference: for every bucket that starts below ``a[-1]``, the values up to its start."""
    if len(a) == 0 or a[-1] <= a[0]:
        return np.zeros(0, np.int64)
    starts = a[0] + (np.arange((int(a[-1] - a[0] - 1) >> shift) + 1) << shift)
    return np.searchsorted(a, starts, side="right")


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 64, 1000, 12_345])
@pytest.mark.parametrize("shift", [0, 1, 4, 9, 40])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_each_answer_is_numpys_searchsorted_right(n, shift, dtype):
    rng = np.random.default_rng(n)
    a = np.cumsum(rng.integers(0, 3, n)).astype(np.int64)  # sorted, with runs of equal values
    a[n // 2 :] += 50 if n else 0  # and a bucket that holds no value, wide ones many
    top = int(a[-1]) if n else 0
    xs = rng.integers(-2, top + 3, 700).astype(np.int64)
    out = np.full(700, -1, np.int64)
    guide = guide_buckets(a, shift).astype(dtype)
    filled = np.full(len(guide), -1, dtype)  # the kernel's buckets, in two pieces
    fill_buckets(a, shift, filled, 0, len(guide) // 3)
    fill_buckets(a, shift, filled, len(guide) // 3, len(guide))
    assert np.array_equal(filled, guide)
    _search_guided(a, guide, shift, xs, out)
    assert np.array_equal(out, np.searchsorted(a, xs, side="right"))


@pytest.mark.parametrize("seed", range(8))
def test_a_lanes_buckets_stay_those_of_its_counts(seed):
    """Episodes short, then long, then short again (so the buckets are re-cut both
    ways), runs of episodes counting nothing, ends undone and the front trimmed: after
    every change the guide is ``guide_buckets`` of the counts at the lane's shift, about
    one bucket per episode, and every search through it is numpy's."""
    rng = np.random.default_rng(seed)
    lc = LaneCounts()
    widths = set()
    for lo, hi in [(1, 4), (2000, 9000), (0, 3), (50, 60)]:
        for _ in range(int(rng.integers(20, 60))):
            k = int(rng.integers(1, 400))
            cum = lc.cum[-1] + np.cumsum(rng.integers(lo, hi, k) * (rng.random(k) < 0.8))
            lc.append(cum, cum + 7)
            if rng.random() < 0.3:
                lc.undo_last()
            if rng.random() < 0.1 and lc.size > 2:
                lc.drop_front(int(rng.integers(1, lc.size)))
            widths.add(lc.shift)
            assert np.array_equal(lc.guide, guide_buckets(lc.cum, lc.shift))
            assert lc.guide.dtype == np.int32 and len(lc.guide) <= 2 * lc.size + 1024
            assert lc.size <= 4 * len(lc.guide) + 1024 or lc.shift == 0  # one item is the narrowest
            xs = rng.integers(int(lc.cum[0]) - 1, int(lc.cum[-1]) + 1, 300).astype(np.int64)
            out = np.empty(300, np.int64)
            _search_guided(lc.cum, lc.guide, lc.shift, xs, out)
            assert np.array_equal(out, np.searchsorted(lc.cum, xs, side="right"))
    assert len(widths) >= 3  # the width moved with the episodes (up and back down)


@pytest.mark.parametrize("seed", range(6))
def test_slice_rows_places_every_slice_in_its_episode_wherever_the_lane_wraps(seed):
    """``slice_rows`` finds a row's place in the lane without a division per item, and an
    episode's ends beside its count; the slices must be those of the episodes as laid
    out, for a lane whose absolute rows have gone round its ring many times, with
    evicted episodes still counted before the head and a head partly evicted."""
    from mmbuffer.kernels.sampling import slice_rows

    rng = np.random.default_rng(seed)
    lane_size, lane, slice_len = int(rng.integers(40, 90)), int(rng.integers(0, 3)), int(rng.integers(1, 6))
    lengths = rng.integers(1, 9, 30)
    lengths = lengths[np.cumsum(lengths) <= lane_size - 8]  # the live episodes, then an open one of 8
    ep_head = int(rng.integers(1, 10**6))
    ep_tail = ep_head + len(lengths)
    # many times round the ring, and it wraps inside the live window
    first_start = int(rng.integers(1, 40)) * lane_size + lane_size - int(lengths.sum()) // 2
    starts = first_start + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    eligible = np.maximum(lengths - slice_len + 1, 0)
    cum_base = ep_head - 2  # two evicted episodes still counted before the head
    counts = np.empty((len(lengths) + 3, 2), np.int64)
    counts[:, 0] = np.concatenate([[0, 3, 5], 5 + np.cumsum(eligible)])
    counts[:, 1] = np.concatenate([[-7, -5, first_start - 2], starts + lengths])  # the head's own start is
    # ``first_start`` (its first rows evicted), not the end of the episode before it
    closed = int(eligible.sum())
    open_start = first_start + int(lengths.sum())
    visible_end = open_start + 8
    local = rng.integers(0, closed + 8, 200).astype(np.int64)
    lane_of = rng.integers(0, 3, 200).astype(np.int64)
    rows = np.full((200, slice_len), -1, np.int64)
    mask = np.zeros((200, slice_len), bool)
    start, avail, last = np.full(200, -1, np.int64), np.full(200, -1, np.int64), np.full(200, -7, np.int64)
    slice_rows(lane_of, local, lane, counts, (guide_buckets(counts[:, 0], 1), 1), cum_base, lane_size,
               (ep_head, ep_tail, first_start, open_start, visible_end, closed),
               slice_len, np.zeros(0, np.int64), True, rows, mask, start, avail, last)
    mine = lane_of == lane
    assert (visible_end - 1) % lane_size < first_start % lane_size
    assert mine.sum() > 40 and (local[mine] < closed).any() and (local[mine] >= closed).any()
    for i in np.flatnonzero(mine):
        r = int(local[i])
        if r < closed:
            e = int(np.searchsorted(np.cumsum(eligible), r, side="right"))
            want_start = int(starts[e]) + r - int(np.cumsum(eligible)[e] - eligible[e])
            want_end = int(starts[e] + lengths[e])
        else:
            want_start, want_end = open_start + r - closed, visible_end
        assert (start[i], avail[i]) == (want_start, want_end - want_start)
        ends_here = r < closed and want_end - want_start <= slice_len  # its complete episode's last row
        assert last[i] == (want_end - want_start - 1 if ends_here else -1)
        at = want_start + np.minimum(np.arange(slice_len), want_end - want_start - 1)
        assert np.array_equal(rows[i], lane * lane_size + at % lane_size)
        assert np.array_equal(mask[i], np.arange(slice_len) < want_end - want_start)
    assert (rows[~mine] == -1).all()


def test_buckets_are_not_cut_again_at_every_episode_that_counts_nothing(monkeypatch):
    """Most episodes shorter than the slice (weight 0) make the mean count under one item:
    the buckets are then one item wide and stay so, not cut anew (O(episodes)) at each
    episode added, which made an online loop quadratic."""
    cuts = []
    cut = LaneCounts._cut
    monkeypatch.setattr(LaneCounts, "_cut", lambda self: (cuts.append(self.size), cut(self))[1])
    rng = np.random.default_rng(0)
    lc = LaneCounts()
    for _ in range(5000):
        lc.append_one(int(rng.random() < 0.05), int(lc.last_end) + 3)
    assert lc.shift == 0 and 4 * len(lc.guide) + 1024 < lc.size  # a sparse lane: few items
    assert len(cuts) < 20
    xs = np.arange(int(lc.cum[-1]), dtype=np.int64)
    out = np.empty(len(xs), np.int64)
    _search_guided(lc.cum, lc.guide, lc.shift, xs, out)
    assert np.array_equal(out, np.searchsorted(lc.cum, xs, side="right"))
