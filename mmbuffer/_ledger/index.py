"""The persisted episode-boundary index: per lane, a ring of episode ends.

Episodes are contiguous inside a lane, so one number per episode says everything:
its *end*, an absolute row counter of the lane (exclusive, never wrapping; the
ring position of absolute row ``a`` is ``a % lane_size``). Episode ``k`` of a lane
starts where episode ``k - 1`` ended; the oldest live one starts at
``Lane.first_start``. Episode sequence numbers ``k`` also never wrap; episode
``k`` lives in slot ``k % (2 * lane_size)`` of the lane's part of ``ends``.

Why twice the lane: live episodes never outnumber the lane's rows, and the writer's
uncommitted episodes must not overwrite the slots of episodes of the last commit
that a reader (or the next open after a crash) may still use. Between two commits
the writer adds fewer than ``lane_size`` episodes unless the whole lane was
rewritten, in which case every committed episode is evicted anyway.

Everything here is vectorized over episodes; the index never reads column data.

>>> import numpy as np
>>> ends = np.zeros(2 * 8, dtype=np.int64)            # one lane of 8 rows
>>> lane = Lane()
>>> lane = append(ends, 0, 8, lane, rows=5, done=np.array([1, 0, 0, 1, 0], bool))
>>> starts_lengths(ends, 0, 8, lane)
(array([0, 1]), array([1, 3]))
>>> lane.open_start(ends, 0, 8), lane.written
(4, 5)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .._disk.memory import sparse_zeros
from .. import errors
from .layout import Layout


@dataclass(frozen=True, slots=True)
class Lane:
    """Cursor state of one lane; every field an absolute int64 counter.

    written:     rows ever written to the lane.
    ep_head:     sequence number of the oldest live complete episode.
    ep_tail:     one past the newest complete episode.
    first_start: absolute start row of episode ``ep_head`` (or of the open episode
                 when no complete episode is live).
    """

    written: int = 0
    ep_head: int = 0
    ep_tail: int = 0
    first_start: int = 0

    @property
    def num_episodes(self) -> int:
        return self.ep_tail - self.ep_head

    def open_start(self, ends: np.ndarray, lane: int, lane_size: int) -> int:
        """Absolute start row of the open (unfinished) episode."""
        if self.ep_tail == self.ep_head:
            return self.first_start
        return int(ends[_slot(lane, lane_size, self.ep_tail - 1)])

    def to_json(self) -> dict[str, int]:
        return {
            "written": self.written,
            "ep_head": self.ep_head,
            "ep_tail": self.ep_tail,
            "first_start": self.first_start,
        }

    @classmethod
    def from_json(cls, obj: dict[str, int]) -> Lane:
        return cls(**{k: int(obj[k]) for k in ("written", "ep_head", "ep_tail", "first_start")})


def _slot(lane: int, lane_size: int, seq: int | np.ndarray) -> int | np.ndarray:
    return lane * 2 * lane_size + seq % (2 * lane_size)


def slots(lane: int, lane_size: int, seqs: np.ndarray) -> np.ndarray:
    """Positions in ``ends`` of the episodes with sequence numbers ``seqs`` of a lane."""
    return np.asarray(_slot(lane, lane_size, np.asarray(seqs, dtype=np.int64)))


def lane_slots(lanes: np.ndarray, lane_size: int, seqs: np.ndarray) -> np.ndarray:
    """:func:`slots` of many lanes at once: the position in ``ends`` of episode
    ``seqs[i]`` of lane ``lanes[i]`` (broadcast together)."""
    out: np.ndarray = np.asarray(lanes, dtype=np.int64) * 2 * lane_size + np.asarray(seqs, dtype=np.int64) % (2 * lane_size)
    return out


def slot_ranges(lane: int, lane_size: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of ``ends`` holding the episodes ``lo <= seq < hi`` of
    a lane (at most two: its slots are a ring of ``2 * lane_size``)."""
    base = lane * 2 * lane_size
    return [(base + a, base + b) for a, b in Layout(2 * lane_size).segments(0, lo, hi)]


def episode_ends(ends: np.ndarray, lane: int, lane_size: int, lo: int, hi: int) -> np.ndarray:
    """Absolute ends of episodes ``lo <= seq < hi`` of a lane (a copy)."""
    return np.asarray(ends[_slot(lane, lane_size, np.arange(lo, hi, dtype=np.int64))])


def end_of(ends: np.ndarray, lane: int, lane_size: int, seq: int) -> int:
    """Absolute end of episode ``seq`` of a lane, in plain integers (one episode: no array calls)."""
    return int(ends[_slot(lane, lane_size, seq)])


