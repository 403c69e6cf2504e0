"""Where a gather finds an episode's final observation, compiled (``_ledger/finals.py``).

In a version 4 store the final observation of the episode whose last row is ``q``
is in the ``final`` row of that episode's slot: its sequence number, found among the
lane's last ``lane_size`` episode ends (``index/ends``), modulo ``lane_size``. The
gather kernels (``gather.py``) call these only at episode ends.

>>> import numpy as np
>>> index = np.array([2, 3, 5, 0, 0, 0, 0, 0], np.int64)  # one lane of 4 rows: ends of episodes 0, 1, 2
>>> cursors = np.array([6, 3], np.int64)                   # written, ep_tail
>>> [final_slot(q, 4, index, cursors, True) for q in range(4)]  # rows 0..3 hold absolute 4, 5, 2, 3
[2, -1, 1, -1]
"""

from __future__ import annotations

from typing import Any

import numba

__all__ = ["check_finals", "final_seq", "final_slot", "zero"]


@numba.njit(nogil=True, cache=True)
def final_seq(q: int, lane_size: int, index: Any, cursors: Any, hint: int) -> int:
    """The sequence number of the episode whose last row is global row ``q``, or -1,
    searched among its lane's last ``lane_size`` episodes in ``index`` (``index/ends``:
    per lane a ring of ``2 * lane_size`` absolute ends) with ``cursors`` (per lane
    ``written``, ``ep_tail``); the episode ``hint`` and the next one are tried first
    (-1: none), as a slice's rows meet them. Every probe lies inside the lane's ring, whatever the values (the callers
    check the sizes of ``index`` and ``cursors``)."""
    lane = q // lane_size
    w = cursors[2 * lane]
    tail = cursors[2 * lane + 1]
    target = w - (w - 1 - q % lane_size) % lane_size  # the row's absolute number, plus one
    ring = 2 * lane_size
    base = lane * ring
    lo = max(tail - lane_size, 0)
    hi = tail
    found = -1
    for h in (hint, hint + 1):  # the same episode again (a padded window), or the next
        if hint >= 0 and lo <= h < hi and index[base + h % ring] == target:
            return h
    # the first episode ending at or after ``target``: a few interpolation steps (ends
    # grow about evenly: 1-3 probes where a binary search over 1e6 episodes takes 20
    # cache misses), then a binary search; every probe stays in [lo, hi)
    for _ in range(4):
        if hi - lo <= 16:
            break
        first, last = index[base + lo % ring], index[base + (hi - 1) % ring]
        if target <= first:
            hi = lo
            break
        if target > last:
            lo = hi
            break
        guess = lo + int((target - first) / (last - first) * (hi - 1 - lo))
        guess = min(max(guess, lo + 1), hi - 1)
        if index[base + guess % ring] < target:
            lo = guess + 1
        else:
            hi = guess
    while lo < hi:
        mid = lo + (hi - lo) // 2
        if index[base + mid % ring] < target:
            lo = mid + 1
        else:
            hi = mid
    if lo < tail and index[base + lo % ring] == target:
        found = lo
    return found


@numba.njit(nogil=True, cache=True)
def final_slot(q: int, lane_size: int, index: Any, cursors: Any, by_episode: bool) -> int:
    """The ``final`` row of the episode whose last row is global row ``q``, or -1:
    ``q`` itself (version 3), else the slot of its sequence number (``_ledger/finals.py``)."""
    found: int = q
    if by_episode:
        seq = final_seq(q, lane_size, index, cursors, -1)
        found = -1 if seq < 0 else q // lane_size * lane_size + seq % lane_size
    return found


@numba.njit(nogil=True, cache=True)
def check_finals(nrows: int, lane_size: int, index: Any, cursors: Any, by_episode: bool) -> None:
    if by_episode and (index.shape[0] != 2 * nrows or cursors.shape[0] != 2 * (nrows // lane_size)):
        raise ValueError("finals: index or cursors of inconsistent sizes")


@numba.njit(nogil=True, cache=True)
def zero(out: Any, at: int, nbytes: int) -> None:
    for b in range(at, at + nbytes):
        out[b] = 0
