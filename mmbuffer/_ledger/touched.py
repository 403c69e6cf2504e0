"""The writer's private tree pages, the priority log and ``priority/touched``: the tree
file only ever holds a checkpoint's committed sums, the commits since are in the log,
and a kill inside a checkpoint's own tree write is repaired in O(blocks it wrote), not
by a rebuild of the whole tree.

Commits and checkpoints (format 5, ``_disk/prilog.py``). :meth:`Marks.plan` decides
what a commit does to the tree. A commit appends one log record, the rows changed
since the previous commit (recorded by :meth:`Marks.rows` and :meth:`Marks.range`, at
most ``config.priority_log_bytes`` worth, once each) with their leaf values at the
commit, pwritten and fdatasynced before the manifest's rename (which names the log's
committed length); the blocks stay pending. A *checkpoint* is what every commit did
before the log (below): it writes the pages of every block changed since the last
checkpoint and starts an empty log (``log-<c+1>``; the old file is removed after the
rename). A commit is a checkpoint when the log would pass ``priority_log_bytes``, when
the pages changed since the last checkpoint (estimated from the leaf and lowest node
pages the logged rows fall in) would pass ``private_tree_bytes`` or be smaller than the
record (a bulk extend: contiguous rows cost 12 bytes each in the log), after
:meth:`Marks.all` (a rebuild), when asked (``Writer.checkpoint``: ``close()``;
recovery after a repair), and always in a version 3 store (no log). The writer replays
the committed log at open (``Writer._replay_log``: its blocks become pending, the log
stays), after a kill mid-checkpoint after the repair below. Default bound: 32 MiB,
2.8M rows, replayed in 0.55 s at 1e8 rows (benchmarks/HISTORY.md); a checkpoint then
comes every ~109 commits of 25,600 rows, so its cost (at most the whole tree's pages)
is shared by that many.

The writer maps the tree's two arrays copy-on-write (``Store`` with ``mode="a"``,
``_disk/rawio.open_raw_fd(private=True)``): between commits its changes to leaves
and sums live in its anonymous memory, the file (which readers map shared) keeps the
last commit's tree, and a SIGKILL between commits leaves nothing to repair. A
:class:`Marks` records, in memory, the ``tree.BLOCK``-leaf blocks each change
touches. At commit, once the new manifest is written and synced (before its rename:
a full disk has refused the commit by then, before the tree file changed;
``Writer._write_manifest``), :meth:`Marks.write` creates ``priority/DIRTY``
durably, sets those blocks' bytes in ``priority/touched`` (uint8, one per block, a
memory-mapped file; no msync), ``pwrite``s the pages of the two arrays those
blocks span that this process holds a private copy of (``/proc/self/pagemap``:
``rawio.private_pages``; a ``pwrite``, so a full disk is an error, never a SIGBUS;
the tree's blocks are allocated with the reservation anyway) and fdatasyncs both
files; the manifest is renamed; :meth:`Marks.committed` clears the marks and
removes ``DIRTY`` (so no mark is set while no ``DIRTY`` is present). That window,
the only one in which the file's tree can disagree with itself, lasts the
``pwrite``s of the changed pages, two fdatasyncs and the rename (431 ms of a 438 ms
commit after 100 PER steps of 256 at 1e8: benchmarks/RESULTS.md). A kill inside it leaves ``DIRTY`` and the
marks: recovery (same boot: the page cache holds every mark, as ``index/progress``,
``progress.trusted``) recomputes only the marked blocks, zeroing the leaves the
recovered ledger does not hold live, and their ancestors (:func:`repair`), plus the
rows of the committed episodes it gives up; it logs how many blocks it recomputed
(``mmbuffer`` logger, INFO). After a power cut with ``DIRTY`` present, or a store
that has no marks yet, the tree is rebuilt whole. ``rebuild`` paths record every
block (:meth:`Marks.all`).

The private pages are kept after a commit, so the next stores into them take no
page fault (a shared map's page is write-protected again once written back: 303
minor faults per PER update step after a commit, benchmarks/HISTORY.md), and dropped
(``MADV_DONTNEED``: the file's, now committed, pages are read again; the leaves'
first, the nodes' only if they alone exceed the bound) when a commit leaves more
than ``config.private_tree_bytes`` of them (``MMBUFFER_PRIVATE_TREE_BYTES``,
512 MiB by default: the whole tree of a 1e8-row store; :attr:`Marks.bound` per
writer). Between commits the private memory is also the pages changed since the
last commit, whatever the bound.

Cost: a flag per touched block per update, in an in-memory array of one byte per block
(no store into the marks file until commit; its pages are allocated on first store,
1.5 MiB at most at 1e8 rows); at commit, a scan of those flags, a pagemap read per run of 512-page windows that the
blocks span, one ``pwrite`` per run of changed pages, two fdatasyncs. Marks cost
1/64 of the leaves' bytes on disk, allocated as the leaves are
(``Writer._reserve_space``); recovery reads them (capacity / 64 bytes, 1.5 MB at
1e8 rows) and recomputes 64 leaves and the ancestors per marked block.
"""

