"""Blocked priority tree: sums, minima and maxima of row priorities.

The tree is five numpy arrays, allocated by the caller (in a store they are
``numpy.memmap`` views of files) and changed in place by the pure functions
of this package. The functions never loop in Python over rows or batch items,
only over the levels of the tree (at most 8 below 2**38 rows).

Its modules, one job each: ``_layout`` (geometry, :class:`PriorityTree`,
:func:`init`, :func:`reset`), ``_nodes`` (block and row values, the chunked
sweeps), ``_update`` (:func:`update`, :func:`set_range`, :func:`rebuild`),
``_query`` (:func:`total`, :func:`min_live`, :func:`max_live`,
:func:`find_prefix`, :func:`sample`), ``_ranges`` (:func:`range_sums`,
:func:`find_in_ranges`) and ``_check`` (:func:`check`).

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

========  =======  ===========  ==============================================
name      dtype    shape        content
========  =======  ===========  ==============================================
leaves    float32  (capacity,)  priority of each row, already transformed
                                (``(p + eps) ** alpha`` is the caller's
                                business); ``0.0`` for a row that is not live.
                                Leaves must be finite and ``>= 0``.
sums      float64  (R, 16)      ``sums[g, c]``: sum of the leaves under slot
                                ``c`` of row ``g``: a block sum on level
                                ``D``, else ``prefix[child, 16]``.
prefix    float64  (R, 17)      running sums of each row: ``prefix[g, 0] =
                                0``, ``prefix[g, c + 1] = prefix[g, c] +
                                sums[g, c]``, added in this order; so
                                ``prefix[g, 16]`` is the row's total, and
                                ``prefix[0, 16]`` the sum of all leaves.
mins      float32  (R, 16)      minimum over the leaves ``> 0`` under the
                                slot; ``+inf`` when it has none.
maxs      float32  (R, 16)      maximum over the leaves under the slot; ``0``
                                when it has none.
========  =======  ===========  ==============================================

Slots with no block or row under them (past ``nblocks``, or past ``r_(d+1)``)
hold the neutral values (sum 0, min ``+inf``, max 0). Arrays must be
C-contiguous: a descent reads one ``prefix`` row per level. A block sum is the
float64 sum of its 64 leaves, always computed by ``np.add.reduceat`` over whole
blocks (one fixed order per block, however many blocks are recomputed at once);
running sums always by ``torch.cumsum`` over whole rows (sequential per row).

Size: ``4 * capacity + 392 * R`` bytes (:func:`nbytes`); ``R <= nblocks / 15 +
D + 1``: 4.41 bytes per row from 1e6 rows on (the leaves' 4 bytes and 0.41 for
the nodes), at most 4.8 from 2,000 rows on.

Exactness
---------
Every write recomputes each touched block from its 64 leaves, then each
touched row's running sums from its slots and its slot in the parent row from
the row (mins and maxs stop at the first level where none changed: no
ancestor's can); nothing is ever incremented by a delta, so the float64 sums
accumulate no drift however many updates are made. From a consistent tree, any
sequence of :func:`update` and :func:`set_range` leaves the arrays bit-identical
to a fresh :func:`rebuild` of the same leaves.

Cost and concurrency
--------------------
:func:`update` of ``k`` rows and :func:`sample` of ``k`` draws cost
O(k log k + 64 k + 16 k D) in a fixed number of numpy calls per level: a
descent searches the slots of the deepest level of at most 256 rows at once,
then reads one 136-byte ``prefix`` row per level below it and one 256-byte
block of leaves. :func:`range_sums` of ``k`` ranges and :func:`find_in_ranges` cost
O(k (64 + 32 D)) the same way, reading exactly the leaves and slots of the
ranges' ends (never a difference of running sums, so a range keeps its
mass to float64 precision however heavy the rows around it).
:func:`rebuild` and :func:`check` stream the leaves in
chunks (bounded RAM). A store's ``warm()`` reads all five arrays into memory at
sequential disk speed (``_format.populate``; a cold tree is otherwise read a
random 4 KiB page at a time). One writer; readers in other processes may map the files read-only
and see writes at once, so a read during a write can see a block whose
leaves disagree with its sum: :func:`find_prefix` still never returns a zero
leaf while its block has a nonzero one, but such probabilities are
approximate.

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
