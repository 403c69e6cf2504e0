"""Ring arithmetic: the one place that knows where a lane's rows live.

A store of ``capacity`` rows has ``num_streams`` lanes of ``lane_size = capacity //
num_streams`` rows. Lane ``l`` owns the global rows ``[l * lane_size, (l + 1) *
lane_size)`` and is a ring: the lane's *absolute* row ``a`` (a counter that never
wraps: rows ever written to the lane before it) lives at global row ``l *
lane_size + a % lane_size``. Going back needs the lane's cursor ``written``: a
global row holds the absolute row in ``[written - lane_size, written)`` at its
ring position. Everything here is vectorized over rows and knows nothing of
episodes or data.

>>> lay = Layout(capacity=8, num_streams=2)
>>> lay.lane_size, lay.rows(1, np.array([3, 4, 5])).tolist()
(4, [7, 4, 5])
>>> lay.absolute(np.array([7, 4]), written=np.array([0, 6])).tolist()
[3, 4]
>>> lay.segments(1, 3, 6)
[(7, 8), (4, 6)]
>>> lay.following(np.array([3, 7])).tolist()
[0, 4]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import errors


@dataclass(frozen=True, slots=True)
class Layout:
    """Capacity and lanes of a store; every ring computation is a method."""

    capacity: int
    num_streams: int = 1

    def __post_init__(self) -> None:
        if self.num_streams < 1 or self.capacity < self.num_streams or self.capacity % self.num_streams:
            raise errors.InvalidArgumentError(
                f"capacity: expected a positive multiple of num_streams={self.num_streams}, got {self.capacity}"
            )

    @property
    def lane_size(self) -> int:
        return self.capacity // self.num_streams

    def lane(self, rows: np.ndarray) -> np.ndarray:
        """The lane of each global row."""
        out: np.ndarray = np.asarray(rows, dtype=np.int64) // self.lane_size
        return out

    def rows(self, lane: int | np.ndarray, absolute: int | np.ndarray) -> np.ndarray:
        """Global rows of absolute rows of lanes (broadcast together)."""
        n = self.lane_size
        out: np.ndarray = np.asarray(lane, dtype=np.int64) * n + np.asarray(absolute, dtype=np.int64) % n
        return out

    def absolute(self, rows: np.ndarray, written: np.ndarray) -> np.ndarray:
        """The absolute row each global row holds when the lanes' cursors are
        ``written`` (``[num_streams]``)."""
        rows = np.asarray(rows, dtype=np.int64)
        return self.absolute_at(rows, np.asarray(written, dtype=np.int64)[rows // self.lane_size])

    def absolute_at(self, rows: np.ndarray, cursor: np.ndarray) -> np.ndarray:
        """The absolute row each global row holds when its own lane's cursor is
        ``cursor`` (broadcast with ``rows``)."""
        n = self.lane_size
        w = np.asarray(cursor, dtype=np.int64)
        out: np.ndarray = w - 1 - (w - 1 - np.asarray(rows, dtype=np.int64) % n) % n
        return out

    def following(self, rows: np.ndarray) -> np.ndarray:
        """The next ring position of each global row, in its lane."""
        rows = np.asarray(rows, dtype=np.int64)
        n = self.lane_size
        out: np.ndarray = rows // n * n + (rows % n + 1) % n
        return out

    def segments(self, lane: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """Global ``[start, stop)`` ranges holding absolute rows ``[lo, hi)`` of a lane,
        at most two (the ring wraps once); only the last ``lane_size`` rows count."""
        n = self.lane_size
        lo = max(lo, hi - n)
        out = []
        while lo < hi:
            p = lo % n
            k = min(hi - lo, n - p)
            out.append((lane * n + p, lane * n + p + k))
            lo += k
        return out

    def ranges(self, lane: int, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`segments` for many ranges at once: global ``[starts, stops)`` holding
        absolute rows ``[lo[i], hi[i])`` of a lane (each at most a lap long); a range the
        seam cuts gives two, the wrapped tails after all the heads.

        >>> [a.tolist() for a in Layout(20, 2).ranges(1, np.array([3, 8]), np.array([6, 12]))]
        [[13, 18, 10], [16, 20, 12]]
        """
        n = self.lane_size
        lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
        pos = lo % n
        end = pos + (hi - lo)
        wraps = end > n
        base = lane * n
        starts = np.concatenate([base + pos, np.full(int(wraps.sum()), base, np.int64)])
        stops = np.concatenate([base + np.minimum(end, n), base + end[wraps] - n])
        return starts, stops
