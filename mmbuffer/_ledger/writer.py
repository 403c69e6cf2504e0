"""The single writer of a store: cursors, reservation, commit protocol, recovery.

Only a store opened with ``mode="a"`` has a ``Writer``; it holds the store's
``LOCK`` (an advisory ``flock``; a second writer gets ``LockedError``) and is the
only code that changes a store's files after creation.

Reservation. A ring overwrites committed rows before the next commit, so the
writer first *reserves* rows ahead of its cursor in ``index/reserved`` (a
memory-mapped counter, bumped by ``config.reserve_fraction`` of a lane at a time,
at most 16 MiB of rows, whose disk blocks are allocated first:
``Writer._reserve_space``). Readers, and a writer reopening after a crash, treat
every committed episode whose first row lies below ``reserved - lane_size`` as
evicted: they never sample a row the writer may be rewriting, and a kill at any
instant leaves the last commit readable.

Recovery. The reservation is durable but runs a window ahead; how far the overwrite
really got is stored, before each ``extend``'s rows, in ``index/progress``, exact
after a kill and ignored after a reboot (``progress.py``). A writer that reopens
after a kill gives up only the committed episodes that start below ``progress -
lane_size``: those the dead writer's uncommitted extends reached, so one extend's
reach for a writer that commits after every extend; after a power cut, those below
``reserved - lane_size``. Counters are checked on write as on open: an ``extend``
that would take a lane's ``written`` past 2**62, or a commit its generation, is
refused (``CapacityError``) before anything changes.

Exit. A writer still open when the interpreter exits (normally, or after an
uncaught exception) is closed as ``close()`` closes it: it commits (``closing.py``,
which also says why no signal handler is installed).

Commit protocol (docs/design.md): the rows written since the last commit are msync'ed,
then the index and the tree, then ``manifest.json`` is replaced atomically.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/w", {"x": ((), "int64")}, capacity=8, next_keys=())
>>> buf.extend({"x": np.arange(3)})
>>> buf.commit(), buf.reservation().tolist()
(1, [4])
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
from pathlib import Path
from typing import Any

import numpy as np

from .. import errors, tree
from .._disk import files as _files
from .._disk import format as fmt
from .._disk import prilog
from .._disk import rawio as _rawio
from .._disk.checks import (
    as_numpy,
    row_ids,
)
from .._disk.guards import acquire_lock, locked, locked_write, raise_typed
from ..kernels import load
from . import closing, index, progress, touched, zarr_view
from . import counters as _counters
from .appending import Appending
from .finals import FinalsWriter
from .index import Lane
from .manifest import MAX_COUNTER
from .snapshot import Ledger
from .store import Store, check_rows

__all__ = ["Writer", "priority_shape", "release_lock", "take_lock"]


def take_lock(path: Path) -> int:
    """The writer's lock of the store at ``path`` (a descriptor), or a typed error:
    ``LockedError`` when another writer holds it, ``ReadOnlyError``/``DiskFullError``
    when the ``LOCK`` file cannot be written."""
    try:
        return acquire_lock(path)
    except OSError as exc:  # a read-only filesystem, no space for the LOCK file
        raise_typed(exc, "open(mode='a')", path)
        raise


def release_lock(fd: int) -> None:
    """Release and close a lock taken with :func:`take_lock`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def priority_shape(pri: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``pri`` broadcast to the indices' ``shape``: it may have that shape, a leading
    part of it, or that shape plus trailing dimensions of size 1."""
    if pri.shape == shape:
        return pri
    if pri.ndim < len(shape) and shape[: pri.ndim] == pri.shape:
        pri = pri.reshape(pri.shape + (1,) * (len(shape) - pri.ndim))
    elif pri.ndim > len(shape) and pri.shape[: len(shape)] == shape and all(d == 1 for d in pri.shape[len(shape) :]):
        pri = pri.reshape(shape)
    try:
        return np.broadcast_to(pri, shape)
    except ValueError:
        raise errors.InvalidPriorityError(
            f"priorities: expected shape {shape} (or a leading part of it, or it with trailing 1s), got {tuple(pri.shape)}"
        ) from None


class Writer(Appending):
    """Writes rows, keeps the index and the tree in step, commits, and recovers.

    ``Writer(store, lock_fd)`` takes over the lock taken with :func:`take_lock`
    (it releases it on :meth:`close`) and recovers the store at once
    (:meth:`_recover`). Every method holds the store's lock.
    """

    def __init__(self, store: Store, lock_fd: int) -> None:
        self.store = store
        self.path = store.path
        self._lock = store.lock
        self._lock_fd: int | None = lock_fd
        # the arrays and values below never change identity while the store is open
        self._ends = store.ends
        self._reserved = store.reserved
        self._tree = store.priority_tree
        self.layout = store.layout
        self.lane_size = store.lane_size
        self._tree_dirty = False
        self._record: np.ndarray | None = None
        self._marks: touched.Marks | None = None  # tree blocks changed since the commit (touched.py)
        self._marks_added = False
        self._finals = FinalsWriter(store)  # final observations: written, flushed, freed (finals.py)
        try:
            self._record_array, self._record = progress.open_record(self.path, store.num_streams)
            if self._tree is not None:
                self._marks_array, marks, self._marks_added = touched.open_marks(self.path, store.capacity)
                log = store.manifest.priority_log if store.manifest.next_version >= fmt.PRIORITY_LOG else None
                self._marks = touched.Marks(marks, store.tree_arrays(), self.path / "priority" / "DIRTY", log)
            self._recover()
        except BaseException:  # the caller gets no writer: nothing else would release the lock
            self.release()
            raise
        closing.register(self)  # closed at interpreter exit if still open (closing.py)

    # -- recovery ------------------------------------------------------------------------
    def _recover(self) -> None:
        """Drop what an interrupted writer may have left past the last commit.

        Committed episodes whose rows the dead writer may have overwritten (below
        ``limit - lane_size``, ``limit`` its progress after a kill, its reservation
        after a reboot: ``progress.limits``) are evicted and that state is committed
        at once. The reservation is lowered to that limit, never below: a reader
        still holding an older commit must keep away from the rows that writer may
        have rewritten. The episodes this keeps beyond what the open checked (those
        between the two limits) are checked first. The tree is repaired in the blocks
        marked since the commit (``touched.py``) when the marks are of this boot,
        else rebuilt whole; the committed priority log is replayed first
        (:meth:`_replay_log`), and after a repair or a rebuild the commit that settles
        them is a checkpoint.
        """
        assert self._record is not None
        self._replay_log()
        same_boot = progress.trusted(self._record) and not self._marks_added  # before start() rewrites it
        before = self.store.ledger
        limit = progress.limits(self._record, self._reserved, before.committed)
        if limit != self._reserved.tolist():
            where = str(self.path / fmt.MANIFEST)
            _counters.check_lanes(self._ends, np.array(limit, dtype=np.int64), list(before.lanes), self.lane_size, where, writer=True)
            self._reserved[:] = limit
            _rawio.flush_rows(self._reserved, 0, len(self._reserved))
        progress.start(self._record, limit)  # this writer's record, of this boot
        self._reserved_floor = np.array(self._reserved, dtype=np.int64)
        kept = tuple(
            index.drop_below(self._ends, lane, self.lane_size, st, limit[lane] - self.lane_size)
            for lane, st in enumerate(before.lanes)
        )
        torn = kept != before.lanes
        self.store.ledger = Ledger(kept, before.committed, before.generation)
        if self._tree is not None and self._marks is not None and (torn or (self.path / "priority" / "DIRTY").exists()):
            if same_boot or not (self.path / "priority" / "DIRTY").exists():  # O(work since the commit)
                self._mark_tree_dirty()
                for lane, (was, now) in enumerate(zip(before.lanes, kept)):
                    for a, b in self.layout.segments(lane, was.first_start, now.first_start):
                        self._marks.range(a, b)
                        tree.set_range(self._tree, a, b, 0.0)
                self._marks.repair(self._tree, self.layout, kept)  # blocks a commit's tree write left
            else:  # after a reboot the marks may be stale: the whole tree, marked first
                self._marks_array.allocate(0, len(self._marks.marks))  # no hole under the marks
                self._marks.all()
                self._mark_tree_dirty()
                self._zero_invisible_priorities()
                tree.rebuild(self._tree, spans=self.store.tree_spans())
            self._tree_dirty = True
        if torn or self._tree_dirty:
            dirty = (self.path / "priority" / "DIRTY").exists()
            self.commit(checkpoint=dirty)  # the file's tree pages are whole again only after a checkpoint
            if self._marks is not None and dirty:
                self._marks.clear_all()  # the dead writer's marks too, now that the tree is whole

    def _replay_log(self) -> None:
        """Apply the committed priority log (``_disk/prilog.py``) to this writer's
        copy-on-write tree: the file holds the last checkpoint's tree; the records
        since hold the committed leaf values. Their blocks are pending for the next
        checkpoint (``touched.Marks.replayed``)."""
        if self._tree is None or self._marks is None or self._marks.log is None:
            return
        ckpt, nbytes = self._marks.log
        rows, values = prilog.read(self.path, ckpt, 0, nbytes, capacity=self.store.capacity)
        if len(rows):
            self._marks.replayed(rows)
            touched.replay(self._tree, rows, values)

    def _zero_invisible_priorities(self) -> None:
        """Give priority 0 to every row of a lane outside its live range."""
        assert self._tree is not None
        for lane, st in enumerate(self.store.lanes):
            stop, reserved = st.first_start + self.lane_size, int(self._reserved[lane])
            if reserved < self.lane_size:  # first pass: the rows past the reservation were never written
                stop = min(stop, max(st.written, reserved))
            for a, b in self.layout.segments(lane, st.written, stop):
                tree.set_range(self._tree, a, b, 0.0)

    # -- writing -------------------------------------------------------------------------
    @locked_write("commit")
    def commit(self, *, checkpoint: bool = False) -> int:
        """Make every extended row durable and visible to readers; return the generation
        (see ``Buffer.commit``). The changed priorities are appended to the priority
        log, or with ``checkpoint`` (or when the log is full: ``touched.Marks.plan``)
        the tree's changed pages are written."""
        self.check_writable("commit")
        store = self.store
        ledger = store.ledger
        if ledger.generation >= MAX_COUNTER:
            raise errors.CapacityError(f"commit: expected a generation below {MAX_COUNTER} (2**62), got {ledger.generation}")
        ends = store.array("index/ends")
        for lane, (was, now) in enumerate(zip(ledger.committed, ledger.lanes)):
            if was == now:  # nothing extended: no rows, final observations or ends to sync
                continue
            segs = self.layout.segments(lane, was.written, now.written)
            for a, b in segs:
                for name in self._row_arrays(with_tree=False):
                    store.array(name).flush(a, b)
            self._finals.flush(lane, was, now)
            # the ring slots of the episodes added since the last commit
            for a, b in index.slot_ranges(lane, self.lane_size, was.ep_tail, now.ep_tail):
                ends.flush(a, b)
        tree_write, log, is_checkpoint = None, None, True
        marks = self._marks
        if self._tree is not None and marks is not None:
            log = marks.log
            if self._tree_dirty or (checkpoint and marks.since_checkpoint):
                tree_write, log, is_checkpoint = marks.plan(self._tree, self.path, ledger.generation + 1, checkpoint=checkpoint)
        self._write_manifest(ledger, tree_write, log)  # the generation advances once it is written
        store.ledger = ledger.committed_as(ledger.generation + 1)
        if tree_write is not None and marks is not None:
            self._tree_dirty = False
            marks.committed(log, is_checkpoint, self.path)
        zarr_view.publish(self.path, self.layout, store.committed, store.generation, store.manifest.format_version)
        return store.generation

    @locked_write("commit")
    def checkpoint(self) -> None:
        """Write the tree's pages changed since the last checkpoint and start an empty
        priority log (``touched.Marks.plan``), so that the next open replays nothing:
        with changes since the commit, as a commit; else without one (the manifest keeps
        its generation and lanes: what is committed stays, only where it is kept moves;
        a reader that replayed the old log holds its pages privately and its descriptor)."""
        self.check_writable("commit")
        marks = self._marks
        if self.has_changes():
            self.commit(checkpoint=True)
        elif self._tree is not None and marks is not None and marks.since_checkpoint and marks.log is not None:
            ledger = self.store.ledger
            tree_write, log, _ = marks.plan(self._tree, self.path, ledger.generation, checkpoint=True)
            self._write_manifest(ledger, tree_write, log, advance=False)
            marks.committed(log, True, self.path)

    def _write_manifest(self, ledger: Ledger, tree_write: Any = None, log: tuple[int, int] | None = None, advance: bool = True) -> None:
        """Replace ``manifest.json`` by ``ledger``'s lanes as its next commit (a failed
        attempt leaves no ``.partial`` behind: ``atomic_write_json``); ``tree_write``
        appends the priority log's record or writes the tree's changed pages once the
        new manifest is on disk, before its rename; ``log`` is the priority log the
        manifest names. A version 4 store becomes a version 5 one (``format.py``)."""
        old = self.store.manifest
        state = dataclasses.replace(
            old, generation=ledger.generation + advance, lanes=ledger.lanes, attrs=self.store.attrs,
            format_version=old.next_version, priority_log=log if log is not None else old.priority_log,
        )
        _files.atomic_write_json(self.path / fmt.MANIFEST, state.to_json(), before_rename=tree_write)
        self.store.manifest = state

    # -- priorities ------------------------------------------------------------------------
    @locked
    def update_priorities(self, indices: Any, priorities: Any, written_at: np.ndarray | None = None) -> None:
        """Set new priorities (raw, before ``eps`` and ``alpha``) of sampled rows.

        Rows overwritten or evicted since the sample (``written_at``: the lanes'
        ``written`` counters at sampling time), or not live now, are ignored.
        Duplicates resolve to the last value.
        """
        self._set_priorities("update_priorities", indices, priorities, written_at, True)

    @locked
    def set_leaf_priorities(self, rows: Any, values: Any) -> None:
        """Set stored priorities directly, already ``(p + eps) ** alpha`` (see
        ``Buffer.set_leaf_priorities``)."""
        self._set_priorities("set_leaf_priorities", rows, values, None, False)

    def _set_priorities(self, what: str, indices: Any, priorities: Any, written_at: Any, transform: bool) -> None:
        """Check the row ids and values, keep the rows live since ``written_at`` and
        transform the values (one compiled call: ``kernels.priority.prepare``), then mark
        the kept rows' blocks and update the tree; a refusal changes nothing."""
        self.check_writable(what)
        cfg = self.store.priorities
        if self._tree is None or cfg is None or self._marks is None:
            raise errors.InvalidPriorityError(
                f"{what}: expected a store created with priorities=mb.PriorityConfig(...), got priorities=None"
            )
        capacity = self.store.capacity
        idx = np.ascontiguousarray(row_ids(indices, capacity))
        pri = as_numpy(priorities, "priorities").astype(np.float64, copy=False)
        if pri.size != idx.size:
            try:
                np.broadcast_to(pri, idx.shape)
            except ValueError:
                raise errors.InvalidPriorityError(
                    f"priorities: expected {idx.size} values (one per index), got shape {tuple(pri.shape)}"
                ) from None
        pri = pri.reshape(-1)
        view = self.store.view()
        now = view.written.copy()  # writable: numba's fastest dispatch, and one compiled type
        snap = now if written_at is None else np.array(written_at, dtype=np.int64).reshape(-1)
        if snap.shape != now.shape:
            raise errors.InvalidArgumentError(
                f"written_at: expected {now.shape[0]} lane cursors, got shape {np.shape(written_at)}")
        priority, tree_kernels = load("priority"), load("tree")
        status, rows, leaves = priority.prepare(idx, np.ascontiguousarray(pri), capacity, self.lane_size, now,
                                                view.first_starts, snap, cfg.eps, cfg.alpha, transform)
        if status == priority.BAD_VALUE:
            bad = ~np.isfinite(pri) | (pri < 0)
            raise errors.InvalidPriorityError(f"priorities: expected finite values >= 0, got {pri[bad][:3].tolist()}")
        if status == priority.BAD_INDEX:
            check_rows(idx, capacity)  # raises, naming the rows
        self._mark_tree_dirty()
        self._marks.rows(rows)
        if rows.shape[0]:
            v = self._tree.views
            tree_kernels.update(v.leaf, v.nodes, v.offs, rows, leaves)

    def _default_priority(self) -> float:
        cfg = self.store.priorities
        assert self._tree is not None and cfg is not None
        cap = cfg.max_priority**cfg.alpha
        live = tree.max_live(self._tree)
        return float(min(live, cap)) if live > 0 else float(min(1.0, cap))

    def default_priority(self) -> float:
        """The stored priority a new row gets now: the largest live one, at most
        ``max_priority ** alpha`` (1 when nothing is live, as TorchRL)."""
        with self._lock:
            return self._default_priority()

    def _mark_tree_dirty(self) -> None:
        """Note that the tree changed since the commit: the changes stay in this writer's
        copy-on-write map until the commit writes them (``touched.Marks.write``)."""
        self._tree_dirty = True

    # -- repair ------------------------------------------------------------------------------
    @locked_write("verify --repair")
    def rewrite_derived(self, ends: np.ndarray, lanes: list[Lane]) -> int:
        """Replace the live episodes' index by ``ends``/``lanes`` recomputed from the
        data (``index.rebuild``), rebuild the priority tree from its leaves, and
        commit; return the generation (``verify --repair``)."""
        self.check_writable("verify --repair")
        for lane, new in enumerate(lanes):
            at = index.slots(lane, self.lane_size, np.arange(new.ep_head, new.ep_tail, dtype=np.int64))
            self._ends[at] = ends[at]
        before = self.store.ledger
        self.store.ledger = Ledger(tuple(lanes), before.committed, before.generation)
        self.store.array("index/ends").flush(0, len(self._ends))  # commit flushes only new slots
        if self._tree is not None and self._marks is not None:
            self._marks_array.allocate(0, len(self._marks.marks))  # a full disk refuses here, never a SIGBUS
            self._marks.all()
            self._mark_tree_dirty()
            tree.rebuild(self._tree, spans=self.store.tree_spans())
        return self.commit()

    # -- closing -----------------------------------------------------------------------------
    @locked
    def close(self) -> None:
        """Commit if anything changed, lower the reservation and release the lock
        (see ``Buffer.close``); closing again does nothing."""
        if self._lock_fd is None:
            return
        try:
            self.checkpoint()  # commits what changed; the next open replays no log
            self._release_reservation()
        finally:
            self.release()

    def has_changes(self) -> bool:
        """Whether anything was extended or reprioritized since the last commit."""
        return self.store.ledger.has_changes or (self._tree is not None and self._tree_dirty)

    def _release_reservation(self) -> None:
        """Lower the reservation to the committed cursors on a clean close, never below
        what a writer that died before this one may have written (see ``_recover``)."""
        for lane, st in enumerate(self.store.committed):
            self._reserved[lane] = max(st.written, int(self._reserved_floor[lane]))
        _rawio.flush_rows(self._reserved, 0, len(self._reserved))
        if self._record is not None:
            self._record[2:] = self._reserved

    def release(self) -> None:
        """Release the lock without committing (the store recovers as after a crash)."""
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            release_lock(fd)
        for name in ("_record_array", "_marks_array"):
            arr = getattr(self, name, None)
            if arr is not None:
                arr.close()

    @property
    def is_open(self) -> bool:
        """Whether this writer still holds the store's lock."""
        return self._lock_fd is not None

    def check_writable(self, what: str) -> None:
        if self._lock_fd is None:
            raise errors.ReadOnlyError(f"{what}: store {self.path} is closed")

    def __del__(self) -> None:
        self.release()
