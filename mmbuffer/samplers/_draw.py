"""Samplers: indices (and probabilities) from the episode index and the priority tree.

Samplers never read column data. Their cost is O(batch * log(episodes)) whatever
the number of stored rows:

* uniform transitions pick a lane by its number of sampleable rows, then a row;
* slices of ``L`` rows use, per lane, the cumulative count of valid window starts
  over its live episodes (``samplers._counts.SliceCounts``), extended only by the
  episodes added since the last call and trimmed from the front as episodes are
  evicted, then a search guided by buckets of those counts for the episode (two
  dependent loads whatever the number of episodes) and an offset inside it;
* prioritized sampling draws a row ``i`` with probability ``p_i / sum(p over the
  sampleable rows)``: rows that are not sampleable in the caller's view (not a
  valid window start, the open episode's last row, a row a reader must not see)
  have probability exactly 0. It first descends the persisted tree
  (``mmbuffer.tree``) and redraws the rows that are not sampleable; when few are,
  it draws the rest from the ranges of sampleable rows, which costs
  O(episodes * log(rows)) for strict windows (see ``prioritized``).

Random numbers come from the caller's ``torch.Generator``: the same generator
state and store give the same indices in any process.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import errors, tree
from .._ledger import index
from .._ledger.snapshot import View
from ..kernels import load
from ._counts import SliceCounts

_REDRAW_ROUNDS = 8  # rejection rounds at most before the exact draw
_MIN_ACCEPT = 0.25  # a lower share of sampleable draws so far switches to the exact draw
_TORN_ROUNDS = 4  # exact draws of a zero leaf (only under a torn concurrent read)


def _randint(high: int | np.ndarray, size: int, generator: torch.Generator | None) -> np.ndarray:
    """Uniform integers in ``[0, high)`` (``high`` scalar or per-sample, >= 1)."""
    out: np.ndarray = _bits(size, generator) % np.asarray(high, dtype=np.int64)  # bias <= high / 2**62
    return out


def _global(view: View, lane: np.ndarray, absolute: np.ndarray) -> np.ndarray:
    return view.layout.rows(lane, absolute)


def _lane_of(counts: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split flat positions ``u`` over lanes holding ``counts`` items each."""
    cum = np.cumsum(counts)
    lane = np.searchsorted(cum, u, side="right")
    return lane, u - (cum[lane] - counts[lane])


# -- uniform transitions ------------------------------------------------------------------
def transition_counts(view: View) -> np.ndarray:
    """Sampleable transitions per lane (the view's own: never write it)."""
    return view.transitions


def rows_at(view: View, ranks: np.ndarray) -> np.ndarray:
    """Global rows of the sampleable transitions of given ranks (lane order, oldest first)."""
    return _rows_of_bits(view, np.asarray(ranks, dtype=np.int64))


def _rows_of_bits(view: View, bits: np.ndarray) -> np.ndarray:
    """Rows of the ranks ``bits % total`` (one compiled pass: ``kernels.sampling``)."""
    rows: np.ndarray = load("sampling").uniform_rows(bits, view.transitions, view.first_starts, view.lane_size, np.empty(bits.shape[0], np.int64))
    return rows


def uniform(view: View, batch_size: int, generator: torch.Generator | None = None) -> np.ndarray:
    """``batch_size`` global rows drawn uniformly over sampleable transitions."""
    if view.total_transitions == 0:
        raise errors.EmptyBufferError("sample: expected a store with sampleable rows, got none")
    return _rows_of_bits(view, _bits(batch_size, generator))


def _bits(size: int, generator: torch.Generator | None) -> np.ndarray:
    """The random integers ``_randint`` reduces modulo its bound."""
    bits = np.empty(size, np.int64)  # ``torch.randint``'s numbers (it is ``random_`` on a new
    torch.from_numpy(bits).random_(0, 2**62, generator=generator)  # tensor), 1 us sooner
    return bits


