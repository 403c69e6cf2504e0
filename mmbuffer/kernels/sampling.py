"""Index sampling kernels: random bits to rows in one compiled pass per batch.

The random numbers are drawn by the caller with torch (``mmbuffer.samplers._draw``), the
same way and in the same order as before these kernels existed, so the same
generator state still gives the same batch; the kernels only map them to rows,
with the arithmetic of ``mmbuffer.samplers._draw`` (``_lane_of``, ``_starts_in_lane``,
``window``) and of ``mmbuffer._ledger.layout`` (``Layout.rows``) written out per item.

>>> import numpy as np
>>> out = np.empty(3, np.int64)
>>> uniform_rows(np.array([0, 4, 5]), np.array([4, 2]), np.array([10, 3]), 8, out).tolist()
[2, 11, 12]
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from .intrinsics import prefetch as _prefetch

__all__ = ["fill_buckets", "slice_rows", "uniform_rows"]


@numba.njit(nogil=True, cache=True)
def _search_right(a: Any, x: int, lo: int, hi: int) -> int:
    """``np.searchsorted(a, x, side="right")`` for a sorted int64 array whose answer
    is known to lie in ``[lo, hi]`` (``0, len(a)``: anywhere)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@numba.njit(nogil=True, cache=True)
def _search_guided(a: Any, guide: Any, shift: int, xs: Any, out: Any) -> None:
    """``out[i] = np.searchsorted(a, xs[i], side="right")`` for every ``i``, from a guide
    (``fill_buckets``): the answer for ``x`` in bucket ``b = (x - a[0]) >> shift`` lies in
    ``[guide[b], guide[b + 1]]`` (``len(a)`` past the last bucket), so a search is two
    dependent loads (its bucket, then a few counts of one or two cache lines) where a
    binary search over a 1e9-row store's 1e6 episode counts made ~8 cache misses. Every
    bucket is loaded first, all together, and the counts each one names prefetched as it
    arrives (from the one before its first: a caller reading the found episode's start
    reads it), so the misses of both loads overlap across the batch (the search's
    branches would otherwise wait for each count in turn)."""
    m = xs.shape[0]
    n = a.shape[0]
    g = guide.shape[0]
    hi = np.empty(m, np.int64)
    c0 = a[0] if n else 0
    for i in range(m):
        b = (xs[i] - c0) >> shift if xs[i] >= c0 else -1
        if b < 0:  # before the first bucket (only outside the counts' range)
            out[i] = 0
            hi[i] = guide[0] if g else n
        elif b >= g:  # past the last
            out[i] = guide[g - 1] if g else 0
            hi[i] = n
        else:
            out[i] = guide[b]
            hi[i] = guide[b + 1] if b + 1 < g else n
            _prefetch(a, out[i] - 1)
            _prefetch(a, hi[i])
    for i in range(m):
        out[i] = _search_right(a, xs[i], out[i], hi[i])


@numba.njit(nogil=True, cache=True)
def _fill_buckets(a: Any, shift: int, out: Any, first: int, stop: int) -> None:
    k = out[first - 1] if first > 0 else 0
    n = a.shape[0]
    for b in range(first, stop):
        start = a[0] + (b << shift)
        while k < n and a[k] <= start:
            k += 1
        out[b] = k


@numba.njit(nogil=True, cache=True)
def _uniform_rows(bits: Any, counts: Any, first: Any, lane_size: int, out: Any) -> None:
    lanes = counts.shape[0]
    cum = np.empty(lanes, np.int64)
    total = 0
    for l in range(lanes):
        total += counts[l]
        cum[l] = total
    for i in range(bits.shape[0]):
        u = bits[i] % total
        lane = _search_right(cum, u, 0, lanes)
        absolute = first[lane] + u - (cum[lane] - counts[lane])
        out[i] = lane * lane_size + absolute % lane_size


