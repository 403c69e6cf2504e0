"""The store: the columns of one store directory and its ledger (manifest, index, tree).

``Store`` opens the files (layout in ``_disk/format.py``) through the column seam
(``mmbuffer._disk.columns``): the data columns, the final observations, the episode
index (``index/ends``), the writer's reservation (``index/reserved``) and the
priority tree levels are all :class:`~mmbuffer._disk.columns.ColumnArray` objects; the
index, the reservation and the tree are used as the arrays their backend maps
(``ColumnArray.mapped()``), updated in place by the pure functions of ``index.py``
and ``mmbuffer.tree``. It checks the counters, hands samplers a consistent
``View`` and reads rows. It never writes: the single writer (``writer.py``)
advances the cursors and commits, and ``Buffer`` (``buffer.py``) composes both.

Lanes. A store of ``capacity`` rows has ``num_streams`` lanes of
``lane_size = capacity // num_streams`` rows; every ring computation is in
``layout.py``.

Visibility. The writer samples rows as soon as ``extend`` returns; ``commit``
makes them durable and visible to readers. A ring overwrites committed rows before
the next commit, so the writer first *reserves* rows ahead of its cursor in
``index/reserved`` (a memory-mapped counter, see ``writer.py``). Readers treat
every committed episode whose first row lies below ``reserved - lane_size`` as
evicted: they never sample a row the writer may be rewriting.

The open episode. The last row of a lane's unfinished episode has no next
observation yet (it arrives with the next ``extend``), so when the store derives
``next_*`` columns that row is not sampleable until the next extend; without
next-derived columns every extended row is.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from . import counters as _counters, finals, index, touched
from .._disk import prilog, rawio as _rawio, safe_io as _safe_io
from .. import errors, tree
from .._disk import format as fmt
from .._disk.checks import row_ids
from .._disk.guards import locked
from .manifest import Manifest, load_manifest
from .._disk.columns import ColumnArray, RawArray, ShardedArray, ZarrArray
from ..config import config
from .index import Lane
from .layout import Layout
from .snapshot import LaneView, Ledger, Snapshot, View
from ..schema import Column, PriorityConfig

__all__ = [
    "Column", "ColumnOpener", "LaneView", "PriorityConfig", "Snapshot", "Store", "View", "check_rows", "locked",
]
#: opens a column held elsewhere (``mmbuffer.remote``): (path in the store, expect) -> array, None: in the folder
ColumnOpener = Callable[[str, "fmt.Expect"], "ColumnArray | None"]


def check_rows(idx: np.ndarray, capacity: int) -> np.ndarray:
    """``idx`` if every row id lies in ``[0, capacity)``, else ``InvalidArgumentError``."""
    bad = (idx < 0) | (idx >= capacity)
    if bad.any():
        raise errors.InvalidArgumentError(f"indices: expected row ids in [0, {capacity}), got {idx[bad][:3].tolist()}")
    return idx


class Store:
    """Columns, index and tree of one store directory. Use ``mb.create``/``mb.open``.

    ``mode="a"`` opens the files writable for the single writer (who holds the
    ``LOCK``: ``writer.py``); ``mode="r"`` read-only. Thread-safe: every method that
    reads cursors, index or tree holds :attr:`lock` (re-entrant), the lock the
    writer holds while it changes them.

    What the writer changes: ``ledger`` (a frozen :class:`Ledger`, replaced whole:
    ``lanes``, the cursors a ``view`` shows, the last commit's in a reader and every
    extended row in the writer; ``committed``; ``generation``) and ``attrs``.
    """

    def __init__(
        self, path: str | os.PathLike[str], mode: str = "a", manifest: Manifest | None = None, *,
        columns: ColumnOpener | None = None, lock: threading.RLock | None = None,
    ) -> None:
        self._lock = lock if lock is not None else threading.RLock()  # the facade's, when it has one
        self._open_column = columns  # data columns held elsewhere (mmbuffer.remote)
        if mode not in ("r", "a"):
            raise errors.InvalidArgumentError(f"mode: expected 'r' or 'a', got {mode!r}")
        self.path = Path(path)
        self.mode = mode
        manifest = manifest if manifest is not None else load_manifest(self.path)
        self.capacity = manifest.capacity
        self.num_streams = manifest.num_streams
        self.lane_size = manifest.lane_size
        self.compression: str | None = manifest.compression
        self.columns = {name: Column(shape, dt.name, manifest.codecs.get(name)) for name, (shape, dt) in manifest.columns.items()}
        self.next_keys: tuple[str, ...] = manifest.next_keys
        #: ``final/<col>`` addressed by episode (format 4) or by row (3): ``finals.py``
        self.finals_by_episode = manifest.finals_by_episode
        self.priorities = PriorityConfig(**manifest.priorities) if manifest.priorities else None
        self.attrs: dict[str, Any] = dict(manifest.attrs)
        self.manifest = manifest  # what the next commit rewrites (fields that never change)
        self.layout = Layout(self.capacity, self.num_streams)  # all ring arithmetic (layout.py)
        self._arrays: dict[str, ColumnArray] = {}  # every array of the store, by its path in it
        self._written_memo: tuple[Ledger, np.ndarray] | None = None
        try:
            self._open_arrays(manifest)
            _counters.check_lanes(
                self.ends, self.reserved, list(manifest.lanes), self.lane_size, str(self.path / fmt.MANIFEST), writer=mode == "a"
            )
        except BaseException:
            self.close()
            raise
        #: what is live, one frozen value: replaced whole by the writer and by refresh
        self.ledger = Ledger.of(tuple(manifest.lanes), manifest.generation)
        self._last_view: tuple[Ledger, bytes, View] | None = None  # ``view``'s memo
        # a reader's priority log (_disk/prilog.py): the one its commit names and how much
        # of it this process applied to its copy-on-write tree (at the first prioritized use)
        self._log_fd: int | None = None
        self._log_want = self._log_have = (manifest.priority_log[0], 0)
        self._log_private = False  # whether the tree's map holds replayed pages
        if self.priority_tree is not None and mode == "r":
            try:
                self._adopt_log(manifest)
            except BaseException:
                self.close()
                raise

    def _open_arrays(self, manifest: Manifest) -> None:
        """Open the arrays the checked manifest names, each against what it implies."""
        root, cap, writable = self.path, self.capacity, self.mode == "a"
        for name, (shape, dt) in manifest.columns.items():
            expect = (cap, shape, dt)
            held = self._open_column(f"columns/{name}", expect) if self._open_column is not None else None
            if held is not None:  # held elsewhere (None: the file here, opened as below)
                self._arrays[f"columns/{name}"] = held
                continue
            if name in manifest.codecs:  # a column with a codec: shards, staging (columns/sharded.py)
                self._arrays[f"columns/{name}"] = ShardedArray(
                    root, name, writable=writable, expect=expect, codec=manifest.codecs[name], lane_size=self.lane_size,
                    written=[st.written for st in manifest.lanes], cursors=self._written_now,
                )
                continue
            raw = name in fmt.RESERVED_NAMES or self.compression is None  # the flags are always raw
            kind = RawArray if raw else ZarrArray
            self._arrays[f"columns/{name}"] = kind.open(root, f"columns/{name}", writable=writable, expect=expect)
        for k in self.next_keys:  # compressed like the columns in a version 4 store (finals.py)
            shape, dt = manifest.columns[k]
            final: type[RawArray] | type[ZarrArray] = ZarrArray if self.finals_by_episode and self.compression is not None else RawArray
            self._arrays[f"final/{k}"] = final.open(root, f"final/{k}", writable=writable, expect=(cap, shape, dt))
        int64 = np.dtype(np.int64)
        self.ends = self._mapped("index/ends", (2 * cap, (), int64))
        self.reserved = self._mapped("index/reserved", (self.num_streams, (), int64))
        self.priority_tree: tree.PriorityTree | None = None
        if self.priorities is not None:
            # copy-on-write: the writer's changes reach the file at a checkpoint (touched.py),
            # a reader's replay of the priority log stays in its memory
            levels = {k: self._mapped(f"priority/{k}", (s[0], tuple(s[1:]), np.dtype(t)), private=True) for k, (s, t) in tree.layout(cap).items()}
            self.priority_tree = tree.PriorityTree(**levels)
            _safe_io.lexists(root, "priority/DIRTY")  # a link there would be touched through

    def tree_arrays(self) -> tuple[RawArray, RawArray] | None:
        """The priority tree's ``leaves`` and ``nodes`` arrays (None without priorities)."""
        if self.priority_tree is None:
            return None
        leaves, nodes = self._arrays["priority/leaves"], self._arrays["priority/nodes"]
        assert isinstance(leaves, RawArray) and isinstance(nodes, RawArray)
        return leaves, nodes

    def _written_now(self) -> np.ndarray:
        """Every lane's ``written`` cursor in the ledger now (where a column with a codec
        finds a row: its staging or its shard file); one array per ledger value."""
        ledger = self.ledger
        memo = self._written_memo
        if memo is None or memo[0] is not ledger:
            memo = self._written_memo = (ledger, np.array([st.written for st in ledger.lanes], dtype=np.int64))
        return memo[1]

    def _mapped(self, name: str, expect: fmt.Expect, private: bool = False) -> np.ndarray:
        """Open a ledger array (index, reservation, tree level) and return its mapped rows:
        the pure functions of ``index.py`` and ``mmbuffer.tree`` update it in place."""
        arr = self._arrays[name] = RawArray.open(self.path, name, writable=self.mode == "a", expect=expect, private=private)
        mapped = arr.mapped()
        if mapped is None:  # a backend that maps nothing cannot hold the ledger (yet)
            raise errors.InvalidArgumentError(f"{self.path / name}: expected a memory-mapped array, got {type(arr).__name__}")
        return mapped

    @property
    def lanes(self) -> tuple[Lane, ...]:
        """Every lane's cursors now (the ledger's)."""
        return self.ledger.lanes

    @property
    def committed(self) -> tuple[Lane, ...]:
        """The last commit's cursors."""
        return self.ledger.committed

    @property
    def generation(self) -> int:
        """The last commit's counter."""
        return self.ledger.generation

    @property
    def lock(self) -> threading.RLock:
        """The re-entrant lock every method that reads or changes cursors, index, tree
        or rows holds: hold it to make several calls one step (a prefetch thread)."""
        return self._lock

    def reservation(self) -> np.ndarray:
        """The writer's reservation per lane, read now from the shared map: rows of a
        lane below ``reservation()[lane] - lane_size`` may be being rewritten."""
        return np.array(self.reserved, dtype=np.int64)

    def reserved_past(self, bound: np.ndarray) -> bool:
        """Whether the writer's reservation, read now, is past ``bound`` in some lane
        (``View.intact_up_to``, or a view's ``written``: its rows are at least ``written -
        lane_size``). Only then can a row drawn from that view be being rewritten
        (``_read/recheck.py``). Python ints: the usual answer, no, costs ~0.3 us."""
        return any(map(int.__gt__, self.reserved.tolist(), bound.tolist()))

    def tree_spans(self) -> list[tuple[int, int]]:
        """The rows whose priority a writer may have set (per lane, those of the counters
        below its reservation); ``tree.check`` and ``tree.rebuild`` read only these."""
        lane_rows = self.lane_size
        return [(k * lane_rows, k * lane_rows + min(lane_rows, int(r))) for k, r in enumerate(self.reserved)]

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
        """The index as samplers may use it now (see the module docstring).

        The same ``View`` object while it would be equal: it is a function of the
        ledger (a frozen value, replaced whole whenever it or the episode ends it
        reads change) and, in a reader, of the writer's reservation, read again at
        every call. Its ``written`` array is read-only, as it is shared.
        """
        ledger = self.ledger
        reserved = self.reserved.tobytes() if self.mode == "r" else b""
        last = self._last_view
        if last is not None and last[0] is ledger and last[1] == reserved:
            return last[2]
        view = self._view(ledger, np.frombuffer(reserved, np.int64))
        self._last_view = (ledger, reserved, view)
        return view

    def _view(self, ledger: Ledger, reserved: np.ndarray) -> View:
        lanes = []
        written = np.empty(self.num_streams, dtype=np.int64)
        for lane in range(self.num_streams):
            st = ledger.lanes[lane]
            written[lane] = st.written
            if self.mode == "r":  # a reader keeps away from rows the writer may be rewriting
                st = index.drop_below(self.ends, lane, self.lane_size, st, int(reserved[lane]) - self.lane_size)
            open_start = st.open_start(self.ends, lane, self.lane_size)
            visible_end = st.written - (1 if self.next_keys and st.written > open_start else 0)
            lanes.append(LaneView(st.first_start, st.ep_head, st.ep_tail, open_start, visible_end))
        written.flags.writeable = False
        source = self._synced_tree if self.mode == "r" and self.priority_tree is not None else self.priority_tree
        return View(tuple(lanes), self.ends, self.layout, written, ledger.generation, source)

    def episode_bounds(self, view: View | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Global start row and length of every live complete episode (lane order)."""
        view = view or self.view()
        starts, lengths = [], []
        for lane, lv in enumerate(view.lanes):
            st = Lane(int(view.written[lane]), lv.ep_head, lv.ep_tail, lv.first_start)
            s, n = index.starts_lengths(self.ends, lane, self.lane_size, st)
            starts.append(self.layout.rows(lane, s))
            lengths.append(n)
        return np.concatenate(starts), np.concatenate(lengths)

    def column(self, name: str) -> ColumnArray:
        """The backend array of a stored column or of ``final/<name>`` (``"final/obs"``,
        addressed by slot: :meth:`final_slots`): what gather kernels read
        (``column(name).mapped()`` when the bytes are mapped)."""
        return self._arrays[name if name.startswith("final/") else f"columns/{name}"]

    def final_slots(self, rows: np.ndarray, ledger: Ledger | None = None) -> np.ndarray:
        """The row of ``final/<col>`` holding the final observation of the episode that
        ends at each global row (-1 where none ends there), as of ``ledger`` (default:
        now). See ``_ledger/finals.py``; a version 3 store answers the rows themselves."""
        led = self.ledger if ledger is None else ledger
        return finals.slots(self.ends, self.layout, led.lanes, rows, by_episode=self.finals_by_episode)

    def array(self, name: str) -> ColumnArray:
        """Any array of the store by its path in it: ``columns/<c>``, ``final/<c>``,
        ``index/ends``, ``index/reserved``, ``priority/<level>`` (the writer flushes
        and allocates through these)."""
        return self._arrays[name]

    def read(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of a stored column, or with ``name = "final/<col>"`` the final observations
        of the episodes that end at ``rows`` (``InvalidArgumentError`` for a row where
        no live or recent episode ends)."""
        if not name.startswith("final/"):
            return self.column(name).read(rows)
        with self._lock:
            at = self.final_slots(np.asarray(rows, dtype=np.int64))
        if (at < 0).any():
            bad = np.asarray(rows).reshape(-1)[(at < 0).reshape(-1)]
            raise errors.InvalidArgumentError(
                f"rows: expected rows that end an episode (to read {name}), got {bad[:3].tolist()}"
            )
        return self.column(name).read(at)

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
        return self._arrays[f"columns/{name}"].read_range(start, stop, out)

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
        if self.priority_tree is None:
            raise errors.InvalidPriorityError(
                "leaf_priorities: expected a store created with priorities=mb.PriorityConfig(...), got priorities=None"
            )
        idx = check_rows(row_ids(rows, self.capacity), self.capacity)
        pt = self._synced_tree()
        assert pt is not None
        return np.asarray(pt.leaves[idx])

    # -- a reader's refresh --------------------------------------------------------------
    @locked
    def refresh(self) -> bool:
        """Reload the last commit (readers); return whether it changed."""
        manifest = load_manifest(self.path)
        if manifest.generation == self.generation:
            return False
        if self.mode == "a":
            return False  # the writer is the source of commits
        where = str(self.path / fmt.MANIFEST)
        if manifest.schema() != self.manifest.schema():
            raise errors.CorruptStoreError(f"{where}: expected the schema opened, {self.manifest.schema()}, got {manifest.schema()}")
        lanes = list(manifest.lanes)
        _counters.check_lanes(self.ends, self.reserved, lanes, self.lane_size, where, writer=False, since=list(self.committed))
        if self.priority_tree is not None:
            self._adopt_log(manifest)
        self.attrs = dict(manifest.attrs)
        self.ledger = Ledger.of(tuple(lanes), manifest.generation)
        return True

    # -- a reader's priority log -----------------------------------------------------------
    def _adopt_log(self, manifest: Manifest) -> None:
        """Take the priority log ``manifest`` names (applied later: :meth:`_synced_tree`),
        keeping a descriptor of its file: the writer removes it after the next checkpoint,
        and the descriptor still reads it whole. A log removed between the manifest's read
        and its open is that of an older commit: the newest manifest's is taken (its
        priorities are then newer than the ledger, never older)."""
        for attempt in range(3):
            want = manifest.priority_log  # (0, 0) before version 5 (manifest.parse)
            if want[0] == self._log_want[0] and (self._log_fd is not None or want[1] == 0):
                self._log_want = want
                return
            try:
                fd = prilog.open_log(self.path, *want)
            except errors.CorruptStoreError:
                newer = load_manifest(self.path)
                if attempt == 2 or newer.priority_log[0] == want[0]:
                    raise
                manifest = newer
                continue
            if self._log_fd is not None:
                os.close(self._log_fd)
            self._log_fd, self._log_want = fd, want
            return

    def _synced_tree(self) -> tree.PriorityTree | None:
        """The priority tree with the committed log applied (a reader replays what it has
        not yet: the new records of its checkpoint's log, or after a new checkpoint its
        copy-on-write pages dropped and the new log whole)."""
        with self._lock:
            if self._log_have != self._log_want and self.priority_tree is not None:
                ckpt, nbytes = self._log_want
                start = self._log_have[1] if self._log_have[0] == ckpt and self._log_have[1] <= nbytes else 0
                if start == 0 and self._log_private:
                    for arr in self.tree_arrays() or ():
                        arr.drop_private()  # the file's pages: the new checkpoint's tree
                    self._log_private = False
                if nbytes > start:
                    assert self._log_fd is not None
                    where = str(self.path / prilog.name(ckpt))
                    rows, values = prilog.read_fd(self._log_fd, where, ckpt, start, nbytes, self.capacity)
                    self._log_private = True
                    touched.replay(self.priority_tree, rows, values)
                self._log_have = self._log_want
            return self.priority_tree

    # -- memory ----------------------------------------------------------------------------
    def warm(self, columns: bool | Iterable[str] = False) -> None:
        """Read the priority tree, and ``columns``, into memory and map them in this process.

        The tree is read at random, a 4 KiB page at a time: a process that opens
        a large store whose tree is not in the page cache (the kernel dropped it,
        or the machine restarted) pays a random disk read per page at first use;
        at 6e8 rows that is minutes of slow samples. ``warm`` reads the whole
        tree at sequential disk speed (``_rawio.populate``: seconds at 6e8 rows) and
        keeps it mapped, so that the kernel sees it as in use. ``open`` does not
        call it (reopening stays a few milliseconds, and a reader that samples
        little needs no warm tree); call it after ``open`` in a learner. It is
        not locked and releases the GIL, so it may run in a background thread
        while the store is used: ``threading.Thread(target=buf.warm).start()``.

        ``columns`` (``True``: every stored column; or their names): also the rows
        of those columns the writer has written, read the same way. The kernel
        reads them ahead in large folios, mapped up to 2 MiB at a time: a store
        that fits in memory, opened from disk, then samples with fewer TLB misses
        than one read in by random faults (``benchmarks/RESULTS.md``). For a store
        that is read, not rewritten (a dataset, a finished run, a ring that has not
        wrapped): a writer that later rewrites rows held in a large folio writes the
        whole folio back at its commit (docs/design.md). Columns kept compressed are
        not mapped and are skipped.
        """
        try:
            names = (list(self.columns) if columns is True else [] if columns is False
                     else [columns] if isinstance(columns, str) else list(columns))
        except TypeError:
            raise errors.InvalidArgumentError(
                f"columns: expected True, False, a column name or names, got {columns!r}") from None
        unknown = [n for n in names if not isinstance(n, str) or n not in self.columns]
        if unknown:
            raise errors.InvalidArgumentError(f"columns: expected names among {list(self.columns)}, got {unknown}")
        if self.priority_tree is not None:
            for arr in self.priority_tree.arrays:
                _rawio.populate(arr, random=config.madvise_random)
        maps = [m for m in (self.column(name).mapped() for name in names) if m is not None]
        for lo, hi in self.tree_spans() if maps else ():  # per lane, the rows written
            for mapped in maps:
                _rawio.populate(mapped[lo:hi], random=config.madvise_random)

    @locked
    def release_memory(self) -> None:
        """Drop this process's mappings of the store's pages.

        A process that streams through a whole store (a converter, a verification
        pass) otherwise keeps every page it touched counted in its RSS. Nothing is
        lost: the pages stay in the page cache and the next access maps them again.
        """
        for name, arr in self._arrays.items():
            if name != "index/reserved":  # the reservation is read at every check
                arr.release()

    def drop_cache(self, start: int, stop: int) -> None:
        """Write rows ``[start, stop)`` of the raw columns behind: start writing them to
        disk and drop their clean pages from the page cache.

        For bulk writers whose output exceeds memory (converters, copies), like
        ``dd oflag=nocache``: the page cache keeps what readers use instead of
        the bulk output. Call it again on a range a few chunks later to drop the
        pages that were still being written. Nothing is lost and nothing is
        committed; later reads come from disk. No lock: it changes no data.
        """
        for name, arr in self._arrays.items():
            if name.startswith("columns/"):
                arr.drop_cache(start, stop)

    def close(self) -> None:
        """Close every array's file handles (the maps stay valid while referenced; the last
        view, whose tree source refers back to this store, is dropped: no cycle keeps them)."""
        self._last_view = None
        for arr in getattr(self, "_arrays", {}).values():
            arr.close()
        fd, self._log_fd = getattr(self, "_log_fd", None), None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.close()