def ends_at(ends: np.ndarray, lane: int, lane_size: int, seqs: np.ndarray) -> np.ndarray:
    """Absolute ends of the episodes with sequence numbers ``seqs`` (any shape)."""
    return np.asarray(ends[_slot(lane, lane_size, np.asarray(seqs, dtype=np.int64))])


def containing_end(
    ends: np.ndarray, lane: int, lane_size: int, head: int, tail: int, rows: np.ndarray, open_end: int
) -> np.ndarray:
    """End of the live episode holding each absolute row (``open_end`` past the last).

    Binary search in the (at most two) sorted ring segments of episodes
    ``head .. tail-1``: O(len(rows) * log(episodes)), no copy of the ring.
    """
    out = np.full(rows.shape, open_end, dtype=np.int64)
    pending = np.ones(rows.shape, dtype=bool)
    base = lane * 2 * lane_size
    lo = head
    while lo < tail and pending.any():
        s = lo % (2 * lane_size)
        n = min(tail - lo, 2 * lane_size - s)
        seg = ends[base + s : base + s + n]
        i = np.searchsorted(seg, rows, side="right")
        hit = pending & (i < n)
        out[hit] = seg[i[hit]]
        pending &= ~hit
        lo += n
    return out


def episodes_ending_at(ends: np.ndarray, lane: int, lane_size: int, state: Lane, absolute: np.ndarray) -> np.ndarray:
    """Sequence number of the episode whose last row is each absolute row of a lane,
    -1 where none of the lane's last ``lane_size`` episodes (``ep_tail - lane_size ..
    ep_tail - 1``, evicted ones included: their rows may still be read) ends there.

    Binary search in the (at most two) sorted ring segments of those episodes' ends:
    O(len(rows) * log(episodes)), no copy of the ring. Their slots are never those of
    uncommitted episodes of another writer (the ring holds ``2 * lane_size``).

    >>> ends = np.zeros(2 * 8, dtype=np.int64)
    >>> lane = append(ends, 0, 8, Lane(), rows=6, done=np.array([1, 0, 0, 1, 0, 0], bool))
    >>> episodes_ending_at(ends, 0, 8, lane, np.array([0, 1, 3, 5])).tolist()
    [0, -1, 1, -1]
    """
    target = np.asarray(absolute, dtype=np.int64) + 1
    out = np.full(target.shape, -1, dtype=np.int64)
    base, ring = lane * 2 * lane_size, 2 * lane_size
    lo, tail = max(0, state.ep_tail - lane_size), state.ep_tail
    while lo < tail:
        s = lo % ring
        n = min(tail - lo, ring - s)
        seg = ends[base + s : base + s + n]
        i = np.searchsorted(seg, target, side="left")
        hit = (i < n) & (seg[np.minimum(i, n - 1)] == target)
        out[hit] = lo + i[hit]
        lo += n
    return out


def containing_start(ends: np.ndarray, lane: int, lane_size: int, state: Lane, rows: np.ndarray) -> np.ndarray:
    """Absolute start of the episode (live complete, or the open one) holding each
    absolute row ``rows`` of a lane: the last episode end at or before the row, or
    ``state.first_start``. O(len(rows) * log(episodes)), no copy of the ring.

    >>> ends = np.zeros(2 * 8, dtype=np.int64)
    >>> lane = append(ends, 0, 8, Lane(), rows=6, done=np.array([1, 0, 0, 1, 0, 0], bool))
    >>> containing_start(ends, 0, 8, lane, np.array([0, 1, 3, 4, 5])).tolist()
    [0, 1, 1, 4, 4]
    """
    rows = np.asarray(rows, dtype=np.int64)
    out = np.full(rows.shape, state.first_start, dtype=np.int64)
    for a, b in slot_ranges(lane, lane_size, state.ep_head, state.ep_tail):
        seg = ends[a:b]  # sorted: ends of consecutive episodes
        i = np.searchsorted(seg, rows, side="right")
        hit = i > 0
        np.maximum(out, np.where(hit, seg[np.maximum(i - 1, 0)], out), out=out)
    return out


def episode_starts(ends: np.ndarray, lane: int, lane_size: int, state: Lane, lo: int, hi: int) -> np.ndarray:
    """Absolute starts of live episodes ``lo <= seq < hi`` (``lo >= ep_head``)."""
    prev = episode_ends(ends, lane, lane_size, max(lo - 1, state.ep_head), hi - 1)
    if lo == state.ep_head:
        return np.concatenate(([state.first_start], prev)).astype(np.int64)
    return prev