@numba.njit(nogil=True, cache=True)
def _slice_rows(
    lane_of: Any, local: Any, lane: int, counts: Any, guide: Any, shift: int, cum_base: int, lane_size: int,
    ep_head: int, ep_tail: int, first_start: int, open_start: int, visible_end: int, closed: int,
    slice_len: int, offsets: Any, strict: bool, rows: Any, mask: Any, start_out: Any, avail_out: Any, last_out: Any,
) -> None:
    cum = counts[:, 0]
    c0 = cum[ep_head - cum_base]
    # the items of this lane in complete episodes: searched all together (``_search_guided``)
    n = local.shape[0]
    mine = np.zeros(n, np.bool_)
    count = 0
    for i in range(n):
        mine[i] = (lane_of.shape[0] == 0 or lane_of[i] == lane) and local[i] < closed
        count += mine[i]
    xs = np.empty(count, np.int64)
    q = 0
    for i in range(n):
        if mine[i]:
            xs[q] = local[i] + c0
            q += 1
    found = np.empty(count, np.int64)
    _search_guided(cum, guide, shift, xs, found)
    # then their episodes' ends, beside the counts the search just read (the same cache
    # line, most often), in a loop of their own: a short loop keeps many loads in flight
    starts = np.empty(count, np.int64)
    avails = np.empty(count, np.int64)
    newest = ep_tail - 1 - cum_base
    for q in range(count):
        k = min(found[q] - 1, newest)
        ep_start = first_start if k + cum_base == ep_head else counts[k, 1]
        starts[q] = ep_start + (xs[q] - cum[k])
        avails[q] = counts[k + 1, 1] - starts[q]
    base = lane * lane_size
    first_at = first_start % lane_size
    q = 0
    for i in range(n):
        if lane_of.shape[0] and lane_of[i] != lane:
            continue
        r = local[i]
        if r >= closed:  # the open episode
            start = open_start + (r - closed)
            avail = visible_end - start
        else:
            start = starts[q]
            avail = avails[q]
            q += 1
        if offsets.shape[0]:  # per-episode weighting: the episode is drawn, now a start inside it
            room = max(avail - slice_len + 1, 1) if strict else avail
            off = offsets[i] % room
            start += off
            avail -= off
        start_out[i] = start
        avail_out[i] = avail
        last_out[i] = avail - 1 if r < closed and avail <= rows.shape[1] else -1
        last = max(avail - 1, 0)
        at = first_at + (start - first_start)  # ``start % lane_size`` for a live row
        if at >= lane_size:
            at -= lane_size
        if at < 0 or at >= lane_size:
            at = start % lane_size
        for j in range(rows.shape[1]):
            a = at + min(j, last)
            rows[i, j] = base + (a - lane_size if a >= lane_size else a)
            mask[i, j] = j < avail


def fill_buckets(a: np.ndarray, shift: int, out: np.ndarray, first: int, stop: int) -> None:
    """The guide ``_search_guided`` reads, buckets ``first`` to ``stop``: ``out[b] =
    np.searchsorted(a, a[0] + (b << shift), side="right")``, in one walk of ``a`` from
    where bucket ``first - 1`` ended (O(buckets + values passed)).

    >>> out = np.zeros(3, np.int32)
    >>> fill_buckets(np.array([0, 3, 3, 9]), 2, out, 0, 3)
    >>> out.tolist()
    [1, 3, 3]
    """
    _fill_buckets(a, shift, out, first, stop)


def uniform_rows(bits: np.ndarray, counts: np.ndarray, first: np.ndarray, lane_size: int, out: np.ndarray) -> np.ndarray:
    """Global rows of uniformly drawn transitions into ``out``: ``bits % sum(counts)``
    is a rank over the lanes' ``counts`` sampleable rows (lane order), each lane's
    starting at its absolute row ``first`` (the lanes are rings of ``lane_size``)."""
    _uniform_rows(bits, counts, first, lane_size, out)
    return out


def slice_rows(
    lane_of: np.ndarray,
    local: np.ndarray,
    lane: int,
    counts: np.ndarray,
    guide: tuple[np.ndarray, int],
    cum_base: int,
    lane_size: int,
    bounds: tuple[int, int, int, int, int, int],
    slice_len: int,
    offsets: np.ndarray,
    strict: bool,
    rows: np.ndarray,
    mask: np.ndarray,
    start: np.ndarray,
    avail: np.ndarray,
    last: np.ndarray,
) -> None:
    """Slices of the items ``i`` of ``lane`` (all items when ``lane_of`` is empty,
    else those with ``lane_of[i] == lane``) from their in-lane ranks ``local``.

    ``counts[k]`` is ``(cum, end)``: the eligible starts in the lane's episodes
    ``cum_base .. cum_base + k - 1`` together, and the end row of the last of them,
    which is where episode ``cum_base + k`` starts (``samplers._counts.SliceCounts``), and
    ``guide`` the buckets of its ``cum`` and their shift (``fill_buckets``);
    ``bounds`` is ``(ep_head, ep_tail, first_start, open_start, visible_end, closed)``:
    the lane's view and its count of items in complete episodes. Writes each item's
    absolute start and rows available from it into ``start``/``avail``, its
    ``[L]`` global rows and mask into ``rows``/``mask`` (positions past ``avail``
    repeat the last available row, masked), and into ``last`` the position of its
    complete episode's last row in the window (-1: not in it, or the episode is open). With ``offsets`` (non-empty: bits,
    one per item) the rank picked an episode and ``offsets % room`` the start in it.
    """
    _slice_rows(lane_of, local, lane, counts, *guide, cum_base, lane_size, *bounds, slice_len, offsets, strict,
                rows, mask, start, avail, last)
