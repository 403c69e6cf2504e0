"""Appending rows to lanes: ``Writer.extend``, the disk room a lane's reservation
allocates ahead of it, and undoing a provisional episode end.

``Appending`` is the part of ``writer.Writer`` (which derives from it) that writes
rows; the reservation, recovery and commit protocol it follows are in ``writer.py``'s
docstring.

Undoing a provisional end (:func:`reopen_last_episode`, :func:`end_open_episode`):
the newest episode of a lane, ended at the lane's last row and not committed yet,
becomes the lane's open episode again. A writer that knows the next observation of an open episode's last row (a TorchRL
collector batch carries it under ``("next", ...)``) can end the episode there as
truncated, with that observation as its final one, so the row is sampleable at
once; when the episode goes on, it undoes that end before writing the next rows,
whose first observation is the one stored as final (``mmbuffer.torchrl``).

Only an uncommitted end is undone: a reader (or a reopen after a crash) may hold
the slot of a committed one, and readers never see the uncommitted rows whose flag
changes here. These functions change the writer's state (the ``truncated`` flag of
one row, the lane's ``ep_tail``) under the same lock, through the store; the
slice counts samplers keep notice the changed end themselves
(``samplers/_draw.py: SliceCounts.sync``).

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/r", {"obs": ((), "float32")}, capacity=8)
>>> buf.extend({"obs": np.arange(3), "truncated": [False, False, True]}, final_obs={"obs": [3.0]})
>>> buf.num_episodes, reopen_last_episode(buf.store, 0), buf.num_episodes
(1, True, 0)
>>> end_open_episode(buf.store, 0), buf.episodes()[1].tolist()  # and back: its final observation is kept
(True, [3])
>>> reopen_last_episode(buf.store, 0)
True
>>> buf.extend({"obs": [3.0], "terminated": [True]}, final_obs={"obs": [4.0]})
>>> buf.episodes()[1].tolist(), buf.get(np.arange(4), ["next_obs"])["next_obs"].tolist()
([4], [1.0, 2.0, 3.0, 4.0])
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from .. import errors, tree
from .._disk import format as fmt
from .._disk import rawio as _rawio
from .._disk.checks import as_numpy, check_stream, validate_final, validate_steps
from .._disk.guards import locked_write
from ..config import config
from . import index, touched
from .finals import FinalsWriter
from .index import Lane
from .layout import Layout
from .manifest import MAX_COUNTER
from .snapshot import Ledger
from .store import Store

__all__ = ["Appending", "end_open_episode", "reopen_last_episode", "reopen_last_episodes"]
_ROOM_BYTES = 1 << 24  # disk allocated ahead of a lane's cursor, at most (see Appending._room_rows)


def reopen_last_episode(store: Store, lane: int) -> bool:
    """Undo the end of ``lane``'s newest episode if it ends at the lane's last row,
    as truncated, after the last commit; return whether it was undone (nothing
    changes otherwise). The row's ``truncated`` flag is cleared and the lane's
    episode count goes back by one, so the next ``extend`` of the lane continues
    that episode (its stale ``final/<col>`` row is never read again).
    Raises ``ReadOnlyError`` on a store opened with ``mode="r"``."""
    if store.mode != "a":
        raise errors.ReadOnlyError(f"reopen: store {store.path} is opened with mode='r'")
    with store.lock:
        st, was = store.lanes[lane], store.committed[lane]
        if st.ep_tail <= max(st.ep_head, was.ep_tail):
            return False  # no live complete episode, or its end is committed
        end = int(index.ends_at(store.ends, lane, store.lane_size, np.array(st.ep_tail - 1)))
        row = store.layout.rows(lane, np.array([st.written - 1], dtype=np.int64))
        if end != st.written or not store.column("truncated").read(row).all() or store.column("terminated").read(row).any():
            return False
        store.column("truncated").write_at(row, np.zeros(1, dtype=bool))
        store.ledger = store.ledger.with_lane(lane, replace(st, ep_tail=st.ep_tail - 1))
    return True


def reopen_last_episodes(store: Store, lanes: Sequence[int] | np.ndarray) -> np.ndarray:
    """:func:`reopen_last_episode` of several distinct lanes at once (the same checks
    and changes, vectorized over the lanes); whether each was undone.

    >>> import tempfile, numpy as np, mmbuffer as mb
    >>> buf = mb.create(tempfile.mkdtemp() + "/r", {"obs": ((), "float32")}, capacity=8, num_streams=2)
    >>> ends = np.array([[False, True], [False, False]])
    >>> buf.extend({"obs": [[0.0, 1.0], [5.0, 6.0]], "truncated": ends}, stream=[0, 1], final_obs={"obs": [2.0]})
    >>> reopen_last_episodes(buf.store, [0, 1]).tolist(), buf.num_episodes
    ([True, False], 0)
    """
    if store.mode != "a":
        raise errors.ReadOnlyError(f"reopen: store {store.path} is opened with mode='r'")
    lanes = np.asarray(lanes, dtype=np.int64).reshape(-1)
    with store.lock:
        sts = [store.lanes[lane] for lane in lanes.tolist()]
        tail = np.array([st.ep_tail for st in sts], dtype=np.int64)
        written = np.array([st.written for st in sts], dtype=np.int64)
        floor = np.array([max(st.ep_head, store.committed[lane].ep_tail) for lane, st in zip(lanes.tolist(), sts)], dtype=np.int64)
        rows = store.layout.rows(lanes, written - 1)
        ok = (tail > floor) & (store.ends[index.lane_slots(lanes, store.lane_size, tail - 1)] == written)
        ok[ok] &= store.column("truncated").read(rows[ok]) & ~store.column("terminated").read(rows[ok])
        if ok.any():
            store.column("truncated").write_at(rows[ok], np.zeros(int(ok.sum()), dtype=bool))
            new = list(store.ledger.lanes)
            for k in np.flatnonzero(ok).tolist():
                new[int(lanes[k])] = replace(sts[k], ep_tail=sts[k].ep_tail - 1)
            store.ledger = Ledger(tuple(new), store.ledger.committed, store.ledger.generation)
    out: np.ndarray = ok
    return out


def end_open_episode(store: Store, lane: int) -> bool:
    """End ``lane``'s open episode at the lane's last row, as truncated, with the
    ``final/<col>`` rows already there as its final observation: the inverse of
    :func:`reopen_last_episode`, for a writer that wrote that final observation
    before (``mmbuffer.torchrl`` keeps episodes open across its commits this way).
    Returns whether an episode was ended (False: no open episode). The end is
    uncommitted; the row's flag is written through at once, so a commit of the end
    never reaches the disk before it."""
    if store.mode != "a":
        raise errors.ReadOnlyError(f"end_open_episode: store {store.path} is opened with mode='r'")
    with store.lock:
        st = store.lanes[lane]
        if st.written <= st.open_start(store.ends, lane, store.lane_size):
            return False
        row = store.layout.rows(lane, np.array([st.written - 1], dtype=np.int64))
        store.column("truncated").write_at(row, np.ones(1, dtype=bool))
        store.array("columns/truncated").flush(int(row[0]), int(row[0]) + 1)
        store.ends[index.slots(lane, store.lane_size, np.array([st.ep_tail]))] = st.written
        store.ledger = store.ledger.with_lane(lane, replace(st, ep_tail=st.ep_tail + 1))
    return True


class Appending:
    """The row-writing part of ``writer.Writer`` (its only subclass, which sets the
    attributes below and holds the store's lock in every method)."""

    store: Store
    layout: Layout
    lane_size: int
    _ends: np.ndarray
    _reserved: np.ndarray
    _record: np.ndarray | None
    _tree: tree.PriorityTree | None
    _marks: touched.Marks | None
    _marks_array: Any
    _finals: FinalsWriter

    def check_writable(self, what: str) -> None:
        raise NotImplementedError  # writer.Writer's

    def commit(self) -> int:
        raise NotImplementedError  # writer.Writer's

    def _mark_tree_dirty(self) -> None:
        raise NotImplementedError  # writer.Writer's

    def _default_priority(self) -> float:
        raise NotImplementedError  # writer.Writer's

    @locked_write("extend")
    def extend(
        self, steps: Mapping[str, Any], stream: int | Sequence[int] | np.ndarray = 0, final_obs: Mapping[str, Any] | None = None
    ) -> None:
        """Append ``T`` consecutive rows of one lane, or of each of several lanes
        (``stream`` a sequence: :meth:`_extend_streams`) (see ``Buffer.extend``)."""
        self.check_writable("extend")
        if isinstance(stream, (Sequence, np.ndarray)):
            return self._extend_streams(steps, stream, final_obs)
        store = self.store
        lane = check_stream(stream, store.num_streams)
        arrays, done = validate_steps(store.columns, steps)
        rows = len(done)
        if rows == 0:
            return
        finals = validate_final(store.columns, store.next_keys, final_obs, int(done.sum()))
        st = store.lanes[lane]
        index.check_fits(st, self._ends, lane, self.lane_size, done)

        new_written = st.written + rows
        if new_written > MAX_COUNTER:  # what an open would refuse is never written
            raise errors.CapacityError(
                f"extend: stream {lane}: expected at most {MAX_COUNTER} rows ever written to a stream "
                f"(2**62), got {st.written} + {rows}"
            )
        reserved = min(new_written + self._room_rows(), MAX_COUNTER) if new_written > int(self._reserved[lane]) else None
        if reserved is not None:
            self._reserve_space(lane, st, reserved, rows)  # a full disk refuses here, before any change
        self._finals.reserve(lane, st, len(next(iter(finals.values()))) if finals else 0)  # and here
        if new_written > store.committed[lane].written + self.lane_size:
            # a lane's uncommitted rows never exceed a lane, so the reservation stays
            # within written + 2 * lane_size of the last commit, the bound an open
            # checks (_counters.check_reserved), whenever the writer dies
            self.commit()
        if reserved is not None:
            self._reserved[lane] = reserved
            _rawio.flush_rows(self._reserved, lane, lane + 1)  # on disk before any row it covers
        assert self._record is not None
        self._record[2 + lane] = new_written  # in the page cache before any row it covers (progress.py)
        if self._tree is not None:
            self._mark_tree_dirty()  # before anything it marks is written

        segments = self.layout.segments(lane, st.written, new_written)
        for name, arr in arrays.items():
            col = store.column(name)
            off = 0
            for a, b in segments:
                col.write_range(a, arr[off : off + b - a])
                off += b - a
        if finals:
            self._finals.write(lane, st, done, finals)
        st = index.append(self._ends, lane, self.lane_size, st, rows=rows, done=done)
        st, dropped_end = index.evict(self._ends, lane, self.lane_size, st, new_written - self.lane_size)
        store.ledger = store.ledger.with_lane(lane, st)  # published whole: the view sees the rows from here
        self._finals.discard(lane, st)
        if self._tree is not None:
            # overwritten and evicted rows leave the tree before the default is
            # taken, so a new row gets the max of what stays live
            assert self._marks is not None
            for a, b in self.layout.segments(lane, max(0, new_written - rows - self.lane_size), dropped_end):
                self._marks.range(a, b)
                tree.set_range(self._tree, a, b, 0.0)
            default = self._default_priority()
            for a, b in segments:
                self._marks.range(a, b)
                tree.set_range(self._tree, a, b, default)

    # -- several lanes at once -------------------------------------------------------------
    def _extend_streams(self, steps: Mapping[str, Any], streams: Sequence[int] | np.ndarray, final_obs: Mapping[str, Any] | None) -> None:
        """Append ``T`` rows to each of the ``K`` distinct lanes ``streams``: every array of
        ``steps`` is ``[K, T, *shape]``, ``final_obs`` holds the final observations of the
        episodes ending in it in row order (lane by lane). The same store as ``K``
        single-lane ``extend`` calls in that order (the same rows, index, final
        observations, reservation, priorities; the same commit when one of them would
        commit first), but every check runs, and every refusal is raised, before
        anything changes; the bookkeeping is vectorized over the lanes.

        >>> import tempfile, mmbuffer as mb
        >>> buf = mb.create(tempfile.mkdtemp() + "/k", {"x": ((), "int64")}, capacity=6, num_streams=3, next_keys=())
        >>> buf.extend({"x": [[1, 2], [3, 4]]}, stream=[2, 0])  # 2 rows to stream 2, 2 to stream 0
        >>> buf.get(np.arange(6), ["x"])["x"].tolist(), [st.written for st in buf.store.lanes]
        ([3, 4, 0, 0, 1, 2], [2, 0, 2])
        """
        store, n = self.store, self.lane_size
        lanes = _check_streams(streams, store.num_streams)
        arrays, done = _validate_batch(store, steps, len(lanes))
        k_count, rows = done.shape
        if rows == 0 or k_count == 0:
            return
        per_lane = done.sum(axis=1)
        finals = validate_final(store.columns, store.next_keys, final_obs, int(per_lane.sum()))
        sts = [store.lanes[lane] for lane in lanes.tolist()]
        written = np.array([st.written for st in sts], dtype=np.int64)
        tail = np.array([st.ep_tail for st in sts], dtype=np.int64)
        if rows > n:
            raise errors.CapacityError(f"extend: expected at most lane_size={n} rows per call, got {rows}")
        first = np.where(done.any(axis=1), done.argmax(axis=1) + 1, rows)
        head = np.array([st.ep_head for st in sts], dtype=np.int64)
        first_start = np.array([st.first_start for st in sts], dtype=np.int64)
        opened = np.where(tail == head, first_start, self._ends[index.lane_slots(lanes, n, tail - 1)])
        length = written + first - opened
        if (length > n).any():
            k = int(np.argmax(length > n))
            raise errors.CapacityError(
                f"stream {lanes[k]}: an episode of {length[k]} rows does not fit a lane of {n} rows; "
                "mark it truncated earlier or create the store with a larger capacity per stream"
            )
        new_written = written + rows
        if (new_written > MAX_COUNTER).any():
            k = int(np.argmax(new_written > MAX_COUNTER))
            raise errors.CapacityError(
                f"extend: stream {lanes[k]}: expected at most {MAX_COUNTER} rows ever written to a stream "
                f"(2**62), got {written[k]} + {rows}"
            )
        grow = new_written > self._reserved[lanes]
        reserved = np.minimum(new_written + (self._room_rows() if grow.any() else 0), MAX_COUNTER)
        for k in np.flatnonzero(grow).tolist():
            self._reserve_space(int(lanes[k]), sts[k], int(reserved[k]), rows)  # a full disk refuses here, before any change
        for k in np.flatnonzero(per_lane).tolist():
            self._finals.reserve(int(lanes[k]), sts[k], int(per_lane[k]))  # and here
        committed = np.array([store.committed[lane].written for lane in lanes.tolist()], dtype=np.int64)
        over = np.flatnonzero(new_written > committed + n)
        cut = int(over[0]) if over.size else k_count  # where single-lane extends would commit first
        every = np.arange(k_count)
        if cut:
            self._append_lanes(every[:cut], lanes, sts, arrays, done, finals, per_lane, grow, reserved)
        if cut < k_count:
            self.commit()  # as a single-lane extend of lane ``cut`` would, before its rows
            self._append_lanes(every[cut:], lanes, sts, arrays, done, finals, per_lane, grow, reserved)

    def _append_lanes(
        self, part: np.ndarray, lanes: np.ndarray, sts: list[Lane], arrays: dict[str, np.ndarray], done: np.ndarray,
        finals: dict[str, np.ndarray], per_lane: np.ndarray, grow: np.ndarray, reserved: np.ndarray,
    ) -> None:
        """The writes of :meth:`_extend_streams` for the lanes ``lanes[part]`` (checked and
        room allocated), in a single-lane ``extend``'s order."""
        store, n, rows = self.store, self.lane_size, done.shape[1]
        lanes, done, sts = lanes[part], done[part], [sts[k] for k in part.tolist()]
        written = np.array([st.written for st in sts], dtype=np.int64)
        tail = np.array([st.ep_tail for st in sts], dtype=np.int64)
        new_written = written + rows
        up = grow[part]
        if up.any():
            self._reserved[lanes[up]] = reserved[part][up]
            lo, hi = int(lanes[up].min()), int(lanes[up].max())
            _rawio.flush_rows(self._reserved, lo, hi + 1)  # on disk before any row it covers
        assert self._record is not None
        self._record[2 + lanes] = new_written  # in the page cache before any row it covers (progress.py)
        if self._tree is not None:
            self._mark_tree_dirty()  # before anything it marks is written

        from ..kernels.scatter import scatter_runs  # compiled on first use, never at import

        at = self.layout.rows(lanes[:, None], written[:, None] + np.arange(rows, dtype=np.int64)).reshape(-1)
        span = slice(int(part[0]) * rows, (int(part[-1]) + 1) * rows)  # parts are consecutive lanes
        pos = written % n
        head = np.minimum(rows, n - pos)  # each lane's rows up to its ring's seam, then the rest
        runs = (np.concatenate((lanes * n + pos, lanes * n)), np.concatenate((np.arange(len(lanes)) * rows,) * 2)
                + np.concatenate((np.zeros_like(head), head)), np.concatenate((head, rows - head)))
        for name, arr in arrays.items():
            col, block = store.column(name), arr[span]
            mapped = col.mapped()
            if mapped is not None and _rawio.stores_through_map(mapped, rows):
                src = np.ascontiguousarray(block)
                scatter_runs(mapped.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8), *runs, src[0].nbytes)
                continue
            for k, lane in enumerate(lanes.tolist()):  # large blocks (pwrite), or a backend written in lane order
                off = k * rows
                for a, b in self.layout.segments(lane, int(written[k]), int(new_written[k])):
                    col.write_range(a, block[off : off + b - a])
                    off += b - a
        where_k, where_t = np.nonzero(done)
        seqs = tail[where_k] + (np.cumsum(done, axis=1) - 1)[where_k, where_t]
        if finals:
            lo = int(per_lane[: part[0]].sum())
            mine = {k: v[lo : lo + len(seqs)] for k, v in finals.items()}
            self._finals.write_many(lanes[where_k], seqs, written[where_k] + where_t, mine)
        self._ends[index.lane_slots(lanes[where_k], n, seqs)] = written[where_k] + where_t + 1
        dropped = new_written - n
        new_lanes = list(store.ledger.lanes)
        for k, lane in enumerate(lanes.tolist()):
            st = Lane(int(new_written[k]), sts[k].ep_head, int(tail[k] + per_lane[part[k]]), sts[k].first_start)
            if st.num_episodes and st.first_start < dropped[k]:  # the lane wrapped onto its oldest episode
                st, end = index.evict(self._ends, lane, n, st, int(dropped[k]))
                dropped[k] = end
            new_lanes[lane] = st
        ledger = store.ledger
        store.ledger = Ledger(tuple(new_lanes), ledger.committed, ledger.generation)  # the view sees every lane's rows
        for lane in lanes.tolist():
            self._finals.discard(lane, new_lanes[lane])
        if self._tree is not None:
            # a single-lane extend zeroes what its lane overwrites and evicts, then takes
            # the default (the max of what stays live); for the lanes after the first
            # that default is the same (their new rows hold it), so the first lane's
            # zeroing comes first, the others' after it
            assert self._marks is not None
            default = 0.0
            for k, lane in enumerate(lanes.tolist()):
                lo = max(0, int(written[k]) - n) if k == 0 else max(0, int(new_written[k]) - n)
                for a, b in self.layout.segments(lane, lo, int(dropped[k])):
                    self._marks.range(a, b)
                    tree.set_range(self._tree, a, b, 0.0)
                if k == 0:
                    default = self._default_priority()
            self._marks.rows(at)
            tree.update(self._tree, at, np.full(len(at), default))

    # -- disk room ---------------------------------------------------------------------------
    def _reserve_space(self, lane: int, st: Lane, stop: int, rows: int) -> None:
        """Allocate the disk blocks the writes up to a lane's absolute row ``stop`` need.

        Small blocks of rows, episode ends and priority leaves are stored through
        memory maps of sparse files, and a store into a hole on a full disk can only
        be a SIGBUS. So blocks are allocated (``posix_fallocate``; ``OSError(ENOSPC)``
        when there is no room) with the reservation, before it advances: the rows
        ``[written, stop)`` of the lane's first pass through the ring (a version 3
        store's final rows too; version 4 allocates each final slot as it writes it:
        ``finals.py``), and the ``index/ends`` slots of the episodes that can end in
        them (one per row at most). Once a lane has wrapped, what it rewrites is
        allocated already; ``index/reserved`` at creation; the tree's node rows
        over those rows with them (the tree file is created sparse). The mapped
        arrays' pages under those rows are then faulted in for writing in one call
        (``_populate``): the window's page faults in bulk, not one by one in the
        extends that follow; not a column's whose ``rows`` rows a lane go by pwrite
        (``rawio.stores_through_map``): a 20M-row ``convert d4rl`` spent 3.7 s of 19 s
        faulting in pages that pwrite then filled, and a mapped page is not dropped behind."""
        w, t = st.written, st.ep_tail
        if w < self.lane_size:
            base, hi = lane * self.lane_size, min(stop, self.lane_size)
            for name in self._row_arrays(with_tree=True):
                self.store.array(name).allocate(base + w, base + hi)
            for name in self._row_arrays(with_tree=True):  # and faulted in at once, once all are allocated
                if (mapped := self.store.array(name).mapped()) is not None and (
                        not name.startswith("columns/") or _rawio.stores_through_map(mapped, rows)):
                    _populate(mapped, base + w, base + hi)
            for a, b in tree.node_rows(self._tree, base + w, base + hi) if self._tree is not None else ():
                self.store.array("priority/nodes").allocate(a, b)
            if self._tree is not None:  # the marks of those rows' blocks (touched.py)
                self._marks_array.allocate((base + w) // tree.BLOCK, (base + hi - 1) // tree.BLOCK + 1)
        slots = 2 * self.lane_size
        if t < slots:
            self.store.array("index/ends").allocate(lane * slots + t, lane * slots + min(t + stop - w, slots))

    def _row_arrays(self, *, with_tree: bool) -> list[str]:
        """The raw arrays with one row per store row that ``extend`` writes (every
        column array when ``with_tree`` is False: what a commit flushes)."""
        store = self.store
        skip_compressed = with_tree and store.compression is not None  # zarr allocates its own chunks
        names = [f"columns/{n}" for n in store.columns if not skip_compressed or n in fmt.RESERVED_NAMES]
        if with_tree and not store.finals_by_episode:  # version 3: a final row per row (finals.py flushes them)
            names += [f"final/{k}" for k in store.next_keys]
        return names + (["priority/leaves"] if with_tree and self._tree is not None else [])

    def _room_rows(self) -> int:
        """How far the reservation runs ahead of the cursor: ``config.reserve_fraction``
        of a lane, but at most ``_ROOM_BYTES`` of disk to allocate (1/16 of a 3e9-row
        lane would make a sparse store dense at once). Not cached: it is needed once a
        window, and a cached_property would turn the instance's attribute storage into
        a dict (CPython 3.11), which slowed every ``extend`` by 0.6 us."""
        store = self.store
        cols = [c for n, c in store.columns.items() if store.compression is None or n in fmt.RESERVED_NAMES]
        cols += [store.columns[k] for k in store.next_keys if not store.finals_by_episode]
        row_bytes = sum(int(np.prod(c.shape, dtype=np.int64)) * np.dtype(c.dtype).itemsize for c in cols)
        row_bytes += 8 + (4 if self._tree is not None else 0)  # an episode-end slot, a float32 leaf
        ahead = max(1, int(self.lane_size * config.reserve_fraction))
        return max(1, min(ahead, _ROOM_BYTES // row_bytes))


def _check_streams(streams: object, num_streams: int) -> np.ndarray:
    """``streams`` as distinct lanes (int64), or ``InvalidArgumentError``."""
    arr = np.asarray(streams) if not isinstance(streams, (str, bytes)) else np.asarray([streams])
    flags = isinstance(streams, Sequence) and any(isinstance(s, (bool, np.bool_)) for s in streams)
    if flags or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu") or ((arr < 0) | (arr >= num_streams)).any():
        raise errors.InvalidArgumentError(
            f"stream: expected an integer or a sequence of integers in [0, {num_streams}), got {streams!r}"
        )
    lanes = arr.astype(np.int64, copy=False)
    order = np.sort(lanes)
    if (order[1:] == order[:-1]).any():
        raise errors.InvalidArgumentError(f"stream: expected distinct streams, got {lanes.tolist()}")
    return lanes


def _validate_batch(store: Store, steps: Mapping[str, Any], k_count: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``steps`` (column -> ``[K, T, *shape]``) as ``[K * T, *shape]`` arrays of the
    columns' dtypes (``validate_steps``), and the end flags ``[K, T]``."""
    if not isinstance(steps, Mapping):
        raise errors.SchemaError(f"steps: expected a mapping column -> array, got {type(steps).__name__}")
    flat, length = {}, None
    for name, value in steps.items():
        arr = as_numpy(value, name)
        col = store.columns.get(name)
        if col is not None and (arr.ndim != 2 + len(col.shape) or arr.shape[0] != k_count or arr.shape[2:] != col.shape):
            raise errors.SchemaError(
                f"column {name!r}: expected an array [{k_count}, T, {', '.join(map(str, col.shape))}] "
                f"(one row of T steps per stream), got array of shape {tuple(arr.shape)}"
            )
        if col is not None and length is not None and arr.shape[1] != length:
            raise errors.SchemaError(f"steps: expected the same number of rows in every column, got {length} and {arr.shape[1]} ({name!r})")
        length = arr.shape[1] if col is not None else length
        flat[name] = arr.reshape(-1, *arr.shape[2:]) if col is not None else arr
    arrays, done = validate_steps(store.columns, flat)
    return arrays, done.reshape(k_count, length or 0)



_POPULATE_WRITE = 23  # MADV_POPULATE_WRITE (Linux 5.14+)
_madvise: Any = None


def _populate(mapped: np.ndarray | None, start: int, stop: int) -> None:
    """Fault in the pages under rows ``[start, stop)`` of a mapped array for writing, in
    one ``madvise(MADV_POPULATE_WRITE)``: about half the cost of the fault per page that
    the stores of ``extend`` would take (a fresh page of the reservation window, 2-3 us
    each on the dev VM). The data is unchanged (the blocks are allocated: zeros); where
    the call is refused (another OS, an older kernel, no memory) nothing happens and
    the stores fault as before."""
    global _madvise
    if mapped is None or stop <= start or not sys.platform.startswith("linux"):
        return
    if _madvise is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise = libc.madvise
    row = mapped.strides[0] if mapped.ndim else mapped.itemsize
    lo, hi = mapped.ctypes.data + start * row, mapped.ctypes.data + stop * row
    lo -= lo % mmap.PAGESIZE
    _madvise(lo, hi - lo, _POPULATE_WRITE)
