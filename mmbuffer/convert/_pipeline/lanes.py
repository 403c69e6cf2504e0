"""Which stream (lane) each episode of a converted or copied store goes to, and whether it fits.

A converter or :func:`~mmbuffer.convert.copy` may write into a store with more
room and more streams than the source needs (``capacity``, ``num_streams``:
an offline dataset becomes an online replay buffer in one step). The rule,
used by both:

* Episodes keep their order and are **dealt out in contiguous runs**: with
  ``N`` rows in all and ``S`` streams, an episode whose first row is source row
  ``s`` goes to stream ``min(S - 1, s * S // N)``. So stream ``k`` holds the
  episodes that start in rows ``[k N / S, (k + 1) N / S)``: about ``N / S``
  rows (at most one episode more), and each stream keeps
  ``capacity // S - its rows`` rows free for new data.
* An open episode (no end flag yet) must stay the last one of its stream, so
  an open episode moves every later episode at least one stream further
  (``lane[i] = max(balanced[i], lane[i - 1] + open[i - 1])``, computed as one
  max-scan). More open episodes than streams cannot be laid out: refused.
* A stream whose episodes need more rows than a lane
  (``capacity // num_streams``) would evict the oldest ones: refused with
  :class:`~mmbuffer.errors.InvalidArgumentError` naming ``capacity``, before
  anything is written when the episode lengths are known up front (copies), or
  as soon as the overflow is seen while streaming (converters; the partial
  store is then removed and the destination is untouched).

>>> import numpy as np
>>> deal(np.array([3, 3, 3, 3]), np.array([True, True, True, True]), 2).tolist()
[0, 0, 1, 1]
>>> deal(np.array([3, 3, 3, 3]), np.array([True, False, True, True]), 2).tolist()
[0, 0, 1, 1]
>>> deal(np.array([3, 3, 3, 3]), np.array([False, True, True, True]), 2).tolist()
[0, 1, 1, 1]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import InvalidArgumentError
from ...schema import PriorityConfig

__all__ = ["Layout", "balanced", "check_layout", "deal", "lane_rows_fit", "runs"]


class Layout:
    """The geometry of the store being written: capacity, streams, priorities, lane size."""

    def __init__(self, capacity: int, num_streams: int, priorities: PriorityConfig | None) -> None:
        self.capacity = capacity
        self.num_streams = num_streams
        self.priorities = priorities
        self.lane_size = capacity // num_streams
        self.written = np.zeros(num_streams, np.int64)  # rows written per lane
        self.starts = np.zeros(num_streams, np.int64)  # absolute row each lane begins at

    def row(self, lane: int) -> int:
        """The global row the next row of ``lane`` goes to."""
        return lane * self.lane_size + int(self.starts[lane] + self.written[lane]) % self.lane_size

    def take(self, lane: int, n: int, what: str) -> list[tuple[int, int]]:
        """Reserve ``n`` rows of ``lane``; return them as ``(first global row, rows)``
        runs, two where they pass the end of the lane's ring. Refuse an overflow.

        >>> layout = Layout(8, 1, None)
        >>> layout.starts[0] = 13  # the lane begins at absolute row 13: ring position 5
        >>> layout.take(0, 2, "x"), layout.take(0, 3, "x")
        ([(5, 2)], [(7, 1), (0, 2)])
        """
        if int(self.written[lane]) + n > self.lane_size:
            raise InvalidArgumentError(
                f"capacity: stream {lane} of {self.num_streams} needs more than its "
                f"{self.lane_size} rows (capacity // num_streams) for {what}; expected a capacity "
                f"whose lanes hold every stream's episodes without evicting any, got {self.capacity}"
            )
        row = self.row(lane)
        self.written[lane] += n
        first = min(n, (lane + 1) * self.lane_size - row)
        return [(row, first)] + ([(lane * self.lane_size, n - first)] if n > first else [])


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < low:
        raise InvalidArgumentError(f"{name}: expected an integer >= {low}, got {value!r}")
    return int(value)


def check_layout(
    rows: int, *, capacity: Any, num_streams: Any, priorities: Any,
    default_capacity: int | None = None, default_streams: int = 1,
) -> Layout:
    """Check the ``capacity`` / ``num_streams`` / ``priorities`` options against ``rows``.

    ``capacity`` defaults to ``default_capacity`` (else ``rows``) and
    ``num_streams`` to ``default_streams``. Raises
    :class:`~mmbuffer.errors.InvalidArgumentError` naming the option when the
    store could not hold ``rows`` (nothing has been written yet).
    """
    streams = default_streams if num_streams is None else _int("num_streams", num_streams, 1)
    if capacity is None:
        capacity = default_capacity if default_capacity is not None else max(rows, 1)
        if capacity % streams:  # round up: each lane is capacity // num_streams rows
            capacity += streams - capacity % streams
    cap = _int("capacity", capacity, 1)
    if cap < rows:
        raise InvalidArgumentError(
            f"capacity: expected at least the source's {rows} rows (a smaller store would evict "
            f"its oldest episodes while converting), got {cap}"
        )
    if cap % streams:
        raise InvalidArgumentError(f"capacity: expected a multiple of num_streams={streams}, got {cap}")
    if priorities is not None and not isinstance(priorities, PriorityConfig):
        raise InvalidArgumentError(f"priorities: expected mb.PriorityConfig or None, got {priorities!r}")
    return Layout(cap, streams, priorities)


def balanced(starts: np.ndarray, total: int, num_streams: int) -> np.ndarray:
    """The stream of episodes starting at source rows ``starts`` of ``total``: contiguous runs."""
    if total <= 0:
        return np.zeros(len(starts), np.int64)
    return np.minimum(num_streams - 1, np.asarray(starts, np.int64) * num_streams // total)


def deal(lengths: np.ndarray, complete: np.ndarray, num_streams: int) -> np.ndarray:
    """The stream of every episode (in order), by the rule of the module docstring.

    The result may name a stream ``>= num_streams`` when there are more open
    episodes than streams; :func:`lane_rows_fit` refuses that.
    """
    lengths = np.asarray(lengths, np.int64)
    starts = np.cumsum(lengths) - lengths
    bal = balanced(starts, int(lengths.sum()), num_streams)
    opened = (~np.asarray(complete, bool)).astype(np.int64)
    before = np.cumsum(opened) - opened  # open episodes before each one
    lanes: np.ndarray = np.maximum.accumulate(bal - before) + before if len(bal) else bal
    return lanes


def lane_rows_fit(lanes: np.ndarray, lengths: np.ndarray, layout: Layout) -> None:
    """Refuse (``InvalidArgumentError``) a plan whose streams exceed the layout."""
    if len(lanes) and int(lanes.max()) >= layout.num_streams:
        raise InvalidArgumentError(
            f"num_streams: expected at least as many streams as the source's open episodes "
            f"({int(lanes.max()) + 1} needed: an open episode must "
            f"stay the last of its stream), got {layout.num_streams}"
        )
    per_lane = np.bincount(lanes, weights=lengths, minlength=layout.num_streams).astype(np.int64)
    worst = int(np.argmax(per_lane)) if len(per_lane) else 0
    if len(per_lane) and int(per_lane[worst]) > layout.lane_size:
        raise InvalidArgumentError(
            f"capacity: stream {worst} needs {int(per_lane[worst])} rows but a lane holds "
            f"{layout.lane_size} (capacity // num_streams); expected a capacity of at least "
            f"{int(per_lane[worst]) * layout.num_streams}, got {layout.capacity}"
        )


def runs(lanes: np.ndarray) -> list[tuple[int, int, int]]:
    """``(lane, a, b)`` for each run of equal values in ``lanes`` (one per stream change)."""
    n = len(lanes)
    if n == 0:
        return []
    cuts = [0, *(np.flatnonzero(np.diff(lanes)) + 1).tolist(), n]
    return [(int(lanes[a]), a, b) for a, b in zip(cuts[:-1], cuts[1:])]