def starts_lengths(ends: np.ndarray, lane: int, lane_size: int, state: Lane) -> tuple[np.ndarray, np.ndarray]:
    """Absolute starts and lengths of the live complete episodes of a lane."""
    e = episode_ends(ends, lane, lane_size, state.ep_head, state.ep_tail)
    s = np.empty_like(e)
    if e.size:
        s[0] = state.first_start
        s[1:] = e[:-1]
    return s, e - s


def append(
    ends: np.ndarray, lane: int, lane_size: int, state: Lane, *, rows: int, done: np.ndarray
) -> Lane:
    """Record ``rows`` new rows whose end flags are ``done``; return the new state.

    Writes the ends of the episodes that finish inside the block into the ring.
    Eviction is separate (``evict``) so the caller can order it with data writes.
    """
    pos = np.flatnonzero(done).astype(np.int64)
    if pos.size:
        seqs = np.arange(state.ep_tail, state.ep_tail + pos.size, dtype=np.int64)
        ends[_slot(lane, lane_size, seqs)] = state.written + pos + 1
    return replace(state, written=state.written + rows, ep_tail=state.ep_tail + int(pos.size))


def count_starting_before(ends: np.ndarray, lane: int, lane_size: int, state: Lane, threshold: int) -> int:
    """How many live complete episodes start before absolute row ``threshold``."""
    if state.num_episodes == 0 or state.first_start >= threshold:
        return 0
    # starts after the first are the ends of episodes head .. tail-2, sorted; search
    # the (at most two) contiguous ring segments they occupy.
    lo, hi = state.ep_head, state.ep_tail - 1
    count = 1
    base = lane * 2 * lane_size
    while lo < hi:
        s = lo % (2 * lane_size)
        n = min(hi - lo, 2 * lane_size - s)
        count += int(np.searchsorted(ends[base + s : base + s + n], threshold, side="left"))
        lo += n
    return min(count, state.num_episodes)


def evict(ends: np.ndarray, lane: int, lane_size: int, state: Lane, threshold: int) -> tuple[Lane, int]:
    """Drop the episodes whose first row lies before ``threshold`` (overwritten).

    Returns the new state and the absolute row where the dropped episodes ended
    (rows in ``[threshold, that)`` are no longer live though not yet overwritten).
    """
    k = count_starting_before(ends, lane, lane_size, state, threshold)
    if k == 0:
        return state, threshold
    last_end = int(ends[_slot(lane, lane_size, state.ep_head + k - 1)])
    return replace(state, ep_head=state.ep_head + k, first_start=last_end), last_end


def drop_below(ends: np.ndarray, lane: int, lane_size: int, state: Lane, threshold: int) -> Lane:
    """The state with every episode (the open one too) that starts below
    ``threshold`` dropped: what survives a writer that may have rewritten the ring
    up to ``threshold + lane_size``. A dropped open episode leaves its rows unused;
    rows written after it start a new episode."""
    if threshold <= state.first_start:
        return state
    if threshold < state.written:
        state, _ = evict(ends, lane, lane_size, state, threshold)
        if threshold <= state.open_start(ends, lane, lane_size):
            return state
    return Lane(state.written, state.ep_tail, state.ep_tail, state.written)


def check_fits(state: Lane, ends: np.ndarray, lane: int, lane_size: int, done: np.ndarray) -> None:
    """Refuse a block that would make an episode longer than the lane."""
    rows = int(done.shape[0])
    if rows > lane_size:
        raise errors.CapacityError(
            f"extend: expected at most lane_size={lane_size} rows per call, got {rows}"
        )
    first = np.flatnonzero(done)
    grows_to = state.written + (int(first[0]) + 1 if first.size else rows)
    length = grows_to - state.open_start(ends, lane, lane_size)
    if length > lane_size:
        raise errors.CapacityError(
            f"stream {lane}: an episode of {length} rows does not fit a lane of {lane_size} rows; "
            "mark it truncated earlier or create the store with a larger capacity per stream"
        )


def rebuild(done_by_lane: list[np.ndarray], states: list[Lane], lane_size: int) -> tuple[np.ndarray, list[Lane]]:
    """Recompute the ring and lane states from the end flags of the live rows.

    ``done_by_lane[l]`` holds the flags of absolute rows ``[first_start, written)``
    of lane ``l``, in order. Used by ``verify --repair``. The ring is as large as
    the store's (16 bytes a row of capacity) and only its live episodes' slots are
    written, so it lives in sparse memory.
    """
    ends = sparse_zeros(len(states) * 2 * lane_size, np.int64)
    out = []
    for lane, (done, st) in enumerate(zip(done_by_lane, states)):
        fresh = Lane(written=st.first_start, ep_head=st.ep_head, ep_tail=st.ep_head, first_start=st.first_start)
        out.append(append(ends, lane, lane_size, fresh, rows=int(done.shape[0]), done=done))
    return ends, out