from __future__ import annotations

import functools
import logging
import mmap
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .. import tree
from .._disk import files as _files, prilog, rawio as _rawio
from .._disk.columns import RawArray
from ..config import config
from ..tree import _pages
from .index import Lane
from .layout import Layout
from .progress import open_or_add

NAME = "priority/touched"
_log = logging.getLogger("mmbuffer")
_CHUNK = 1 << 16  # blocks recomputed per vectorized pass in repair
_COMPACT = 1 << 16  # recorded ranges that start a merge of them
_SHIFT = tree.BLOCK.bit_length() - 1  # row -> block
_LEAF_PAGE = 10  # row -> page of the leaves (1024 float32 per 4 KiB page)
_NODE_PAGE = 14  # row -> page of the lowest node level (16 blocks per 256-byte row, 16 rows per page)


def nblocks(capacity: int) -> int:
    return -(-capacity // tree.BLOCK)


def open_marks(root: Path, capacity: int) -> tuple[RawArray, np.ndarray, bool]:
    """The writer's marks of store ``root``, and whether they were just added (a store
    that predates them: its marks say nothing yet, so recovery rebuilds whole)."""
    return open_or_add(root, NAME, nblocks(capacity), np.dtype(np.uint8))


class Marks:
    """One writer's record of the tree blocks it changed since its last commit, and the
    commit's write of them: the tree's arrays are mapped copy-on-write in the writer
    (``Store(private_tree=True)``), so its changes stay in its own memory until
    :meth:`write` puts the changed pages in the file."""

    def __init__(
        self, marks: np.ndarray, arrays: tuple[RawArray, RawArray] | None = None, dirty: Path | None = None,
        log: tuple[int, int] | None = None,
    ) -> None:
        self.marks = marks
        self._arrays = arrays  # the tree's leaves and nodes, as mapped by the writer
        self._dirty = dirty  # priority/DIRTY: present while a commit writes the tree
        self._ranges: list[tuple[int, int]] = []
        self._pending = np.zeros(len(marks), dtype=bool)  # blocks changed since the commit (pages on first store)
        self.private_pages = 0  # pages this writer holds a private copy of (both arrays)
        self._pages: tuple[np.ndarray, np.ndarray] | None = None  # which ones (_kept)
        self.bound = config.private_tree_bytes  # above this many private bytes, a commit drops them
        self.drops = 0  # how many commits dropped the private pages
        self.repaired = 0  # blocks the last recovery recomputed (repair)
        # the priority log (_disk/prilog.py): None for a store that has none (version 3)
        self.log = log  # (checkpoint, committed bytes), as the manifest says
        self.log_bound = config.priority_log_bytes  # past this many bytes, a commit is a checkpoint
        self._rows: list[np.ndarray] = []  # rows changed since the commit (their values go in the log)
        self._spans: list[tuple[int, int]] = []  # row ranges changed since the commit
        self._count = 0  # rows in _rows and _spans
        self._full = log is None  # the next commit must be a checkpoint (too much to log, a rebuild)
        n = len(marks) * tree.BLOCK
        self._page_flags = (np.zeros((n >> _LEAF_PAGE) + 1, bool), np.zeros((n >> _NODE_PAGE) + 1, bool))
        self._changed = 0  # pages changed since the checkpoint, estimated (_note_pages)
        self.checkpoints = 0  # commits that wrote the tree's pages
        self.log_commits = 0  # commits that appended to the log

    def rows(self, rows: np.ndarray) -> None:
        """Record the blocks of ``rows`` (before their leaves change): one flag per block,
        so a PER step costs a scatter of its batch, not a sort (``np.unique``); and the
        rows, whose values the commit logs."""
        r = np.array(rows, dtype=np.int64).reshape(-1)  # a copy: the caller may reuse its array
        self._pending[r >> _SHIFT] = True
        if not self._full:
            self._rows.append(r)
            self._count += len(r)
            self._check_count()

    def range(self, start: int, stop: int) -> None:
        """Record the blocks of rows ``[start, stop)``."""
        if stop > start:
            self._ranges.append((start // tree.BLOCK, (stop - 1) // tree.BLOCK + 1))
            if len(self._ranges) > _COMPACT:
                self._compact()
            if not self._full:
                self._spans.append((start, stop))
                self._count += stop - start
                self._check_count()

    def _check_count(self) -> None:
        """More rows than the log may take: the next commit is a checkpoint; stop recording rows."""
        if prilog.record_bytes(self._count) > self.log_bound:
            self._full = True
            self._rows, self._spans = [], []

    def replayed(self, rows: np.ndarray) -> None:
        """Record the blocks of rows replayed from the committed log (at open): the next
        checkpoint writes their pages; the log already holds their values."""
        self._pending[rows >> _SHIFT] = True
        self._note_pages(rows, [])

    def _note_pages(self, rows: np.ndarray, spans: list[tuple[int, int]]) -> int:
        """Flag the tree pages ``rows`` and ``spans`` change (the leaves' pages and the
        lowest node level's; the levels above hold at most 1/15 of those) and return the
        estimated pages changed since the checkpoint."""
        for flags, shift in zip(self._page_flags, (_LEAF_PAGE, _NODE_PAGE)):
            flags[rows >> shift] = True
            for a, b in spans:
                flags[a >> shift : ((b - 1) >> shift) + 1] = True
        self._changed = sum(int(np.count_nonzero(f)) for f in self._page_flags)
        return self._changed + self._changed // 15

    def _logged_rows(self) -> np.ndarray:
        spans = np.array(self._spans, dtype=np.int64).reshape(-1, 2)
        lengths = spans[:, 1] - spans[:, 0]
        span_rows = np.repeat(spans[:, 0] - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
        rows = np.concatenate([*self._rows, span_rows]) if self._rows else span_rows
        rows = np.sort(rows)  # sorted, once each: the record says which rows, not in which order
        return rows[np.r_[True, rows[1:] != rows[:-1]]] if len(rows) else rows  # (np.unique's hash: 20x slower)

    @property
    def since_checkpoint(self) -> bool:
        """Whether tree blocks changed since the last checkpoint (the file's pages lag)."""
        return bool(self._ranges) or bool(self._pending.any())

    def plan(self, pt: tree.PriorityTree, root: Path, generation: int, *, checkpoint: bool = False) -> tuple[Callable[[], int], tuple[int, int] | None, bool]:
        """What commit ``generation`` does to the tree: ``(write, log, is_checkpoint)``,
        ``write`` to run before the manifest's rename, ``log`` the manifest's new
        ``priority_log``. A log-only commit appends the changed rows' leaf values
        (``prilog.append``, fdatasynced); a checkpoint (``checkpoint=True``, a store
        without a log, a rebuild, a log past :attr:`log_bound` bytes or pages changed
        since the last checkpoint past :attr:`bound` bytes, or a record larger than
        those pages) writes the tree's pages
        (:meth:`write`) and starts the next checkpoint's log, empty."""
        if self.log is None:
            return self.writer(pt), None, True
        ckpt, nbytes = self.log
        if not (checkpoint or self._full):
            if not self._count:  # nothing live changed (every update was of rows no longer live)
                return (lambda: 0), self.log, False
            # decided before the rows are gathered (a bulk extend's million rows: a sort
            # for nothing): a checkpoint when the log would pass its bound, when the pages
            # changed since the last one pass the private bound, or when this record
            # would be larger than those pages (contiguous rows: 12 bytes a row in the
            # log, 4.3 in the pages): writing them is then cheaper than logging
            size = prilog.record_bytes(self._count)  # duplicates counted: at most this
            pages = self._note_pages(np.concatenate(self._rows) if self._rows else np.empty(0, np.int64), self._spans)
            if nbytes + size <= self.log_bound and size <= pages * mmap.PAGESIZE <= self.bound:
                rows = self._logged_rows()
                record = prilog.encode(ckpt, generation, rows, np.asarray(pt.leaves[rows]))

                def append() -> int:
                    prilog.append(root, ckpt, nbytes, record)
                    return 0

                return append, (ckpt, nbytes + len(record)), False
        return self.writer(pt), (ckpt + 1, 0), True

    def _compact(self) -> None:
        """Merge the recorded ranges into disjoint ones (a writer that extends one row at a
        time for hours without a commit would otherwise hold one range per extend; the
        blocks are flags, bounded by the tree). Amortized O(1) per recorded range."""
        if len(self._ranges) > 1:
            r = np.array(self._ranges, dtype=np.int64)
            r = r[np.argsort(r[:, 0], kind="stable")]
            reach = np.maximum.accumulate(r[:, 1])
            new = np.flatnonzero(np.r_[True, r[1:, 0] > reach[:-1]])
            stops = reach[np.r_[new[1:] - 1, len(r) - 1]]
            self._ranges = list(zip(r[new, 0].tolist(), stops.tolist()))

    def all(self) -> None:
        """Record every block (before a whole rebuild): the next commit is a checkpoint."""
        self._full = True
        self._rows, self._spans = [], []
        self.range(0, len(self.marks) * tree.BLOCK)

    def write(self, pt: tree.PriorityTree) -> int:
        """Put the tree's changed pages in its files, durably: create ``priority/DIRTY``
        (durably) and mark their blocks in ``priority/touched``, then ``pwrite``
        the pages this writer's private map changed among those the recorded blocks
        span and fdatasync the files. A kill from here to :meth:`committed` leaves
        the marks for recovery to repair (:func:`repair`). Returns the pages written."""
        blocks = np.flatnonzero(self._pending).astype(np.int64)  # sorted, unique
        if self._arrays is None or not (len(blocks) or self._ranges):
            return 0
        if self._dirty is not None and not self._dirty.exists():  # no DIRTY: no mark set
            self._dirty.touch()
            _files.fsync_dir(self._dirty.parent)
        self.marks[blocks] = 1  # in the page cache, for a recovery of this boot (no msync)
        for lo, hi in self._ranges:
            self.marks[lo:hi] = 1
        done = 0
        for arr, candidates, kept in zip(self._arrays, _pages.pages(pt, blocks, self._ranges), self._kept(pt)):
            written = arr.write_private(candidates)
            self.private_pages += len(written) - int(np.count_nonzero(kept[written]))
            kept[written] = True
            done += len(written)
        return done

    def _kept(self, pt: tree.PriorityTree) -> tuple[np.ndarray, np.ndarray]:
        """Per array, which pages this writer holds a private copy of (one flag per page)."""
        if self._pages is None:
            self._pages = tuple(np.zeros(-(-a.nbytes // mmap.PAGESIZE), dtype=bool) for a in pt.arrays)  # type: ignore[assignment]
        assert self._pages is not None
        return self._pages

    def writer(self, pt: tree.PriorityTree) -> Callable[[], int]:
        """:meth:`write` of ``pt``, to call later (a commit calls it once its new manifest
        is written and synced, just before the rename: ``Writer._write_manifest``)."""
        return functools.partial(self.write, pt)

    def committed(self, log: tuple[int, int] | None = None, checkpoint: bool = True, root: Path | None = None) -> None:
        """The commit is in place (its manifest names ``log``). After a log-only commit:
        forget the logged rows (the blocks stay pending for the next checkpoint). After
        a checkpoint: remove the previous checkpoint's log, clear the marks the last
        :meth:`write` made, remove ``priority/DIRTY``, and if the private pages exceed
        :attr:`bound` bytes (``MMBUFFER_PRIVATE_TREE_BYTES``; their content is in the
        file now) drop the leaves' ones, and the nodes' too if those alone still exceed it."""
        self.log = log
        self._rows, self._spans, self._count = [], [], 0
        if not checkpoint:
            self.log_commits += 1
            return
        self.checkpoints += 1
        self._full = log is None
        self._changed = 0
        for flags in self._page_flags:
            flags[np.flatnonzero(flags)] = False
        if log is not None and root is not None:  # after the rename: a reader holding the old log's fd reads it whole
            prilog.remove_others(root, log[0])
        for lo, hi in self._ranges:
            self.marks[lo:hi] = 0
        blocks = np.flatnonzero(self._pending)
        self.marks[blocks] = 0
        self._pending[blocks] = False
        self._ranges = []
        if self._dirty is not None:  # last: while no DIRTY is present, no mark is set
            self._dirty.unlink(missing_ok=True)
        if self._arrays is None or self._pages is None or self.private_pages * mmap.PAGESIZE <= self.bound:
            return
        self.drops += 1
        for arr, kept in zip(self._arrays, self._pages):  # the leaves first: every update stores
            arr.drop_private()  # into a node row per level, into one leaf block
            self.private_pages -= int(np.count_nonzero(kept))
            kept[:] = False
            if self.private_pages * mmap.PAGESIZE <= self.bound:
                break

    def repair(self, pt: tree.PriorityTree, layout: Layout, lanes: tuple[Lane, ...]) -> int:
        """Recompute the blocks marked in the file (:func:`repair`) and record them for
        the next :meth:`write`; return (and keep in :attr:`repaired`) how many."""
        marked = np.flatnonzero(self.marks).astype(np.int64)
        self.repaired = repair(pt, self.marks, layout, lanes)
        self._pending[marked] = True
        _log.info("priority tree: %d blocks repaired after an interrupted writer", self.repaired)
        return self.repaired

    def clear_all(self) -> None:
        """Clear every mark (recovery, once the tree is whole and checkpointed): only the
        set bytes are written, so untouched regions of the file stay holes."""
        self.marks[np.flatnonzero(self.marks)] = 0
        self._ranges = []
        self._pending[np.flatnonzero(self._pending)] = False


def repair(pt: tree.PriorityTree, marks: np.ndarray, layout: Layout, lanes: tuple[Lane, ...]) -> int:
    """Make the marked blocks consistent with ``lanes`` (the recovered ledger): zero
    the leaves of rows not live there, recompute each marked block from its leaves and
    its ancestors from their children. Returns how many blocks were recomputed."""
    blocks = np.flatnonzero(marks).astype(np.int64)
    _prefetch(pt, blocks)
    written = np.array([st.written for st in lanes], dtype=np.int64)
    first = np.array([st.first_start for st in lanes], dtype=np.int64)
    cap, n = layout.capacity, layout.lane_size
    for i in range(0, len(blocks), _CHUNK):
        rows = (blocks[i : i + _CHUNK, None] * tree.BLOCK + np.arange(tree.BLOCK)).reshape(-1)
        rows = rows[rows < cap]
        lane = rows // n
        absolute = layout.absolute_at(rows, written[lane])
        dead = (written[lane] == 0) | (absolute < first[lane]) | (absolute < 0)
        leaves = pt.leaves[rows]
        dead &= leaves != 0  # only what differs is written: holes stay holes
        if dead.any():
            tree.update(pt, rows[dead], 0.0)
        heads = rows[rows % tree.BLOCK == 0]  # one row per block: update recomputes its block
        tree.update(pt, heads, pt.leaves[heads])
    return len(blocks)


def replay(pt: tree.PriorityTree, rows: np.ndarray, values: np.ndarray) -> None:
    """Apply log records ``(rows, values)`` to ``pt`` (``tree.update``: each changed block
    and its ancestors recomputed, bit for bit a rebuild's), reading the pages they touch
    first: the whole tree at sequential disk speed (``rawio.populate``) when the rows
    fall in a good part of its leaf pages, else those pages together (``_prefetch``).
    A cold 1e8 tree and a 30 MiB log: 9.5 s of page faults one at a time without it
    (benchmarks/HISTORY.md)."""
    if not len(rows):
        return
    if len(rows) * 4 * mmap.PAGESIZE >= pt.leaves.nbytes:  # 1 - exp(-1/4): over a fifth of the leaf pages
        for arr in pt.arrays:
            _rawio.populate(arr, random=config.madvise_random)
    else:
        _prefetch(pt, np.unique(rows >> _SHIFT))
    tree.update(pt, rows, values)


def _prefetch(pt: tree.PriorityTree, blocks: np.ndarray) -> None:
    """Ask the kernel for the pages of the marked blocks' leaves and of their lowest
    node rows at once (``MADV_WILLNEED``: reads queued together, where page faults one
    at a time would wait for each: a cold store after a kill)."""
    if not len(blocks):
        return
    page = mmap.PAGESIZE
    lowest = int(pt.views.offs[-2]) if len(pt.views.offs) > 1 else 0  # the first row of the lowest level
    for arr, first_byte, nbytes in (
        (pt.leaves, blocks * (tree.BLOCK * pt.leaves.itemsize), tree.BLOCK * pt.leaves.itemsize),
        (pt.nodes, (lowest + blocks // tree.FANOUT) * pt.nodes.strides[0], pt.nodes.strides[0]),
    ):
        handle = _rawio.mmap_of(arr)
        if handle is None or not hasattr(mmap, "MADV_WILLNEED"):
            continue
        pages = np.unique(first_byte // page)
        cut = np.flatnonzero(np.diff(pages) != 1) + 1
        for run in np.split(pages, cut):
            start = int(run[0]) * page
            handle.madvise(mmap.MADV_WILLNEED, start, min(len(run) * page + nbytes, len(handle) - start))
