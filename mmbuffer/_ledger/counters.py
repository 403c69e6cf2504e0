"""Check a store's lane counters against its episode index and reservation.

The manifest's own counters are checked by ``_manifest.parse``; here the ends
of the live episodes are read from ``index/ends`` and must lie strictly
increasing in ``(first_start, written]``, each episode (the open one too) at
most a lane long, and ``index/reserved`` must be what a writer can leave. A
store that fails is corrupt (``CorruptStoreError``): nothing is repaired away.

Cost: O(1) per lane plus one vectorized pass over the live episodes' ends
(8 bytes each, read in blocks), or over only the episodes added since ``since``.
"""

from __future__ import annotations

import numpy as np

from .. import errors
from . import index
from .index import Lane

_BLOCK = 1 << 20


def check_lane(
    ends: np.ndarray, lane: int, lane_size: int, st: Lane, where: str, since: int | None = None
) -> None:
    """Refuse a lane whose live episode ends contradict its counters.

    ``since``: a sequence number whose predecessors were checked before (a
    reader's refresh); only the episodes from there on are read.
    """
    lo = st.ep_head if since is None else max(st.ep_head, min(since, st.ep_tail) - 1)
    prev = st.first_start
    if lo > st.ep_head:  # the head and the last checked episode: O(1)
        head, prev = (int(x) for x in index.ends_at(ends, lane, lane_size, np.array([st.ep_head, lo - 1])))
        if not st.first_start < head <= min(prev, st.first_start + lane_size):
            raise _bad(where, lane, st.ep_head, head, st)
        if not prev <= st.written:
            raise _bad(where, lane, lo - 1, prev, st)
    base = lane * 2 * lane_size
    a = lo
    while a < st.ep_tail:  # contiguous views of the ring, a block at a time: no fancy-index copy
        s = a % (2 * lane_size)
        n = min(st.ep_tail - a, 2 * lane_size - s, _BLOCK)
        e = ends[base + s : base + s + n]
        first, last = int(e[0]), int(e[-1])
        d = np.diff(e) if n > 1 else e[:0]
        ok = prev < first <= prev + lane_size and last <= st.written and (n == 1 or (int(d.min()) >= 1 and int(d.max()) <= lane_size))
        if not ok:
            e = np.asarray(e)
            steps = np.diff(e, prepend=np.int64(prev))
            k = int(np.flatnonzero((steps < 1) | (steps > lane_size) | (e > st.written))[0])
            raise _bad(where, lane, a + k, int(e[k]), st)
        prev = last
        a += n
    if st.written - st.open_start(ends, lane, lane_size) > lane_size:
        raise errors.CorruptStoreError(
            f"{where}: stream {lane}: expected the open episode to start at most lane_size={lane_size} rows "
            f"before written={st.written}, got it starting at {st.open_start(ends, lane, lane_size)}"
        )


def _bad(where: str, lane: int, seq: int, got: int, st: Lane) -> errors.CorruptStoreError:
    return errors.CorruptStoreError(
        f"{where}: stream {lane}: expected episode ends strictly increasing in (first_start, written] = "
        f"({st.first_start}, {st.written}], each at most a lane long, got episode {seq} ending at {got}"
    )


def check_reserved(reserved: int, lane: int, lane_size: int, st: Lane, where: str, *, writer: bool) -> None:
    """Refuse a reservation a writer cannot have left.

    A writer reserves rows before it writes them, so ``reserved >= written`` of
    any commit; its cursor is at most a lane past its last commit (``extend``
    commits before a lane's uncommitted rows exceed a lane), plus at most a lane
    of look-ahead. The upper bound holds only for the
    writer's own commit, so only the writer (which holds the lock) checks it.
    """
    high = st.written + 2 * lane_size if writer else 1 << 62
    if not st.written <= reserved <= high:
        bound = "written + 2 * lane_size" if writer else "2**62"
        raise errors.CorruptStoreError(
            f"{where}: index/reserved: stream {lane}: expected a reservation in [written, {bound}] = "
            f"[{st.written}, {high}], got {reserved}"
        )


def check_lanes(
    ends: np.ndarray, reserved: np.ndarray, lanes: list[Lane], lane_size: int, where: str, *,
    writer: bool, since: list[Lane] | None = None,
) -> None:
    """Check every lane's reservation, then the live episodes that survive it.

    The episodes below ``reserved - lane_size`` are not checked: a writer (a live
    one, for a reader; a crashed one, for the writer that recovers) may have
    rewritten their slots, and neither reads them. A reader re-checks when the
    reservation moved during its check (a live writer went on).
    """
    for lane, st in enumerate(lanes):
        check_reserved(int(reserved[lane]), lane, lane_size, st, where, writer=writer)
        start = None if since is None else since[lane].ep_tail
        for attempt in range(1 if writer else 3):
            seen = int(reserved[lane])
            live = index.drop_below(ends, lane, lane_size, st, seen - lane_size)
            try:
                check_lane(ends, lane, lane_size, live, where, start)
                break
            except errors.CorruptStoreError:
                if writer or attempt == 2 or int(reserved[lane]) == seen:
                    raise
