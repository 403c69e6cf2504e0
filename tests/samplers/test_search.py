"""The slice index: its batched search (``kernels.sampling._search_right_many``), every
item's answer ``np.searchsorted(a, x, side="right")`` for empty, tiny and large arrays,
repeated values and targets outside the range; and ``slice_rows``, every slice where the
episodes lie, whatever the lane's wrap."""

from __future__ import annotations

import numpy as np
import pytest

from mmbuffer.kernels.sampling import _search_right_many


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 64, 1000, 12_345])
def test_each_answer_is_numpys_searchsorted_right(n):
    rng = np.random.default_rng(n)
    a = np.cumsum(rng.integers(0, 3, n)).astype(np.int64)  # sorted, with runs of equal values
    top = int(a[-1]) if n else 0
    xs = rng.integers(-2, top + 3, 700).astype(np.int64)
    out = np.full(700, -1, np.int64)
    _search_right_many(a, xs, out)
    assert np.array_equal(out, np.searchsorted(a, xs, side="right"))


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
    start, avail = np.full(200, -1, np.int64), np.full(200, -1, np.int64)
    slice_rows(lane_of, local, lane, counts, cum_base, lane_size,
               (ep_head, ep_tail, first_start, open_start, visible_end, closed),
               slice_len, np.zeros(0, np.int64), True, rows, mask, start, avail)
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
        at = want_start + np.minimum(np.arange(slice_len), want_end - want_start - 1)
        assert np.array_equal(rows[i], lane * lane_size + at % lane_size)
        assert np.array_equal(mask[i], np.arange(slice_len) < want_end - want_start)
    assert (rows[~mine] == -1).all()
