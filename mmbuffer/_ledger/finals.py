"""Final observations, one per episode: where they live, how they are written and freed.

The observation after an episode's last step (Gymnasium's final observation) is what
``next_<col>`` answers at that step. It is stored once per episode in
``final/<col>``, an array of ``capacity`` rows used, per lane, as a **ring of
``lane_size`` slots addressed by the episode's sequence number** ``k`` (the never
wrapping number ``index.py`` gives it): episode ``k`` of lane ``l`` is in row
``l * lane_size + k % lane_size`` (format version 4; version 3 stores kept it at the
episode's last row id, and still do: ``by_episode`` False).

Why ``lane_size`` slots, and why that is enough:

- Live episodes never outnumber the lane's rows (each has one), so ``lane_size``
  slots hold every live one. Episodes ``k`` and ``k + lane_size`` cannot both be
  live: for ``k + lane_size`` to end, ``lane_size`` episodes of a row or more end
  after ``k``, so every row of ``k`` has been overwritten.
- Readers. The slot of ``k`` is rewritten only when ``k + lane_size`` ends, in the
  ``extend`` that writes its rows, after the reservation covers them; by then the
  writer has written at least ``e_k + lane_size`` rows (``e_k``: ``k``'s end), so the
  last row of ``k`` lies below ``reserved - lane_size``: a reader that read the
  slot meanwhile fails its re-check and draws again (``_read/recheck.py``).
- Crash safety. The index needs ``2 * lane_size`` slots because recovery *reads* the
  ends of the last commit's episodes to decide what to evict, so the dead writer's
  uncommitted episodes must not overwrite them. Recovery never reads a final
  observation: a committed episode ``k`` whose slot an uncommitted ``k + lane_size``
  overwrote has had its rows overwritten too (its progress passed ``e_k +
  lane_size``), so recovery evicts it anyway. Half the index's ring suffices.
- Finding ``k`` from a row (a gather): the row's absolute number plus one is
  ``k``'s end; a binary search over the lane's last ``lane_size`` episode ends
  (``index.episodes_ending_at``; in the gather kernels, compiled) finds it. Evicted
  episodes are searched too: a row drawn before a later extend evicted its episode
  is still intact (a reader's re-check says so) and so is its final observation.

The open episode's tail. A writer that knows the next observation of the open
episode's last row (the TorchRL drop-in) ends the episode there provisionally, its
final observation in the slot of ``ep_tail``, and undoes that end before the
episode goes on (``appending.py``): the episode keeps its sequence number, so when it
ends for good its final observation goes to the same slot, and ``end_open_episode``
finds the provisional one there again. A commit makes the slot of the open episode
durable with the others (:meth:`FinalsWriter.flush`).

Disk. Slots are written in episode order, ``posix_fallocate``'d before the extend
changes anything, 256 KiB of slots ahead at a time (a full disk raises
``OSError(ENOSPC)``, never a SIGBUS), and the slots of episodes whose
rows are all overwritten are given back (``FALLOC_FL_PUNCH_HOLE``), so a raw store
takes its rows plus one final observation per live episode, however long it runs.
A store created with ``compression`` keeps ``final/<col>`` compressed like its
columns: chunks of unused slots are never written (a published snapshot ships only
the used ones); their chunks are not given back when episodes are evicted.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/f", {"obs": ((), "float32")}, capacity=4)
>>> for k in range(3):  # episodes of 2 rows in a ring of 4: episode k in slot k % 4
...     buf.extend({"obs": [10.0 * k, 10.0 * k + 1], "terminated": [False, True]}, final_obs={"obs": [k + 0.5]})
>>> buf.column("final/obs").read(np.arange(4)).tolist()
[0.5, 1.5, 2.5, 0.0]
>>> buf.get(np.array([1, 3]), ["next_obs"])["next_obs"].tolist()  # rows 1 and 3: episodes 2 and 1
[2.5, 1.5]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import index
from .index import Lane
from .layout import Layout

__all__ = ["FinalsWriter", "slots"]

#: at least this many bytes of evicted slots are given back at a time (one syscall)
_DISCARD_BYTES = 1 << 16
#: slots allocated ahead of the newest episode at a time: this many bytes of final rows
_AHEAD_BYTES = 1 << 18


def slots(ends: np.ndarray, layout: Layout, lanes: tuple[Lane, ...], rows: np.ndarray, *, by_episode: bool) -> np.ndarray:
    """The row of ``final/<col>`` holding the final observation of the episode that
    ends at each global row ``rows`` (any shape), when the lanes' cursors are
    ``lanes``; -1 where no episode ends there. Version 3 (``by_episode`` False):
    the row itself. A Python loop over the lanes the rows touch, never over rows.

    >>> ends = np.zeros(2 * 4, dtype=np.int64)
    >>> lane = index.append(ends, 0, 4, Lane(), rows=6, done=np.array([0, 1, 1, 0, 1, 0], bool))
    >>> # global rows 0..3 hold absolute rows 4, 5, 2, 3; episodes 0, 1, 2 end at 1, 2, 4
    >>> slots(ends, Layout(4), (lane,), np.array([0, 1, 2, 3]), by_episode=True).tolist()
    [2, -1, 1, -1]
    """
    rows = np.asarray(rows, dtype=np.int64)
    if not by_episode:
        return rows.copy()
    out = np.full(rows.shape, -1, dtype=np.int64)
    lane_of = layout.lane(rows)
    n = layout.lane_size
    for lane in np.unique(lane_of).tolist():
        pick = lane_of == lane
        st = lanes[lane]
        seq = index.episodes_ending_at(ends, lane, n, st, layout.absolute_at(rows[pick], st.written))
        out[pick] = np.where(seq >= 0, lane * n + seq % n, -1)
    return out


class FinalsWriter:
    """The writer's side of ``final/<col>``: write an extend's final observations,
    make them durable at a commit, give back the slots of overwritten episodes.
    Called by ``writer.Writer`` under the store's lock."""

    def __init__(self, store: Any) -> None:  # a ``store.Store`` (which imports this module)
        self.store = store
        self.by_episode = store.finals_by_episode
        self.layout = store.layout
        self.names = [f"final/{k}" for k in store.next_keys]
        cols = [store.columns[k] for k in store.next_keys]
        sizes = [int(np.prod(c.shape, dtype=np.int64)) * np.dtype(c.dtype).itemsize for c in cols]
        self.row_bytes = sum(sizes)
        self._back = -(-_DISCARD_BYTES // min(sizes)) if sizes else 0  # slots that fill a large block
        # per lane: episodes below this sequence number have had their slots given back
        self._freed = [st.ep_head for st in store.lanes]
        # per lane: the slots of episodes below this sequence number are allocated (never
        # given back while ahead of the newest episode: ``discard`` keeps off them)
        self._allocated = [st.ep_tail for st in store.lanes]
        self._ahead = max(1, min(store.lane_size, _AHEAD_BYTES // max(1, self.row_bytes)))

    def reserve(self, lane: int, st: Lane, count: int) -> None:
        """Allocate the slots of the ``count`` episodes an extend of lane ``lane`` (cursors
        ``st``) ends, before it changes anything: a full disk raises ``OSError(ENOSPC)``
        here, never a SIGBUS later. Slots are allocated ``_AHEAD_BYTES`` at a time ahead
        of the newest episode (at most a lane), so most extends allocate nothing and a
        ring whose slots are all allocated writes on a full disk."""
        if not self.by_episode or count == 0:
            return
        lo, need = self._allocated[lane], st.ep_tail + count
        if need <= lo:
            return
        hi = min(need + self._ahead, st.ep_tail + self.layout.lane_size)
        for a, b in self.layout.segments(lane, max(lo, st.ep_tail), hi):
            for name in self.names:
                self.store.array(name).allocate(a, b)
        self._allocated[lane] = hi

    def write(self, lane: int, st: Lane, done: np.ndarray, finals: Mapping[str, np.ndarray]) -> None:
        """Store the final observations ``finals`` (column -> ``[episodes, ...]``) of the
        episodes that end in a block of rows, at ``done``, appended to lane ``lane``
        whose cursors were ``st`` before it."""
        store = self.store
        if not self.by_episode:  # version 3: at the last rows (allocated with the reservation)
            last_rows = self.layout.rows(lane, st.written + np.flatnonzero(done))
            for name, arr in finals.items():
                store.column(f"final/{name}").write_at(last_rows, arr)
            return
        count = next(iter(finals.values())).shape[0] if finals else 0
        segments = self.layout.segments(lane, st.ep_tail, st.ep_tail + count)  # the same ring arithmetic
        for name, arr in finals.items():
            col = store.column(f"final/{name}")
            off = 0
            for a, b in segments:  # allocated by ``reserve``
                col.write_range(a, arr[off : off + b - a])
                off += b - a

    def write_many(self, lanes: np.ndarray, seqs: np.ndarray, last: np.ndarray, finals: Mapping[str, np.ndarray]) -> None:
        """:meth:`write` for episodes of several lanes at once: the final observation
        ``finals[c][i]`` of episode ``seqs[i]`` of lane ``lanes[i]``, whose last row is
        the absolute row ``last[i]`` of its lane (slots allocated by ``reserve``)."""
        at = self.layout.rows(lanes, seqs if self.by_episode else last)  # a ring of lane_size slots, or the row
        for name, arr in finals.items():
            col = self.store.column(f"final/{name}")
            if col.mapped() is not None:
                col.write_at(at, arr)
                continue
            for lane in np.unique(lanes).tolist():  # a backend written in each lane's order
                pick = np.flatnonzero(lanes == lane)
                for a, b, off in _runs(at[pick]):
                    col.write_range(a, arr[pick[off : off + b - a]])

    def flush(self, lane: int, was: Lane, now: Lane) -> None:
        """Make the final observations written since the commit ``was`` durable: the
        slots of episodes ``was.ep_tail .. now.ep_tail``, the open episode's included
        (a provisional end that ``appending.py`` undid for the commit keeps it there)."""
        if not self.by_episode:
            for a, b in self.layout.segments(lane, was.written, now.written):
                for name in self.names:
                    self.store.array(name).flush(a, b)
            return
        for a, b in self.layout.segments(lane, was.ep_tail, now.ep_tail + 1):
            for name in self.names:
                self.store.array(name).flush(a, b)

    def discard(self, lane: int, st: Lane) -> None:
        """Give back the disk of the slots of episodes whose rows are all overwritten
        (lane cursors ``st``, after an extend's eviction).

        Episodes below ``ep_head - 1`` qualify: each ended where a later evicted one
        began, below ``written - lane_size``, so a reader that reads their slot fails
        its re-check. Only slots still holding their episode and not allocated ahead
        for a newer one (``k >= allocated - lane_size``: ``k + lane_size`` has neither
        ended nor had its slot allocated) are touched, and the range
        reaches back a few slots already given back, so the file-system blocks that
        straddle two calls' ranges are freed too.
        """
        if not self.by_episode or not self.row_bytes:
            return
        hi = st.ep_head - 1
        freed = self._freed[lane]
        if hi <= freed or (hi - freed) * self.row_bytes < _DISCARD_BYTES and hi - freed < self.layout.lane_size:
            return
        lo = max(freed - self._back, max(self._allocated[lane], st.ep_tail + 1) - self.layout.lane_size, 0)
        for a, b in self.layout.segments(lane, lo, hi):
            for name in self.names:
                self.store.array(name).discard(a, b)
        self._freed[lane] = hi


def _runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """``(start, stop, offset)`` of each run of consecutive ``rows`` (sorted within a
    lane's ring but for one wrap), ``offset`` its first position in ``rows``."""
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], cut)).astype(np.int64)
    stops = np.concatenate((cut, [len(rows)])).astype(np.int64)
    return [(int(rows[a]), int(rows[a]) + int(b - a), int(a)) for a, b in zip(starts, stops)]
