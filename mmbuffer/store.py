"""The store: columns on disk, the episode index and the priority tree, committed together.

``Store`` owns the files (layout in ``_format.py``), the per-lane cursors and the
commit protocol. It writes rows, keeps the episode index and the priority tree in
step with them at write time, and hands samplers a consistent ``View``. It never
samples and never converts to torch: ``Buffer`` (``buffer.py``) does that on top.

Lanes. A store of ``capacity`` rows has ``num_streams`` lanes of
``lane_size = capacity // num_streams`` rows; lane ``l`` owns global rows
``[l * lane_size, (l + 1) * lane_size)`` and is a ring: absolute row ``a`` of the
lane lives at global row ``l * lane_size + a % lane_size``.

Visibility. The writer samples rows as soon as ``extend`` returns; ``commit``
makes them durable and visible to readers. A ring overwrites committed rows before
the next commit, so the writer first *reserves* rows ahead of its cursor in
``index/reserved`` (a memory-mapped counter, bumped by ``config.reserve_fraction``
of a lane at a time, at most 16 MiB of rows, whose disk blocks are allocated first:
``Store._reserve_space``). Readers, and a writer reopening after a crash, treat every
committed episode whose first row lies below ``reserved - lane_size`` as evicted:
they never sample a row the writer may be rewriting, and a kill at any instant
leaves the last commit readable.

The open episode. The last row of a lane's unfinished episode has no next
observation yet (it arrives with the next ``extend``), so when the store derives
``next_*`` columns that row is not sampleable until the next extend; without
next-derived columns every extended row is.

Commit protocol (docs/design.md): the rows written since the last commit are msync'ed,
then the index and the tree, then ``manifest.json`` is replaced atomically.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np

from . import _counters, _safe_io, errors, index, tree, zarr_view
from . import _format as fmt
from ._checks import as_numpy, check_stream, row_ids, validate_final, validate_steps
from ._guards import acquire_lock, locked, locked_write, raise_typed
from ._manifest import Manifest, load_manifest
from .columns import ColumnArray, RawArray, ZarrArray
from .config import config
from .create import create_store
from .index import Lane
from .layout import Layout
from .schema import Column, PriorityConfig

__all__ = ["Column", "LaneView", "PriorityConfig", "Snapshot", "Store", "View", "create_store", "locked"]
_ROOM_BYTES = 1 << 24  # disk allocated ahead of a lane's cursor, at most (see Store._room_rows)

@dataclass(frozen=True, slots=True)
class LaneView:
    """What a sampler may use of one lane (absolute row counters)."""

    first_start: int  # start of the oldest live episode
    ep_head: int
    ep_tail: int
    open_start: int  # start of the open episode (== visible_end when none)
    visible_end: int  # one past the last sampleable row


@dataclass(frozen=True, slots=True)
class View:
    """A consistent snapshot of the index for samplers: cursors plus the ring, and
    the priority tree (None without priorities). Samplers read nothing else."""

    lanes: tuple[LaneView, ...]
    ends: np.ndarray
    layout: Layout
    written: np.ndarray  # int64 [num_streams], rows ever written per lane
    generation: int
    tree: tree.PriorityTree | None = None

    @property
    def lane_size(self) -> int:
        return self.layout.lane_size


Snapshot = View  # docs/design.md's name


class Store:
    """Columns, index and tree of one store directory. Use ``mb.create``/``mb.open``.

    Thread-safe: every method that reads or changes cursors, index, tree or rows
    holds ``self._lock`` (re-entrant), so a prefetching thread may sample while
    the training thread extends, commits and updates priorities.
    """

    _thread_safe = True

    def __init__(self, path: str | os.PathLike[str], mode: str = "a") -> None:
        self._lock = threading.RLock()
        self._sampler_cache: dict[Any, Any] = {}  # samplers' state derived from the index (slice counts)
        if mode not in ("r", "a"):
            raise errors.InvalidArgumentError(f"mode: expected 'r' or 'a', got {mode!r}")
        self.path = Path(path)
        self.mode = mode
        manifest = load_manifest(self.path)
        self._lock_fd: int | None = None
        self._data: dict[str, ColumnArray] = {}  # every column, behind its backend (mmbuffer.columns)
        self._final: dict[str, ColumnArray] = {}
        if mode == "a":
            try:
                self._lock_fd = acquire_lock(self.path)
            except OSError as exc:  # a read-only filesystem, no space for the LOCK file
                raise_typed(exc, "open(mode='a')", self.path)
                raise
        try:
            self._load(manifest)
        except BaseException:
            self._release_lock()
            raise

    # -- opening -----------------------------------------------------------------------
    def _load(self, manifest: Manifest) -> None:
        """Open the files the checked manifest names, check the counters, then ``_recover``."""
        self.capacity = manifest.capacity
        self.num_streams = manifest.num_streams
        self.lane_size = manifest.lane_size
        self.compression: str | None = manifest.compression
        self.columns = {name: Column(shape, dt.name) for name, (shape, dt) in manifest.columns.items()}
        self.next_keys: tuple[str, ...] = manifest.next_keys
        self.priorities = PriorityConfig(**manifest.priorities) if manifest.priorities else None
        self.attrs: dict[str, Any] = dict(manifest.attrs)
        self.generation = manifest.generation
        self._schema = manifest.schema()
        self._manifest = manifest  # what the next commit rewrites (fields that never change)
        self.layout = Layout(self.capacity, self.num_streams)  # all ring arithmetic (layout.py)
        writable = self.mode == "a"
        root = self.path
        cap = self.capacity
        for name, (shape, dt) in manifest.columns.items():
            expect = (cap, shape, dt)
            if name in fmt.RESERVED_NAMES or self.compression is None:  # the fd: pwrite and pread
                self._data[name] = RawArray.open(root, f"columns/{name}", writable=writable, expect=expect)
            else:
                self._data[name] = ZarrArray.open(root, f"columns/{name}", writable=writable, expect=expect)
        final = {k: (cap, *manifest.columns[k]) for k in self.next_keys}
        self._final = {k: RawArray.open(root, f"final/{k}", writable=writable, expect=e) for k, e in final.items()}
        self._ends = fmt.open_raw(root, "index/ends", writable=writable, expect=(2 * cap, (), np.dtype(np.int64)))
        self._reserved = fmt.open_raw(root, "index/reserved", writable=writable, expect=(self.num_streams, (), np.dtype(np.int64)))
        self._tree: tree.PriorityTree | None = None
        if self.priorities is not None:
            layout = {k: (s[0], tuple(s[1:]), np.dtype(t)) for k, (s, t) in tree.layout(cap).items()}
            self._tree = tree.PriorityTree(**{k: fmt.open_raw(root, f"priority/{k}", writable=writable, expect=e) for k, e in layout.items()})
            _safe_io.lexists(root, "priority/DIRTY")  # a link there would be touched through
        self._committed = list(manifest.lanes)
        _counters.check_lanes(self._ends, self._reserved, self._committed, self.lane_size, str(self.path / fmt.MANIFEST), writer=writable)
        self._lanes = list(self._committed)
        if writable:
            self._recover()

    def _recover(self) -> None:
        """Drop what an interrupted writer may have left past the last commit.

        Committed episodes whose rows the dead writer may have overwritten (below
        ``reserved - lane_size``) are evicted and that state is committed at once.
        The reservation stays where the dead writer left it: a reader still holding
        an older commit must keep away from the rows that writer may have rewritten,
        and the reservation is the only record of how far that went.
        """
        self._reserved_floor = np.array(self._reserved, dtype=np.int64)
        torn = False
        for lane in range(self.num_streams):
            st = self._lanes[lane]
            self._lanes[lane] = index.drop_below(self._ends, lane, self.lane_size, st, self._reserved_threshold(lane))
            torn = torn or self._lanes[lane] != st
        self._tree_dirty = False
        dirty = self.path / "priority" / "DIRTY"
        if self._tree is not None and (torn or dirty.exists()):
            self._zero_invisible_priorities()
            tree.rebuild(self._tree)
            self._tree_dirty = True
        if torn or self._tree_dirty:
            self.commit()

    def _reserved_threshold(self, lane: int) -> int:
        """Rows below this may have been rewritten by a writer past its last commit."""
        return int(self._reserved[lane]) - self.lane_size

    def _release_reservation(self) -> None:
        """Lower the reservation to the committed cursors on a clean close, never below
        what a writer that died before this one may have written (see ``_recover``)."""
        for lane, st in enumerate(self._committed):
            self._reserved[lane] = max(st.written, int(self._reserved_floor[lane]))
        fmt.flush_rows(self._reserved, 0, len(self._reserved))

    @property
    def lock(self) -> threading.RLock:
        """The re-entrant lock every method that reads or changes cursors, index, tree
        or rows holds: hold it to make several calls one step (a prefetch thread)."""
        return self._lock

    def reservation(self) -> np.ndarray:
        """The writer's reservation per lane, read now from the shared map: rows of a
        lane below ``reservation()[lane] - lane_size`` may be being rewritten."""
        return np.array(self._reserved, dtype=np.int64)

    def _zero_invisible_priorities(self) -> None:
        """Give priority 0 to every row of a lane outside its live range."""
        assert self._tree is not None
        for lane, st in enumerate(self._lanes):
            for a, b in self.layout.segments(lane, st.written, st.first_start + self.lane_size):
                tree.set_range(self._tree, a, b, 0.0)

    # -- inspection --------------------------------------------------------------------
    def __len__(self) -> int:
        """Live rows: rows of live complete episodes plus the open episodes' rows."""
        return int(sum(v.visible_end - v.first_start for v in self.view().lanes))

    @property
    def num_episodes(self) -> int:
        """Live complete episodes over all lanes."""
        return int(sum(v.ep_tail - v.ep_head for v in self.view().lanes))

    @locked
    def view(self) -> View:
        """The index as samplers may use it now (see the module docstring)."""
        lanes = []
        written = np.empty(self.num_streams, dtype=np.int64)
        for lane in range(self.num_streams):
            st = self._lanes[lane]
            written[lane] = st.written
            if self.mode == "r":  # a reader keeps away from rows the writer may be rewriting
                st = index.drop_below(self._ends, lane, self.lane_size, st, self._reserved_threshold(lane))
            open_start = st.open_start(self._ends, lane, self.lane_size)
            visible_end = st.written - (1 if self.next_keys and st.written > open_start else 0)
            lanes.append(LaneView(st.first_start, st.ep_head, st.ep_tail, open_start, visible_end))
        return View(tuple(lanes), self._ends, self.layout, written, self.generation, self._tree)

    def episode_bounds(self, view: View | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Global start row and length of every live complete episode (lane order)."""
        view = view or self.view()
        starts, lengths = [], []
        for lane, lv in enumerate(view.lanes):
            st = Lane(int(view.written[lane]), lv.ep_head, lv.ep_tail, lv.first_start)
            s, n = index.starts_lengths(self._ends, lane, self.lane_size, st)
            starts.append(lane * self.lane_size + s % self.lane_size)
            lengths.append(n)
        return np.concatenate(starts), np.concatenate(lengths)

    def column(self, name: str) -> ColumnArray:
        """The backend array of a stored column or of ``final/<name>`` (``"final/obs"``):
        what gather kernels read (``column(name).mapped()`` when the bytes are mapped)."""
        if name.startswith("final/"):
            return self._final[name[6:]]
        return self._data[name]

    def read(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of a stored column or of ``final/<name>`` (``name = "final/obs"``)."""
        return self.column(name).read(rows)

    def read_range(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` of a stored column (global row numbers, one lane's ring
        segment), copied into ``out`` when given.

        For scans: a raw column is read with ``pread``, which pulls pages in with
        read-ahead and maps nothing, where the ``MADV_RANDOM`` maps that serve
        gathers fault one page at a time (a sequential pass over 1 GB cached:
        0.6 s read and compared against 2.2 s through the map, on the dev VM).
        Takes no lock: the caller reads rows it knows are written.

        >>> import tempfile, numpy as np, mmbuffer as mb
        >>> buf = mb.create(tempfile.mkdtemp() + "/r", {"x": ((), "int32")}, capacity=8, next_keys=())
        >>> buf.extend({"x": np.arange(5)})
        >>> buf.read_range("x", 1, 4).tolist()
        [1, 2, 3]
        """
        return self._data[name].read_range(start, stop, out)

    # -- writing -----------------------------------------------------------------------
    @locked_write("extend")
    def extend(
        self,
        steps: Mapping[str, Any],
        stream: int = 0,
        final_obs: Mapping[str, Any] | None = None,
    ) -> None:
        """Append ``T`` consecutive rows of one lane.

        Parameters
        ----------
        steps:
            Column name -> array ``[T, *shape]`` (numpy, torch or nested lists).
            ``terminated`` / ``truncated`` may be omitted (then False).
        stream:
            The lane, ``0 <= stream < num_streams``.
        final_obs:
            Next-derived column -> ``[E, *shape]``: the observation after the last
            step of each of the ``E`` episodes that end inside ``steps``, in order.

        Raises
        ------
        ReadOnlyError, SchemaError, InvalidArgumentError, CapacityError
            Before anything is written.
        DiskFullError
            No disk space for the rows (see ``_reserve_space``); the store is as
            before the call, and the call may be repeated once space is freed.

        A block that would leave more than a lane of a stream's rows uncommitted
        commits the rows extended before it first.
        """
        self._check_writable("extend")
        lane = check_stream(stream, self.num_streams)
        arrays, done = validate_steps(self.columns, steps)
        rows = len(done)
        if rows == 0:
            return
        finals = validate_final(self.columns, self.next_keys, final_obs, int(done.sum()))
        st = self._lanes[lane]
        index.check_fits(st, self._ends, lane, self.lane_size, done)

        new_written = st.written + rows
        reserved = new_written + self._room_rows() if new_written > int(self._reserved[lane]) else None
        if reserved is not None:
            self._reserve_space(lane, st, reserved)  # a full disk refuses here, before any change
        if new_written > self._committed[lane].written + self.lane_size:
            # a lane's uncommitted rows never exceed a lane, so the reservation stays
            # within written + 2 * lane_size of the last commit, the bound an open
            # checks (_counters.check_reserved), whenever the writer dies
            self.commit()
        if reserved is not None:
            self._reserved[lane] = reserved
            fmt.flush_rows(self._reserved, lane, lane + 1)  # on disk before any row it covers
        if self._tree is not None:
            self._mark_tree_dirty()  # before anything it marks is written

        segments = self.layout.segments(lane, st.written, new_written)
        for name, arr in arrays.items():
            col = self._data[name]
            off = 0
            for a, b in segments:
                col.write_range(a, arr[off : off + b - a])
                off += b - a
        if finals:
            last_rows = self.layout.rows(lane, st.written + np.flatnonzero(done))
            for name, arr in finals.items():
                self._final[name].write_at(last_rows, arr)

        st = index.append(self._ends, lane, self.lane_size, st, rows=rows, done=done)
        threshold = new_written - self.lane_size
        st, dropped_end = index.evict(self._ends, lane, self.lane_size, st, threshold)
        self._lanes[lane] = st
        if self._tree is not None:
            # overwritten and evicted rows leave the tree before the default is
            # taken, so a new row gets the max of what stays live
            for a, b in self.layout.segments(lane, max(0, new_written - rows - self.lane_size), dropped_end):
                tree.set_range(self._tree, a, b, 0.0)
            default = self._default_priority()
            for a, b in segments:
                tree.set_range(self._tree, a, b, default)

    @locked_write("commit")
    def commit(self) -> int:
        """Make every extended row durable and visible to readers; return the generation.

        Raises
        ------
        DiskFullError
            No space for the new manifest: the last commit stays in place, the
            generation is unchanged, the extended rows stay extended, and
            ``commit`` may be called again once space is freed.
        """
        self._check_writable("commit")
        for lane in range(self.num_streams):
            segs = self.layout.segments(lane, self._committed[lane].written, self._lanes[lane].written)
            for a, b in segs:
                for col in (*self._data.values(), *self._final.values()):
                    col.flush(a, b)
            # the ring slots of the episodes added since the last commit
            for a, b in index.slot_ranges(lane, self.lane_size, self._committed[lane].ep_tail, self._lanes[lane].ep_tail):
                fmt.flush_rows(self._ends, a, b)
        self._flush_tree()
        self._write_manifest(self.generation + 1)  # the generation advances once it is written
        self.generation += 1
        self._committed = list(self._lanes)
        if self._tree is not None and self._tree_dirty:
            (self.path / "priority" / "DIRTY").unlink(missing_ok=True)
            self._tree_dirty = False
        zarr_view.publish(self.path, self.layout, self._committed, self.generation)  # live rows for Zarr readers
        return self.generation

    @locked
    def refresh(self) -> bool:
        """Reload the last commit (readers); return whether it changed."""
        manifest = load_manifest(self.path)
        if manifest.generation == self.generation:
            return False
        if self.mode == "a":
            return False  # the writer is the source of commits
        where = str(self.path / fmt.MANIFEST)
        if manifest.schema() != self._schema:
            raise errors.CorruptStoreError(f"{where}: expected the schema opened, {self._schema}, got {manifest.schema()}")
        lanes = list(manifest.lanes)
        _counters.check_lanes(self._ends, self._reserved, lanes, self.lane_size, where, writer=False, since=self._committed)
        self.generation = manifest.generation
        self.attrs = dict(manifest.attrs)
        self._committed = lanes
        self._lanes = list(self._committed)
        return True

    @locked
    def update_priorities(self, indices: Any, priorities: Any, written_at: np.ndarray | None = None) -> None:
        """Set new priorities (raw, before ``eps`` and ``alpha``) of sampled rows.

        Rows overwritten or evicted since the sample (``written_at``: the lanes'
        ``written`` counters at sampling time), or not live now, are ignored.
        Duplicates resolve to the last value.
        """
        idx, pri = self._checked_priorities("update_priorities", indices, priorities)
        keep = self._live_rows(idx, written_at)
        cfg = self.priorities
        assert self._tree is not None and cfg is not None  # checked above
        self._mark_tree_dirty()
        tree.update(self._tree, idx[keep], (pri[keep] + cfg.eps) ** cfg.alpha)

    def leaf_priorities(self, rows: Any) -> np.ndarray:
        """The stored priorities ``(p + eps) ** alpha`` of ``rows`` (float32; 0 where a
        row is not live): sampling is proportional to them.

        >>> import tempfile, numpy as np, mmbuffer as mb
        >>> buf = mb.create(tempfile.mkdtemp() + "/l", {"x": ((), "int32")}, capacity=8, next_keys=(),
        ...                 priorities=mb.PriorityConfig(alpha=0.5, eps=0.0))
        >>> buf.extend({"x": np.arange(3)})
        >>> buf.update_priorities([0, 1, 2], [4.0, 9.0, 16.0])
        >>> buf.leaf_priorities([0, 1, 2]).tolist()
        [2.0, 3.0, 4.0]
        """
        if self._tree is None:
            raise errors.InvalidPriorityError(
                "leaf_priorities: expected a store created with priorities=mb.PriorityConfig(...), got priorities=None"
            )
        idx = self._checked_rows(row_ids(rows, self.capacity))
        return np.asarray(self._tree.leaves[idx])

    @locked
    def set_leaf_priorities(self, rows: Any, values: Any) -> None:
        """Set stored priorities directly, already ``(p + eps) ** alpha``: for instance
        values read with :meth:`leaf_priorities` from a store with the same
        ``PriorityConfig`` (``mmbuffer copy`` does this). Rows not live are
        ignored; checks and errors as :meth:`update_priorities`.
        """
        idx, val = self._checked_priorities("set_leaf_priorities", rows, values)
        keep = self._live_rows(idx, None)
        assert self._tree is not None  # checked above
        self._mark_tree_dirty()
        tree.update(self._tree, idx[keep], val[keep])

    def _checked_priorities(self, what: str, indices: Any, priorities: Any) -> tuple[np.ndarray, np.ndarray]:
        """Row ids and finite, non-negative values of the same size, or a typed error."""
        self._check_writable(what)
        if self._tree is None or self.priorities is None:
            raise errors.InvalidPriorityError(
                f"{what}: expected a store created with priorities=mb.PriorityConfig(...), got priorities=None"
            )
        idx = row_ids(indices, self.capacity)
        pri = as_numpy(priorities, "priorities").astype(np.float64, copy=False)
        try:
            pri = np.broadcast_to(pri.reshape(-1) if pri.size == idx.size else pri, idx.shape)
        except ValueError:
            raise errors.InvalidPriorityError(
                f"priorities: expected {idx.size} values (one per index), got shape {tuple(pri.shape)}"
            ) from None
        bad = ~np.isfinite(pri) | (pri < 0)
        if bad.any():
            raise errors.InvalidPriorityError(
                f"priorities: expected finite values >= 0, got {pri[bad][:3].tolist()}"
            )
        return self._checked_rows(idx), pri

    def _checked_rows(self, idx: np.ndarray) -> np.ndarray:
        if ((idx < 0) | (idx >= self.capacity)).any():
            raise errors.InvalidArgumentError(
                f"indices: expected row ids in [0, {self.capacity}), got {idx[(idx < 0) | (idx >= self.capacity)][:3].tolist()}"
            )
        return idx

    def _live_rows(self, rows: np.ndarray, written_at: np.ndarray | None) -> np.ndarray:
        """Rows that still hold what was sampled when the lanes' cursors were ``written_at``."""
        lane = rows // self.lane_size
        now = np.array([st.written for st in self._lanes], dtype=np.int64)
        first = np.array([st.first_start for st in self._lanes], dtype=np.int64)
        snap = (now if written_at is None else np.asarray(written_at, dtype=np.int64))[lane]
        absolute = snap - 1 - (snap - 1 - rows % self.lane_size) % self.lane_size  # the row's id then
        live: np.ndarray = (snap > 0) & (absolute >= first[lane]) & (absolute < now[lane])
        return live

    def _default_priority(self) -> float:
        assert self._tree is not None and self.priorities is not None
        cap = self.priorities.max_priority ** self.priorities.alpha
        live = tree.max_live(self._tree)
        return float(min(live, cap)) if live > 0 else float(cap)

    def warm(self) -> None:
        """Read the priority tree into memory and map it in this process.

        The tree is read at random, a 4 KiB page at a time: a process that opens
        a large store whose tree is not in the page cache (the kernel dropped it,
        or the machine restarted) pays a random disk read per page at first use;
        at 6e8 rows that is minutes of slow samples. ``warm`` reads the whole
        tree at sequential disk speed (``_format.populate``: seconds at 6e8 rows) and
        keeps it mapped, so that the kernel sees it as in use. ``open`` does not
        call it (reopening stays a few milliseconds, and a reader that samples
        little needs no warm tree); call it after ``open`` in a learner. It is
        not locked and releases the GIL, so it may run in a background thread
        while the store is used: ``threading.Thread(target=buf.warm).start()``.
        A store without priorities has nothing to warm.
        """
        if self._tree is not None:
            for arr in self._tree.arrays:
                fmt.populate(arr, random=config.madvise_random)

    @locked
    def release_memory(self) -> None:
        """Drop this process's mappings of the store's pages.

        A process that streams through a whole store (a converter, a verification
        pass) otherwise keeps every page it touched counted in its RSS. Nothing is
        lost: the pages stay in the page cache and the next access maps them again.
        """
        for col in (*self._data.values(), *self._final.values()):
            col.release()
        for arr in (self._ends, *(self._tree.arrays if self._tree is not None else ())):
            fmt.release(arr)

    def drop_cache(self, start: int, stop: int) -> None:
        """Write rows ``[start, stop)`` of the raw columns behind: start writing them to
        disk and drop their clean pages from the page cache.

        For bulk writers whose output exceeds memory (converters, copies), like
        ``dd oflag=nocache``: the page cache keeps what readers use instead of
        the bulk output. Call it again on a range a few chunks later to drop the
        pages that were still being written. Nothing is lost and nothing is
        committed; later reads come from disk. No lock: it changes no data.
        """
        for col in self._data.values():
            col.drop_cache(start, stop)

    # -- closing -----------------------------------------------------------------------
    @locked
    def close(self) -> None:
        """Commit (writer) and release the lock; the object is unusable afterwards.

        If that commit fails (``DiskFullError``), the lock is released all the
        same: the rows extended since the last commit are lost, and the next
        writer recovers the store as after a crash. To keep them, free space and
        call ``commit`` before ``close``.
        """
        if self._lock_fd is None and self.mode == "a":
            return
        try:
            if self.mode == "a":
                if self._has_changes():
                    self.commit()
                self._release_reservation()
        finally:
            self._release_lock()

    def _has_changes(self) -> bool:
        return self._lanes != self._committed or (self._tree is not None and self._tree_dirty)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self._release_lock()

    # -- helpers -----------------------------------------------------------------------
    @locked_write("verify --repair")
    def rewrite_derived(self, ends: np.ndarray, lanes: list[Lane]) -> int:
        """Replace the live episodes' index by ``ends``/``lanes`` recomputed from the
        data (``index.rebuild``), rebuild the priority tree from its leaves, and
        commit; return the generation (``verify --repair``)."""
        self._check_writable("verify --repair")
        for lane, new in enumerate(lanes):
            at = index.slots(lane, self.lane_size, np.arange(new.ep_head, new.ep_tail, dtype=np.int64))
            self._ends[at] = ends[at]
            self._lanes[lane] = new
        fmt.flush_rows(self._ends, 0, len(self._ends))  # commit flushes only new slots
        if self._tree is not None:
            self._mark_tree_dirty()
            tree.rebuild(self._tree)
        self._sampler_cache.clear()  # slice counts came from the old index
        return self.commit()

    def _check_writable(self, what: str) -> None:
        if self.mode != "a":
            raise errors.ReadOnlyError(f"{what}: store {self.path} is opened with mode='r'; open it with mode='a' to write")
        if self._lock_fd is None:
            raise errors.ReadOnlyError(f"{what}: store {self.path} is closed")

    def _mark_tree_dirty(self) -> None:
        if not self._tree_dirty:
            (self.path / "priority" / "DIRTY").touch()
            self._tree_dirty = True

    def _flush_tree(self) -> None:
        if self._tree is not None:
            for arr in self._tree.arrays:
                fmt.flush_rows(arr, 0, len(arr))

    def _write_manifest(self, generation: int) -> None:
        """Replace ``manifest.json`` by this state as commit ``generation`` (a failed
        attempt leaves no ``.partial`` behind: ``atomic_write_json``)."""
        state = dataclasses.replace(self._manifest, generation=generation, lanes=tuple(self._lanes), attrs=self.attrs)
        fmt.atomic_write_json(self.path / fmt.MANIFEST, state.to_json())

    def _release_lock(self) -> None:
        for col in (*getattr(self, "_data", {}).values(), *getattr(self, "_final", {}).values()):
            col.close()
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            self._lock_fd = None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def _reserve_space(self, lane: int, st: Lane, stop: int) -> None:
        """Allocate the disk blocks the writes up to a lane's absolute row ``stop`` need.

        Small blocks of rows, final observations, episode ends and priority leaves
        are stored through memory maps of sparse files, and a store into a hole
        on a full disk can only be a SIGBUS. So blocks are allocated
        (``posix_fallocate``; ``OSError(ENOSPC)`` when there is no room) with the
        reservation, before it advances: the rows ``[written, stop)`` of the lane's
        first pass through the ring, and the ``index/ends`` slots of the episodes
        that can end in them (at most one per row). Once a lane has wrapped, what
        it rewrites is allocated already; the tree's inner arrays and
        ``index/reserved`` are allocated at creation.
        """
        w, t = st.written, st.ep_tail
        if w < self.lane_size:
            base, hi = lane * self.lane_size, min(stop, self.lane_size)
            for name in self._row_files():
                fmt.reserve_raw(self.path, name, base + w, base + hi)
        slots = 2 * self.lane_size
        if t < slots:
            fmt.reserve_raw(self.path, "index/ends", lane * slots + t, lane * slots + min(t + stop - w, slots))

    def _row_files(self) -> list[str]:
        """The raw arrays with one row per store row that ``extend`` writes."""
        names = [f"columns/{n}" for n in self.columns if self.compression is None or n in fmt.RESERVED_NAMES]
        names += [f"final/{k}" for k in self.next_keys]
        return names + (["priority/leaves"] if self._tree is not None else [])

    def _room_rows(self) -> int:
        """How far the reservation runs ahead of the cursor: ``config.reserve_fraction``
        of a lane, but at most ``_ROOM_BYTES`` of disk to allocate (1/16 of a 3e9-row
        lane would make a sparse store dense at once). Not cached: it is needed once a
        window, and a cached_property would turn the instance's attribute storage into
        a dict (CPython 3.11), which slowed every ``extend`` by 0.6 us."""
        cols = [c for n, c in self.columns.items() if self.compression is None or n in fmt.RESERVED_NAMES]
        cols += [self.columns[k] for k in self.next_keys]
        row_bytes = sum(int(np.prod(c.shape, dtype=np.int64)) * np.dtype(c.dtype).itemsize for c in cols)
        row_bytes += 8 + (4 if self._tree is not None else 0)  # an episode-end slot, a float32 leaf
        ahead = max(1, int(self.lane_size * config.reserve_fraction))
        return max(1, min(ahead, _ROOM_BYTES // row_bytes))