# -- slices -------------------------------------------------------------------------------
def slice_starts(
    view: View,
    counts: SliceCounts,
    ranks: np.ndarray,
    generator: torch.Generator | None,
    totals: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Map item ranks to slices: (lane, absolute start, rows available from start)."""
    lane, start, avail, _, _, _ = _slice_batch(view, counts, ranks, generator, totals)
    return lane, start, avail


def _slice_batch(
    view: View,
    counts: SliceCounts,
    ranks: np.ndarray,
    generator: torch.Generator | None,
    totals: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Lane, absolute start, rows available, ``[B, L]`` rows and mask of the slices of
    item ranks ``ranks``, and where each window holds its complete episode's last row
    (``-1``: nowhere; ``kernels.sampling.slice_rows``).

    Ranks count items over the lanes in order; inside a lane, ranks below its
    ``closed`` count fall in complete episodes (a search of the cumulative counts guided
    by their buckets), the rest in the open episode. One compiled pass per lane holding
    items (``kernels.sampling.slice_rows``); with per-episode weighting the
    start inside the drawn episode takes one more draw of random bits, after the
    ranks (the order the generator is used in never changed).
    """
    kernels = load("sampling")
    closed, opened = totals if totals is not None else counts.totals(view)
    ranks = np.asarray(ranks, dtype=np.int64)
    n = ranks.shape[0]
    if len(closed) == 1:
        lane, local = np.zeros(n, np.int64), ranks
        lanes: list[int] = [0] if n else []
        lane_of = np.zeros(0, np.int64)  # every item is in lane 0
    else:
        lane, local = _lane_of(closed + opened, ranks)
        lanes = np.flatnonzero(np.bincount(lane, minlength=len(closed))).tolist()
        lane_of = lane
    offsets = _bits(n, generator) if counts.per_episode else np.zeros(0, np.int64)
    start = np.empty(n, np.int64)
    avail = np.empty(n, np.int64)
    rows = np.empty((n, counts.slice_len), np.int64)
    mask = np.empty((n, counts.slice_len), bool)
    last = np.empty(n, np.int64)
    for l in lanes:
        lv = view.lanes[l]
        lc = counts.lanes[l]
        bounds = (lv.ep_head, lv.ep_tail, lv.first_start, lv.open_start, lv.visible_end, int(closed[l]))
        kernels.slice_rows(lane_of, local, l, lc.counts, (lc.guide, lc.shift), lc.base, view.lane_size, bounds,
                           counts.slice_len, offsets, counts.strict, rows, mask, start, avail, last)
    return lane, start, avail, rows, mask, last


def slices(
    view: View,
    counts: SliceCounts,
    num_slices: int,
    generator: torch.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[B, L]`` global rows and ``[B, L]`` mask of uniformly drawn slices, and the
    position of each one's complete episode's last row in it (``-1``: none there)."""
    closed, opened = counts.totals(view)
    total = int((closed + opened).sum())
    if total == 0:
        if view.total_transitions == 0:
            raise errors.EmptyBufferError("sample_slices: expected a store with sampleable rows, got none")
        raise errors.NoValidSliceError(
            f"slice_len: expected at most the longest live episode, got {counts.slice_len} "
            "(no episode is that long; use strict=False to pad)"
        )
    ranks = _randint(total, num_slices, generator)
    _, _, _, rows, mask, last = _slice_batch(view, counts, ranks, generator, (closed, opened))
    return rows, mask, last


def window(
    view: View, lane: np.ndarray, start: np.ndarray, avail: np.ndarray, slice_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Global rows ``[B, L]`` from absolute starts; positions past ``avail`` repeat
    the last available row and are masked out."""
    steps = np.arange(slice_len, dtype=np.int64)
    mask = steps[None, :] < avail[:, None]
    absolute = start[:, None] + np.minimum(steps[None, :], np.maximum(avail[:, None] - 1, 0))
    return _global(view, lane[:, None], absolute), mask


# -- prioritized -------------------------------------------------------------------------
def absolute_rows(view: View, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lane and absolute row counter (as of ``view``) of global rows."""
    return view.layout.lane(rows), view.layout.absolute(rows, view.written)


def sampleable(view: View, rows: np.ndarray, slice_len: int | None, strict: bool) -> np.ndarray:
    """Whether each global row may be drawn (as a transition, or a window start)."""
    lane, a = absolute_rows(view, rows)
    first = np.array([lv.first_start for lv in view.lanes], dtype=np.int64)[lane]
    end = np.array([lv.visible_end for lv in view.lanes], dtype=np.int64)[lane]
    ok: np.ndarray = (a >= first) & (a < end) & (view.written[lane] > 0)
    if slice_len is None or not strict or slice_len == 1:
        return ok
    return ok & (rows_left(view, lane, a) >= slice_len)


def rows_left(view: View, lane: np.ndarray, absolute: np.ndarray) -> np.ndarray:
    """Rows from each absolute row to the end of its episode (visible end if open)."""
    out = np.empty_like(absolute)
    for l in np.unique(lane):
        sel = lane == l
        lv = view.lanes[int(l)]
        ends = index.containing_end(view.ends, int(l), view.lane_size, lv.ep_head, lv.ep_tail, absolute[sel], lv.visible_end)
        out[sel] = ends - absolute[sel]
    return out


def valid_ranges(view: View, slice_len: int | None, strict: bool) -> tuple[np.ndarray, np.ndarray]:
    """Global row ranges ``[lo, hi)`` holding exactly the rows ``sampleable`` accepts.

    Per lane: ``[first_start, visible_end)`` for transitions and non-strict
    windows; for strict windows of ``L > 1`` rows, ``[s, e - L + 1)`` of each
    live complete episode ``[s, e)`` and ``[open_start, visible_end - L + 1)``
    of the open one. A range that wraps the lane's ring is cut in two. O(lanes)
    without a strict ``slice_len``, else O(live episodes).
    """
    lo: list[np.ndarray] = []
    hi: list[np.ndarray] = []
    size = view.lane_size
    for lane, lv in enumerate(view.lanes):
        if view.written[lane] <= 0:
            continue
        if slice_len is None or not strict or slice_len == 1:
            s = np.array([lv.first_start], np.int64)
            e = np.array([lv.visible_end], np.int64)
        else:
            st = index.Lane(int(view.written[lane]), lv.ep_head, lv.ep_tail, lv.first_start)
            starts, lengths = index.starts_lengths(view.ends, lane, size, st)
            s = np.append(starts, lv.open_start).astype(np.int64)
            e = np.append(starts + lengths, lv.visible_end).astype(np.int64) - (slice_len - 1)
        keep = e > s  # live rows span at most one lap
        a, b = view.layout.ranges(lane, s[keep], e[keep])
        lo.append(a)
        hi.append(b)
    if not lo:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(lo), np.concatenate(hi)


def valid_mass(view: View, ptree: tree.PriorityTree, slice_len: int | None, strict: bool) -> float:
    """The priority of the rows ``sampleable`` accepts (what ``exact`` draws over)."""
    lo, hi = valid_ranges(view, slice_len, strict)
    return float(tree.range_sums(ptree, lo, hi).sum()) if lo.shape[0] else 0.0


def _none_valid(slice_len: int | None, ptree: tree.PriorityTree) -> errors.MMBufferError:
    got = f"got none (priority on them 0, on all live rows {tree.total(ptree):g})"
    if slice_len is not None:
        return errors.NoValidSliceError(
            f"slice_len: expected valid starts of windows of {slice_len} rows with positive priority, {got}"
        )
    return errors.EmptyBufferError(f"sample: expected sampleable rows with positive priority, {got}")


def exact(
    view: View,
    ptree: tree.PriorityTree,
    batch_size: int,
    generator: torch.Generator | None = None,
    slice_len: int | None = None,
    strict: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Rows drawn with probability exactly ``p_i / sum(p over sampleable rows)``,
    and their leaves (float64), with no rejection.

    The sampleable rows are the ranges of ``valid_ranges``; their masses come
    from ``tree.range_sums`` (sums of non-negative nodes, never differences of
    running sums, so a range of tiny priority keeps its share), a stratified
    target over their total picks a range by ``searchsorted`` and
    ``tree.find_in_ranges`` the row inside it. Cost O(ranges * 32 log16 N):
    O(lanes log N) for transitions and non-strict windows, O(live episodes
    log N) for strict windows.
    """
    lo, hi = valid_ranges(view, slice_len, strict)
    mass = tree.range_sums(ptree, lo, hi)
    cum = np.cumsum(mass)
    total = float(cum[-1]) if cum.shape[0] else 0.0
    if not total > 0:
        raise _none_valid(slice_len, ptree)
    positive = np.flatnonzero(mass > 0)
    rows = np.empty(batch_size, np.int64)
    values = np.zeros(batch_size, np.float64)
    todo = np.arange(batch_size)
    for _ in range(_TORN_ROUNDS):
        k = todo.shape[0]
        u = torch.rand(k, generator=generator, dtype=torch.float64).numpy()
        target = (u + np.arange(k, dtype=np.float64)) * (total / k)
        r = np.searchsorted(cum, target, side="right")  # cum[r - 1] <= target < cum[r]: mass[r] > 0
        r = np.where(r < cum.shape[0], r, positive[-1])  # rounding past the total: the last range
        before = cum[r] - mass[r]
        rows[todo], leaf = tree.find_in_ranges(ptree, lo[r], hi[r], target - before)
        values[todo] = leaf
        todo = todo[leaf <= 0]  # a zero leaf: a torn read of a tree being written
        if todo.shape[0] == 0:
            return rows, values
    raise _none_valid(slice_len, ptree)


def prioritized(
    view: View,
    ptree: tree.PriorityTree,
    batch_size: int,
    beta: float,
    generator: torch.Generator | None = None,
    slice_len: int | None = None,
    strict: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Rows drawn with probability ``p_i / sum(p over sampleable rows)``, and weights.

    Rows that are not sampleable (see ``sampleable``: not a valid start of a
    window of ``slice_len`` rows, the open episode's last row, a row a reader
    must not see) have probability exactly 0; the call fails only when no
    sampleable row has a positive priority (``NoValidSliceError`` with a
    ``slice_len``, else ``EmptyBufferError``).

    Fast path: stratified draws over the whole tree (O(batch log N)); rows
    that are not sampleable are redrawn, in up to ``_REDRAW_ROUNDS`` rounds
    while at least ``_MIN_ACCEPT`` of the draws so far were sampleable. The rows
    still pending then are drawn by ``exact``, which costs O(lanes log N)
    for transitions and non-strict windows and O(live episodes log N) for
    strict windows: paid only when the sampleable rows hold less than about a
    quarter of the mass (priority on short episodes and episode tails), or
    when rejection leaves draws pending after its rounds. Together they draw
    each row ``n p_i / sum(valid p)`` times in expectation in a batch of
    ``n`` (a rejection round accepts ``i`` in proportion to ``p_i``, ``exact``
    draws it with probability ``p_i / sum(valid p)``, and the expected
    outcome of a pending draw is the same whichever way it is drawn, so the
    switch, which looks only at past rounds, biases nothing). A per-``slice_len`` tree over the valid starts' leaves
    would make every draw O(batch log N), at 4.4 more bytes per row per
    slice length and a second tree write on each extend, eviction and
    priority update.

    Weights are ``(N P(i))^-beta / max_j (N P(j))^-beta`` with the max over
    the live rows ``j``: with ``P(i) = p_i / sum(valid p)`` the count ``N``
    and the normalizer cancel, leaving ``(p_i / p_min)^-beta`` with ``p_min``
    the smallest live priority (the tree's min, O(1)), so weights are in
    ``(0, 1]`` and do not depend on ``slice_len``.
    """
    u = np.empty(batch_size, np.float64)  # tree.sample's uniforms: ``torch.rand`` is ``uniform_`` on a
    torch.from_numpy(u).uniform_(generator=generator)  # new tensor (as ``_bits``)
    v = ptree.views  # the first round, its checks and weights: one compiled call (kernels/priority.py)
    status, pending, rows, values, ok, weights = load("priority").draw(
        v.leaf, v.nodes, v.offs, u, view.lane_size, view.written, view.first_starts, view.transitions, beta)
    if status:
        raise errors.EmptyBufferError("sample: expected a store with positive priorities, got none")
    if slice_len is not None and strict and slice_len > 1:
        ok &= sampleable(view, rows, slice_len, strict)
        pending = int((~ok).sum())
    if not pending:
        return rows, weights
    drawn, accepted = batch_size, batch_size - pending
    for _ in range(_REDRAW_ROUNDS):
        bad = np.flatnonzero(~ok)
        if bad.shape[0] == 0 or accepted < _MIN_ACCEPT * drawn:
            break
        redraw, p = tree.sample(ptree, bad.shape[0], generator)
        rows[bad], values[bad] = redraw, p * tree.total(ptree)
        ok[bad] = fresh = sampleable(view, redraw, slice_len, strict)
        drawn, accepted = drawn + bad.shape[0], accepted + int(fresh.sum())
    bad = np.flatnonzero(~ok)
    if bad.shape[0]:
        rows[bad], values[bad] = exact(view, ptree, bad.shape[0], generator, slice_len, strict)
    weights = (values / tree.min_live(ptree)) ** (-beta)
    return rows, weights.astype(np.float32)

