"""Blocked priority tree: sums, minima and maxima of row priorities.

The tree is two numpy arrays, allocated by the caller (in a store they are
memory maps of sparse files) and changed in place by the functions of this
package, which run compiled kernels (``mmbuffer.kernels.tree`` and ``.descent``,
numba, ``nogil``) over them: one descent for a whole batch, one pass for an update.
Nothing is compiled or imported before the first call that needs it.

Its modules, one job each: ``_layout`` (geometry, :class:`PriorityTree`,
:func:`init`, :func:`reset`, :func:`node_rows`), ``_update`` (:func:`update`,
:func:`set_range`, :func:`rebuild`), ``_query`` (:func:`total`,
:func:`min_live`, :func:`max_live`, :func:`find_prefix`, :func:`sample`),
``_ranges`` (:func:`range_sums`, :func:`find_in_ranges`), ``_nodes`` (leaves
gathered by block), ``_pages`` (the pages a write of some blocks changes) and
``_check`` (:func:`check`).

Layout
------
For a tree over ``capacity >= 1`` rows:

- ``nblocks = ceil(capacity / BLOCK)`` with ``BLOCK = 64``: leaves are grouped
  in blocks of 64 consecutive rows; the last block may be partial and reads as
  if padded with zeros.
- Above the blocks is a tree of fanout ``FANOUT = 16``, stored as *rows* of 16
  *slots*, one slot per child. The lowest level, ``D``, has ``r_D = ceil(nblocks
  / 16)`` rows, and its row ``i`` has the blocks ``16 i, ..., 16 i + 15`` as
  slots; level ``d < D`` has ``r_d = ceil(r_(d+1) / 16)`` rows, and its row
  ``i`` has the rows ``16 i, ..., 16 i + 15`` of level ``d + 1`` as slots;
  level 0 is the root row (``r_0 = 1``; ``D = 0`` when ``nblocks <= 16``).
  The rows are stored level by level from the root: level ``d`` is the rows
  ``[o_d, o_d + r_d)`` with ``o_0 = 0`` and ``o_(d+1) = o_d + r_d``; ``R`` rows
  in all.

======  =======  ============  ================================================
name    dtype    shape         content
======  =======  ============  ================================================
leaves  float32  (capacity,)   priority of each row, already transformed
                               (``(p + eps) ** alpha`` is the caller's
                               business); ``0.0`` for a row that is not live.
                               Leaves must be finite and ``>= 0``.
nodes   float64  (R, 32)       row ``g``, 256 bytes (16 rows fill a 4 KiB
                               page): float64 words 0-15 the slot sums (the
                               leaves under the slot, added in order);
                               as uint32, words 32-47 the min codes
                               ``0x7F800000 - bits(min)`` over the leaves
                               ``> 0`` (0: none); as float32, words 48-63 the
                               maxs over the leaves (0: none).
======  =======  ============  ================================================

Views: :attr:`PriorityTree.sums`, :attr:`~PriorityTree.min_codes` and
:attr:`~PriorityTree.maxs` (writable), :attr:`~PriorityTree.mins` (decoded).
Every empty value is zero bytes: all-zero arrays (a fresh sparse file, whose
holes read as zeros) are an empty tree, and writes store only values that
differ, so the regions nothing was written to stay holes. A row's total is
its 16 slot sums added in slot order (the root row's: :func:`total`); slots
with no block or row under them (past ``nblocks``, or past ``r_(d+1)``) are
zero.

Size: ``4 * capacity + 256 * R`` bytes (:func:`nbytes`); ``R <= nblocks / 15 +
D + 1``: 4.27 bytes per row from 1e6 rows on (the leaves' 4 bytes and 0.27 for
the nodes), at most 4.6 from 2,000 rows on.

Exactness
---------
Every write recomputes each touched block from its 64 leaves, then each
touched row's total, min and max from its slots into its slot in the parent
row, up to the root; nothing is ever incremented by a delta, so the float64
sums accumulate no drift however many updates are made. From a consistent
tree, any sequence of :func:`update` and :func:`set_range` leaves the arrays
bit-identical to a fresh :func:`rebuild` of the same leaves. A descent adds a
row's slot sums in the same order, so its running sums are exactly the totals
the parents hold.

Cost and concurrency
--------------------
:func:`update` of ``k`` rows and :func:`sample` of ``k`` draws cost O(k (64 +
16 D)): a descent reads one 128-byte run of slot sums per level and one
256-byte block of leaves, an update one node row per level and the block; the
batch goes level by level, first loading every draw's row (so the cache
misses of a tree larger than the caches overlap) and then scanning it.
:func:`range_sums` of ``k`` ranges and :func:`find_in_ranges` cost
O(k (64 + 32 D)) in numpy calls per level, reading exactly the leaves and
slots of the ranges' ends (never a difference of running sums, so a range
keeps its mass to float64 precision however heavy the rows around it).
:func:`rebuild` and :func:`check` are one compiled pass; given ``spans`` (the
leaf ranges that may hold a nonzero leaf) they touch only the rows above those,
O(the spans) however large the capacity. A store's ``warm()`` reads both
arrays into memory at sequential disk speed (``_rawio.populate``; a cold tree
is otherwise read a random 4 KiB page at a time). One writer; readers in other
processes may map the files read-only and see writes at once, so a read
during a write can see a block whose leaves disagree with its sum:
:func:`find_prefix` still never returns a zero leaf while its block has a
nonzero one, but such probabilities are approximate. (A store's writer maps its tree
copy-on-write and writes the changed pages at commit, ``_ledger/touched.py``:
readers of a store see committed sums only, ``_pages`` says which pages.)

Examples
--------
>>> from mmbuffer import tree as T
>>> tr = T.init(100)
>>> T.update(tr, [3, 70, 99], [1.0, 2.0, 5.0])
>>> T.total(tr), T.min_live(tr), T.max_live(tr)
(8.0, 1.0, 5.0)
>>> T.find_prefix(tr, [0.5, 1.0, 2.9, 3.0, 7.9]).tolist()
[3, 70, 70, 99, 99]
"""

from __future__ import annotations

from ._check import check
from ._layout import BLOCK, FANOUT, PriorityTree, init, layout, nbytes, node_rows, reset
from ._query import find_prefix, max_live, min_live, sample, total
from ._ranges import find_in_ranges, range_sums
from ._update import rebuild, set_range, update

__all__ = [
    "BLOCK", "FANOUT", "PriorityTree", "layout", "nbytes", "init", "reset", "update",
    "set_range", "total", "min_live", "max_live", "find_prefix", "sample", "range_sums",
    "find_in_ranges", "rebuild", "check", "node_rows",
]
