"""Which tree blocks changed since the last commit: ``priority/touched``, so that a
writer killed between commits is repaired in O(work since the commit), not by a
rebuild of the whole tree.

A commit leaves the tree consistent with its ledger (every node recomputed from its
children; every leaf outside the live rows 0). Between commits the writer changes
leaves and their ancestors in place, through the shared map, and a kill can leave a
node half-updated and leaves of rows that are not committed. Before it changes
a block of ``tree.BLOCK`` leaves, the writer sets that block's byte in
``priority/touched`` (uint8, one per block, a memory-mapped file; no msync): after
a kill the page cache holds every mark made before it, so recovery recomputes only
the marked blocks, zeroing the leaves there that the recovered ledger does not hold
live, and their ancestors (:func:`repair`), plus the rows of the committed
episodes it gives up. Like ``index/progress`` the marks are trusted only in the boot
that made them (``progress.trusted``); after a power cut, or when a store has no
marks (``priority/DIRTY`` present, marks absent), the tree is rebuilt whole, as
before. A commit clears the marks it made (after its manifest is in place);
``rebuild`` paths mark every block first, so a kill inside one leaves a tree the
next recovery rebuilds again.

Why marks and not the private tree pages docs/design.md allows (the writer's changes
kept in anonymous memory, written at commit): the marks are a small change with the
same recovery bound, O(blocks touched since the commit), and leave the tree's
sharing with readers as it is; private pages would also take the tree out of the
kernel's writeback between commits (the 6e8 page faults of benchmarks/RESULTS.md)
and spare recovery the reads of the touched blocks, and remain to be built.

Cost: one byte store per touched block (a slice for a range), about 1/64 of the
leaves' bytes on disk, allocated as the leaves are (``Writer._reserve_space``);
recovery reads the marks (capacity / 64 bytes, 1.5 MB at 1e8 rows) and recomputes
64 leaves and the ancestors per marked block.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from .. import tree
from .._disk import rawio as _rawio
from .._disk.columns import RawArray
from .index import Lane
from .layout import Layout
from .progress import open_or_add

NAME = "priority/touched"
_CHUNK = 1 << 16  # blocks recomputed per vectorized pass in repair


def nblocks(capacity: int) -> int:
    return -(-capacity // tree.BLOCK)


def open_marks(root: Path, capacity: int) -> tuple[RawArray, np.ndarray, bool]:
    """The writer's marks of store ``root``, and whether they were just added (a store
    that predates them: its marks say nothing yet, so recovery rebuilds whole)."""
    return open_or_add(root, NAME, nblocks(capacity), np.dtype(np.uint8))


class Marks:
    """The marks of one writer: what it set since its last commit, to clear at the next."""

    def __init__(self, marks: np.ndarray) -> None:
        self.marks = marks
        self._ranges: list[tuple[int, int]] = []
        self._blocks: list[np.ndarray] = []

    def rows(self, rows: np.ndarray) -> None:
        """Mark the blocks of ``rows`` (before their leaves change)."""
        blocks = np.unique(np.asarray(rows, dtype=np.int64).reshape(-1) // tree.BLOCK)
        self.marks[blocks] = 1
        self._blocks.append(blocks)

    def range(self, start: int, stop: int) -> None:
        """Mark the blocks of rows ``[start, stop)``."""
        if stop > start:
            lo, hi = start // tree.BLOCK, (stop - 1) // tree.BLOCK + 1
            self.marks[lo:hi] = 1
            self._ranges.append((lo, hi))

    def all(self) -> None:
        """Mark every block (before a whole rebuild)."""
        self.range(0, len(self.marks) * tree.BLOCK)

    def clear(self) -> None:
        """Clear the marks made since the last commit (the commit is in place)."""
        for lo, hi in self._ranges:
            self.marks[lo:hi] = 0
        for blocks in self._blocks:
            self.marks[blocks] = 0
        self._ranges, self._blocks = [], []

    def clear_all(self) -> None:
        """Clear every mark (recovery, once the tree is whole): only the set bytes are
        written, so untouched regions of the file stay holes."""
        self.marks[np.flatnonzero(self.marks)] = 0
        self._ranges, self._blocks = [], []


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
