"""Blocked priority tree: sums, minima and maxima of row priorities.

The tree is a handful of flat numpy arrays, allocated by the caller (in a store
they are ``numpy.memmap`` views of files) and changed in place by the pure
functions of this module. The functions never loop in Python over rows or
batch items, only over the depth of the tree (at most ~30 levels).

Layout
------
For a tree over ``capacity`` rows (``capacity >= 1``):

- ``nblocks = ceil(capacity / BLOCK)`` with ``BLOCK = 64``: leaves are grouped
  in blocks of 64 consecutive rows; the last block may be partial and reads as
  if padded with zeros.
- ``P = 2 ** ceil(log2(nblocks))``: the number of leaf slots of the heap
  (``P = 1`` when ``nblocks = 1``). The heap has ``depth = log2(P)`` levels
  above its leaf slots.

========  =========  ============  =============================================
name      dtype      shape         content
========  =========  ============  =============================================
leaves    float32    (capacity,)   priority of each row, already transformed
                                   (``(p + eps) ** alpha`` is the caller's
                                   business); ``0.0`` for a row that is not
                                   live. Leaves must be finite and ``>= 0``.
sums      float64    (2 * P,)      heap of sums: node ``1`` is the root, node
                                   ``P + b`` is the sum of block ``b``'s 64
                                   leaves, node ``i`` is ``sums[2 i] +
                                   sums[2 i + 1]``; node ``0`` is unused (0).
mins      float32    (2 * P,)      same heap, minimum over the leaves ``> 0``
                                   of the subtree; ``+inf`` when it has none.
maxs      float32    (2 * P,)      same heap, maximum over the leaves of the
                                   subtree; ``0`` when it has none.
========  =========  ============  =============================================

Heap slots ``P + b`` with ``b >= nblocks`` (padding) and node ``0`` hold the
neutral values (sum 0, min ``+inf``, max 0). Arrays must be C-contiguous;
``sums``, ``mins`` and ``maxs`` are read in child pairs through
``reshape(P, 2)``, ``leaves`` in whole blocks through ``reshape(-1, 64)``.

A block sum is ``leaves[64 b : 64 b + 64].astype(float64).sum()``. Size:
``4 * capacity + 32 * P`` bytes, and since ``P < 2 * nblocks``,
``32 * P <= capacity + 64``: at most 5 bytes per row plus 64 bytes (about
4.5 bytes per row on average over capacities).

Exactness
---------
Every write recomputes each touched block from its 64 leaves, then every
touched ancestor from its two children; nothing is ever incremented by a delta.
The float64 sums therefore accumulate no drift however many updates are made:
after any sequence of :func:`update` and :func:`set_range` the arrays are
bit-identical to a fresh :func:`rebuild` from the same leaves, and
:func:`check` returns ``0.0``.

Concurrency
-----------
A writer and readers in other processes may map the same files. Reads made
while a write is in progress can see a block whose leaves disagree with its
stored sum; :func:`find_prefix` still never returns a zero leaf while the block
it lands in has a nonzero leaf, but probabilities computed from such a torn
read are approximate. The store publishes writes at commit time.

Examples
--------
>>> import numpy as np
>>> from mmbuffer import tree as T
>>> tr = T.init(100)
>>> T.update(tr, [3, 70, 99], [1.0, 2.0, 5.0])
>>> T.total(tr), T.min_live(tr), T.max_live(tr)
(8.0, 1.0, 5.0)
>>> T.find_prefix(tr, [0.5, 1.0, 2.9, 3.0, 7.9]).tolist()
[3, 70, 70, 99, 99]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from .errors import EmptyBufferError, InvalidArgumentError

__all__ = [
    "BLOCK",
    "PriorityTree",
    "layout",
    "nbytes",
    "init",
    "reset",
    "update",
    "set_range",
    "total",
    "min_live",
    "max_live",
    "find_prefix",
    "sample",
    "range_sum",
    "prefix_sum",
    "rebuild",
    "check",
]

BLOCK: Final = 64
"""Leaves per block (the leaf level of the heap)."""

_SHIFT: Final = 6  # log2(BLOCK)
_CHUNK_BLOCKS: Final = 1 << 16  # blocks per chunk in rebuild/check/set_range: 4M leaves
_CHUNK_NODES: Final = 1 << 20  # heap nodes per chunk when sweeping a level
_LEVELS_AT_ONCE: Final = 1 << 18  # update: node ids of all levels at once up to this many
_INF_BITS: Final = np.float32(np.inf).view(np.uint32)

Float32Array = npt.NDArray[np.float32]
Float64Array = npt.NDArray[np.float64]
Int64Array = npt.NDArray[np.int64]


def _geometry(capacity: int) -> tuple[int, int]:
    """Return ``(nblocks, P)`` for ``capacity`` rows."""
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
        raise InvalidArgumentError(
            f"capacity: expected a positive int, got {type(capacity).__name__}"
        )
    capacity = int(capacity)
    if capacity < 1:
        raise InvalidArgumentError(f"capacity: expected >= 1, got {capacity}")
    nblocks = (capacity + BLOCK - 1) >> _SHIFT
    return nblocks, 1 << (nblocks - 1).bit_length()


def layout(capacity: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shapes and dtypes of the four arrays of a tree over ``capacity`` rows.

    Parameters
    ----------
    capacity : int
        Number of rows (leaves), ``>= 1``.

    Returns
    -------
    dict
        ``{"leaves": ((capacity,), "float32"), "sums": ((2 P,), "float64"),
        "mins": ((2 P,), "float32"), "maxs": ((2 P,), "float32")}``, in the
        order the keyword arguments of :class:`PriorityTree` take them.

    Raises
    ------
    InvalidArgumentError
        ``capacity`` is not a positive integer.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> for name, (shape, dtype) in T.layout(1000).items():
    ...     print(name, shape, dtype)
    leaves (1000,) float32
    sums (32,) float64
    mins (32,) float32
    maxs (32,) float32
    """
    _, width = _geometry(capacity)
    return {
        "leaves": ((int(capacity),), "float32"),
        "sums": ((2 * width,), "float64"),
        "mins": ((2 * width,), "float32"),
        "maxs": ((2 * width,), "float32"),
    }


def nbytes(capacity: int) -> int:
    """Total bytes of the four arrays: ``4 * capacity + 32 * P``.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> T.nbytes(600_000_000) / 600_000_000
    4.894784853333333
    """
    _, width = _geometry(capacity)
    return 4 * int(capacity) + 32 * width


@dataclass(frozen=True, slots=True, eq=False)
class PriorityTree:
    """The four arrays of a priority tree (see the module docstring).

    The dataclass is frozen but the arrays are mutated in place by
    :func:`update`, :func:`set_range`, :func:`reset` and :func:`rebuild`. The
    arrays may be ``numpy.memmap`` objects; the tree keeps plain ndarray views
    of them for speed, so flushing stays the business of whoever owns the maps.
    ``PriorityTree(**arrays)`` accepts a mapping keyed like :func:`layout`.

    Parameters
    ----------
    leaves, sums, mins, maxs : numpy.ndarray
        C-contiguous 1-D arrays of the shapes and dtypes :func:`layout` gives.

    Raises
    ------
    InvalidArgumentError
        An array has the wrong dtype, shape or memory layout.

    Examples
    --------
    >>> import numpy as np
    >>> from mmbuffer import tree as T
    >>> arrays = {k: np.zeros(s, d) for k, (s, d) in T.layout(10).items()}
    >>> tr = T.PriorityTree(**arrays)
    >>> T.reset(tr)  # fresh zero-filled arrays need min = +inf
    >>> tr.capacity, tr.width, tr.depth
    (10, 1, 0)
    """

    leaves: Float32Array
    sums: Float64Array
    mins: Float32Array
    maxs: Float32Array
    _leaf: Float32Array = field(init=False, repr=False)
    _rows: Float32Array = field(init=False, repr=False)
    _sum: Float64Array = field(init=False, repr=False)
    _min: Float32Array = field(init=False, repr=False)
    _max: Float32Array = field(init=False, repr=False)
    _sum2: Float64Array = field(init=False, repr=False)
    _min2: Float32Array = field(init=False, repr=False)
    _max2: Float32Array = field(init=False, repr=False)
    _shifts: Int64Array = field(init=False, repr=False)
    _nblocks: int = field(init=False, repr=False)
    _nfull: int = field(init=False, repr=False)
    _width: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        leaf = _plain("leaves", self.leaves, np.float32, None)
        nblocks, width = _geometry(leaf.shape[0])
        s = _plain("sums", self.sums, np.float64, 2 * width)
        mn = _plain("mins", self.mins, np.float32, 2 * width)
        mx = _plain("maxs", self.maxs, np.float32, 2 * width)
        nfull = leaf.shape[0] >> _SHIFT
        depth = width.bit_length() - 1
        put = object.__setattr__
        put(self, "_leaf", leaf)
        put(self, "_rows", leaf[: nfull * BLOCK].reshape(nfull, BLOCK))
        put(self, "_sum", s)
        put(self, "_min", mn)
        put(self, "_max", mx)
        put(self, "_sum2", s.reshape(width, 2))
        put(self, "_min2", mn.reshape(width, 2))
        put(self, "_max2", mx.reshape(width, 2))
        put(self, "_shifts", np.arange(1, depth + 1, dtype=np.int64)[:, None])
        put(self, "_nblocks", nblocks)
        put(self, "_nfull", nfull)
        put(self, "_width", width)

    @property
    def capacity(self) -> int:
        """Number of leaves (rows)."""
        return int(self._leaf.shape[0])

    @property
    def width(self) -> int:
        """``P``: leaf slots of the block heap (a power of two)."""
        return self._width

    @property
    def depth(self) -> int:
        """``log2(P)``: levels of the heap above its block level."""
        return self._width.bit_length() - 1


def _plain(name: str, arr: Any, dtype: type, size: int | None) -> Any:
    """Validate one array of a tree and return a plain ndarray view of it."""
    if not isinstance(arr, np.ndarray):
        raise InvalidArgumentError(
            f"{name}: expected a numpy array, got {type(arr).__name__}"
        )
    want = np.dtype(dtype)
    if arr.dtype != want:
        raise InvalidArgumentError(f"{name}: expected dtype {want}, got {arr.dtype}")
    if arr.ndim != 1 or (size is not None and arr.shape[0] != size):
        expected = "(capacity,)" if size is None else f"({size},)"
        raise InvalidArgumentError(f"{name}: expected shape {expected}, got {arr.shape}")
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{name}: expected a C-contiguous array, got strides {arr.strides}"
        )
    return arr.view(np.ndarray)


def init(capacity: int) -> PriorityTree:
    """A tree over ``capacity`` rows in RAM, all leaves 0 (nothing live).

    Parameters
    ----------
    capacity : int
        Number of rows, ``>= 1``.

    Returns
    -------
    PriorityTree

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(5)
    >>> T.total(tr), T.min_live(tr), T.max_live(tr)
    (0.0, inf, 0.0)
    """
    arrays = {k: np.zeros(shape, dtype) for k, (shape, dtype) in layout(capacity).items()}
    arrays["mins"].fill(np.inf)
    return PriorityTree(**arrays)


def reset(tree: PriorityTree) -> None:
    """Set every leaf to 0 and every node to its neutral value, in place.

    Call it on freshly allocated (zero-filled) arrays: the neutral min is
    ``+inf``, not 0.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(5)
    >>> T.update(tr, [1], [2.0])
    >>> T.reset(tr)
    >>> T.total(tr), T.min_live(tr)
    (0.0, inf)
    """
    tree._leaf.fill(0.0)
    tree._sum.fill(0.0)
    tree._min.fill(np.inf)
    tree._max.fill(0.0)


# -- block level -------------------------------------------------------------


def _block_stats(rows: Float32Array) -> tuple[Float64Array, Float32Array, Float32Array]:
    """Sum (float64), min over ``> 0`` and max of each row of ``rows`` [k, 64].

    The one definition of a block's values: :func:`update`, :func:`rebuild`
    and :func:`check` all call it, which keeps them bit-identical. The sum is
    ``np.add.reduceat`` over the float64 copy of the leaves: a fixed order per
    block, whatever the number of blocks reduced at once.
    """
    flat = np.ascontiguousarray(rows).reshape(-1)
    starts = np.arange(0, flat.shape[0], BLOCK, dtype=np.int64)
    sums = np.add.reduceat(flat.astype(np.float64), starts)
    # Min and max through the bit patterns, which order like the values for
    # float32 >= 0 (and reduce faster than floats). (bits - 1) as uint32 sends
    # 0.0 above every positive value, so the min skips non-live leaves; an
    # all-zero block wraps back to 0 and becomes +inf. As int32, a negative
    # (invalid) leaf is below 0.0 and never the max, as with floats.
    low = np.minimum.reduceat(flat.view(np.uint32) - np.uint32(1), starts)
    low += np.uint32(1)
    low[low == 0] = _INF_BITS
    high = np.maximum.reduceat(flat.view(np.int32), starts)
    return sums, low.view(np.float32), high.view(np.float32)


def _block_rows(tree: PriorityTree, blocks: Int64Array) -> Float32Array:
    """Gather the leaves of ``blocks`` (any order, duplicates allowed) as [k, 64]."""
    nfull = tree._nfull
    if nfull == tree._nblocks:
        return tree._rows.take(blocks, axis=0)
    tail = np.zeros(BLOCK, np.float32)
    tail[: tree.capacity - nfull * BLOCK] = tree._leaf[nfull * BLOCK :]
    if nfull == 0:
        return np.tile(tail, (blocks.shape[0], 1))
    rows = tree._rows.take(np.minimum(blocks, nfull - 1), axis=0)
    rows[blocks == nfull] = tail
    return rows


def _span_rows(tree: PriorityTree, b0: int, b1: int) -> Float32Array:
    """The leaves of the contiguous blocks ``[b0, b1)`` as [b1 - b0, 64]."""
    nfull = tree._nfull
    if b1 <= nfull:
        return tree._rows[b0:b1]
    return _block_rows(tree, np.arange(b0, b1, dtype=np.int64))


def _write_blocks(tree: PriorityTree, nodes: Int64Array, rows: Float32Array) -> None:
    sums, mins, maxs = _block_stats(rows)
    tree._sum[nodes] = sums
    tree._min[nodes] = mins
    tree._max[nodes] = maxs


def _propagate(tree: PriorityTree, nodes: Int64Array) -> None:
    """Recompute all ancestors of the sorted, unique block-level heap ``nodes``."""
    depth = tree.depth
    k = nodes.shape[0]
    if depth == 0:
        return
    if k * depth > _LEVELS_AT_ONCE:  # big batches: dedupe level by level instead
        up = nodes
        for _ in range(depth):
            up = up >> 1
            if up.shape[0] > 1:
                first = np.empty(up.shape[0], dtype=bool)
                first[0] = True
                np.not_equal(up[1:], up[:-1], out=first[1:])
                up = up[first]
            _recompute(tree, up[None, :])
        return
    # Small batches: the ids of every level in one array, one row per level;
    # the duplicates near the root are harmless (they write equal values).
    _recompute(tree, nodes >> tree._shifts)


def _recompute(tree: PriorityTree, levels: Int64Array) -> None:
    """Recompute the nodes of each row of ``levels``, rows bottom-up."""
    s, s2 = tree._sum, tree._sum2
    mn, mn2 = tree._min, tree._min2
    mx, mx2 = tree._max, tree._max2
    # Child pairs are gathered into fixed buffers whose column views are made
    # once: at ~256 nodes a level the cost is numpy's per-call overhead, so
    # every call saved per level counts. mode="clip" lets take write straight
    # into ``out`` (the ids are valid by construction).
    k = levels.shape[1]
    pair64 = np.empty((k, 2), dtype=np.float64)
    pair32 = np.empty((k, 2), dtype=np.float32)
    new64 = np.empty(k, dtype=np.float64)
    new32 = np.empty(k, dtype=np.float32)
    l64, r64, l32, r32 = pair64[:, 0], pair64[:, 1], pair32[:, 0], pair32[:, 1]
    for up in levels:
        s2.take(up, axis=0, out=pair64, mode="clip")
        np.add(l64, r64, out=new64)
        s[up] = new64
        mn2.take(up, axis=0, out=pair32, mode="clip")
        np.minimum(l32, r32, out=new32)
        mn[up] = new32
        mx2.take(up, axis=0, out=pair32, mode="clip")
        np.maximum(l32, r32, out=new32)
        mx[up] = new32


def _blocks_span(tree: PriorityTree, b0: int, b1: int) -> None:
    """Recompute the heap slots of the real blocks ``[b0, b1)`` from the leaves."""
    width = tree._width
    for c in range(b0, b1, _CHUNK_BLOCKS):
        e = min(c + _CHUNK_BLOCKS, b1)
        sums, mins, maxs = _block_stats(_span_rows(tree, c, e))
        tree._sum[width + c : width + e] = sums
        tree._min[width + c : width + e] = mins
        tree._max[width + c : width + e] = maxs


def _levels_span(tree: PriorityTree, lo: int, hi: int) -> None:
    """Recompute every ancestor of the block-level heap nodes ``[lo, hi)``."""
    while lo > 1:
        lo, hi = lo >> 1, ((hi - 1) >> 1) + 1
        for c in range(lo, hi, _CHUNK_NODES):
            e = min(c + _CHUNK_NODES, hi)
            pair = tree._sum2[c:e]
            tree._sum[c:e] = pair[:, 0] + pair[:, 1]
            pair32 = tree._min2[c:e]
            tree._min[c:e] = np.minimum(pair32[:, 0], pair32[:, 1])
            pair32 = tree._max2[c:e]
            tree._max[c:e] = np.maximum(pair32[:, 0], pair32[:, 1])


# -- writes ------------------------------------------------------------------


def update(tree: PriorityTree, indices: npt.ArrayLike, values: npt.ArrayLike) -> None:
    """Set ``leaves[indices] = values`` and recompute the touched nodes.

    Batch-first: ``indices`` may have any shape and repeat; a repeated index
    takes the value of its last occurrence in C order (last write wins), as if
    the pairs were applied one by one. Each touched block is recomputed from
    its 64 leaves, then each touched ancestor from its two children, so no
    rounding accumulates (see "Exactness" in the module docstring).

    Parameters
    ----------
    tree : PriorityTree
    indices : array_like of int
        Row ids in ``[0, capacity)``; negative ids are refused, not wrapped.
    values : array_like of float
        Transformed priorities, broadcastable to ``indices``; cast to float32
        (a positive value below float32's range becomes 0, i.e. not live).
        Checking them (finite, ``>= 0``) is the caller's job.

    Raises
    ------
    InvalidArgumentError
        An index is outside ``[0, capacity)`` (nothing is written).

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(10)
    >>> T.update(tr, [2, 5, 2], [1.0, 3.0, 4.0])  # index 2 ends at 4.0
    >>> tr.leaves[[2, 5]].tolist(), T.total(tr)
    ([4.0, 3.0], 7.0)
    """
    idx = np.asarray(indices)
    if idx.dtype != np.int64:
        if idx.size and idx.dtype.kind not in "iu":
            raise InvalidArgumentError(f"indices: expected integers, got dtype {idx.dtype}")
        idx = idx.astype(np.int64)
    val = np.asarray(values, dtype=np.float32)
    if val.shape != idx.shape:
        try:
            val = np.broadcast_to(val, idx.shape)
        except ValueError:
            raise InvalidArgumentError(
                f"values: expected a shape broadcastable to {idx.shape}, got {val.shape}"
            ) from None
    idx = idx.ravel()
    n = idx.shape[0]
    if n == 0:
        return
    val = val.ravel()
    if n > 1:
        order = idx.argsort(kind="stable")
        idx = idx.take(order)
        keep = np.empty(n, dtype=bool)
        keep[-1] = True
        np.not_equal(idx[1:], idx[:-1], out=keep[:-1])  # last of each run
        order = order[keep]
        idx = idx[keep]
        val = val.take(order)
    if idx[0] < 0 or idx[-1] >= tree.capacity:
        bad = idx[0] if idx[0] < 0 else idx[-1]
        raise InvalidArgumentError(
            f"indices: expected row ids in [0, {tree.capacity}), got {int(bad)}"
        )
    tree._leaf[idx] = val
    blocks = idx >> _SHIFT
    if blocks.shape[0] > 1:
        first = np.empty(blocks.shape[0], dtype=bool)
        first[0] = True
        np.not_equal(blocks[1:], blocks[:-1], out=first[1:])
        blocks = blocks[first]
    nodes = blocks + tree._width
    _write_blocks(tree, nodes, _block_rows(tree, blocks))
    _propagate(tree, nodes)


def set_range(tree: PriorityTree, start: int, stop: int, value: npt.ArrayLike) -> None:
    """Set ``leaves[start:stop] = value`` and recompute the touched nodes.

    For the contiguous rows a ring writes or evicts: O(stop - start) for the
    leaves plus O(touched blocks + log P) for the nodes, with slices only. The
    result is bit-identical to :func:`update` on the same rows.

    Parameters
    ----------
    tree : PriorityTree
    start, stop : int
        ``0 <= start <= stop <= capacity``; an empty range does nothing.
    value : float or array_like
        A scalar or an array of ``stop - start`` values (cast to float32).

    Raises
    ------
    InvalidArgumentError
        The range is outside ``[0, capacity]``.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(200)
    >>> T.set_range(tr, 10, 150, 0.5)
    >>> T.total(tr)
    70.0
    >>> T.set_range(tr, 0, 200, 0.0)  # evict everything
    >>> T.total(tr), T.min_live(tr)
    (0.0, inf)
    """
    start, stop = _check_range(tree, start, stop)
    val = np.asarray(value, dtype=np.float32)
    if val.ndim and val.shape != (stop - start,):
        raise InvalidArgumentError(
            f"value: expected a scalar or shape ({stop - start},), got shape {val.shape}"
        )
    if start == stop:
        return
    tree._leaf[start:stop] = val
    b0, b1 = start >> _SHIFT, ((stop - 1) >> _SHIFT) + 1
    _blocks_span(tree, b0, b1)
    _levels_span(tree, tree._width + b0, tree._width + b1)


def _check_range(tree: PriorityTree, start: int, stop: int) -> tuple[int, int]:
    start, stop = int(start), int(stop)
    if not 0 <= start <= stop <= tree.capacity:
        raise InvalidArgumentError(
            f"start, stop: expected 0 <= start <= stop <= {tree.capacity}, "
            f"got start={start}, stop={stop}"
        )
    return start, stop


def rebuild(tree: PriorityTree) -> None:
    """Recompute every node from the leaves, in place.

    Works through the leaves in chunks of ``2**22`` rows, so a memory-mapped
    tree of any size is rebuilt with bounded RAM (about 100 MB of temporaries).
    Also restores node 0 and the padding slots to their neutral values.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(300)
    >>> tr.leaves[:] = 1.0  # written behind the tree's back
    >>> T.rebuild(tr)
    >>> T.total(tr), T.check(tr)
    (300.0, 0.0)
    """
    width, nblocks = tree._width, tree._nblocks
    for arr, neutral in ((tree._sum, 0.0), (tree._min, np.inf), (tree._max, 0.0)):
        arr[0] = neutral
        arr[width + nblocks :] = neutral
    _blocks_span(tree, 0, nblocks)
    _levels_span(tree, width, 2 * width)


# -- reads -------------------------------------------------------------------


def total(tree: PriorityTree) -> float:
    """Sum of all leaves (the root), as a Python float.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(3)
    >>> T.update(tr, [0, 2], [0.25, 0.5])
    >>> T.total(tr)
    0.75
    """
    return float(tree._sum[1])


def min_live(tree: PriorityTree) -> float:
    """Smallest leaf ``> 0``; ``inf`` when no leaf is live.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(3)
    >>> T.update(tr, [0, 2], [0.25, 0.5])
    >>> T.min_live(tr)
    0.25
    """
    return float(tree._min[1])


def max_live(tree: PriorityTree) -> float:
    """Largest leaf; ``0.0`` when no leaf is live.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(3)
    >>> T.update(tr, [0, 2], [0.25, 0.5])
    >>> T.max_live(tr)
    0.5
    """
    return float(tree._max[1])


def _descend(s: Float64Array, t: Float64Array, depth: int, guarded: bool) -> Int64Array:
    """Heap node on the block level for each target; ``t`` becomes the rest.

    Goes right when the target is at or past the left child's mass. Rounding
    (``t - left`` can reach the right sum although ``t < left + right``), or a
    target outside ``[0, total)``, can lead this into a subtree of mass 0; the
    guarded descent never enters one (it takes the other child instead).
    """
    n = t.shape[0]
    node = np.ones(n, dtype=np.int64)
    child = np.empty(n, dtype=np.int64)
    left = np.empty(n, dtype=np.float64)
    go = np.empty(n, dtype=bool)
    for _ in range(depth):  # preallocated outputs: a level costs 5 numpy calls
        np.left_shift(node, 1, out=child)
        s.take(child, out=left, mode="clip")
        np.greater_equal(t, left, out=go)
        if guarded:  # never into an empty child: right if left is empty
            go |= left <= 0
            go &= s.take(child + 1) > 0
        np.subtract(t, left, out=t, where=go)
        np.add(child, go, out=node)
    return node


def _find(tree: PriorityTree, targets: Float64Array) -> tuple[Int64Array, Float32Array]:
    """Leaf index and leaf value for each of the 1-D float64 ``targets``."""
    s, depth, width = tree._sum, tree.depth, tree._width
    t = targets.copy()
    node = _descend(s, t, depth, guarded=False)
    empty = s.take(node) <= 0
    if empty.any():  # rare: redo those targets with the guarded descent
        redo = targets[empty]
        node[empty] = _descend(s, redo, depth, guarded=True)
        t[empty] = redo
    blocks = node - width
    rows = _block_rows(tree, blocks)
    cum = torch.cumsum(torch.from_numpy(rows), 1, dtype=torch.float64).numpy()
    below = cum <= t[:, None]
    j = below.argmin(axis=1)  # first prefix sum above t: cum[j-1] <= t < cum[j]
    j[below[:, -1]] = BLOCK
    # The in-block cumsum adds in another order than the block sum the descent
    # used, so t can reach past the block's last prefix sum (j == 64, and a
    # target >= total lands there too). j can also point at a zero leaf (a
    # negative target, a partial last block, a torn concurrent read). Move such
    # picks to the last nonzero leaf before j, else the first one after it:
    # sampling must never return a row of zero priority.
    n = t.shape[0]
    flat = rows.reshape(-1)
    base = np.arange(n, dtype=np.int64) * BLOCK
    value = flat.take(base + np.minimum(j, BLOCK - 1))
    bad = (j == BLOCK) | (value <= 0)
    if bad.any():
        live = rows[bad] > 0
        jb = j[bad][:, None]
        pos = np.arange(BLOCK, dtype=np.int64)
        prev = np.where(live & (pos <= jb), pos, -1).max(axis=1)
        nxt = np.where(live & (pos >= jb), pos, BLOCK - 1).min(axis=1)
        fixed = np.where(prev >= 0, prev, nxt)
        j[bad] = fixed
        value[bad] = flat.take(base[bad] + fixed)
    return blocks * BLOCK + j, value


def find_prefix(tree: PriorityTree, targets: npt.ArrayLike) -> Int64Array:
    """Leaf holding each target mass: the inverse of the cumulative sum.

    For a target ``t`` in ``[0, total)`` the result is the ``i`` with
    ``cumsum(leaves)[i - 1] <= t < cumsum(leaves)[i]``, found by descending
    the block heap (a loop over depth) and then a float64 cumsum inside the
    block. The result is never a leaf of priority 0: rounding that would land
    on a zero leaf or past the block is moved to the nearest nonzero leaf of
    that block, and ``t >= total`` gives the last nonzero leaf.

    Parameters
    ----------
    tree : PriorityTree
    targets : array_like of float
        Target masses, any shape.

    Returns
    -------
    numpy.ndarray of int64
        Leaf indices, shaped like ``targets``.

    Raises
    ------
    EmptyBufferError
        Every leaf is 0.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(6)
    >>> T.update(tr, [1, 2, 4], [1.0, 2.0, 1.0])
    >>> T.find_prefix(tr, [0.0, 0.99, 1.0, 2.99, 3.0, 4.0, 100.0]).tolist()
    [1, 1, 2, 2, 4, 4, 4]
    """
    t = np.asarray(targets, dtype=np.float64)
    if not tree._sum[1] > 0:
        raise EmptyBufferError("find_prefix: expected a tree with total > 0, got total 0")
    idx, _ = _find(tree, t.reshape(-1))
    return idx.reshape(t.shape)


def sample(
    tree: PriorityTree, batch_size: int, generator: torch.Generator | None = None
) -> tuple[Int64Array, Float64Array]:
    """Draw ``batch_size`` leaves with probability ``leaf / total``, stratified.

    ``[0, total)`` is cut into ``batch_size`` equal segments and one uniform
    target is drawn in each (``torch.rand(batch_size, generator=generator,
    dtype=torch.float64)``), so the same generator state gives the same batch.

    Parameters
    ----------
    tree : PriorityTree
    batch_size : int
        Number of draws, ``>= 0``.
    generator : torch.Generator, optional
        Source of the uniforms; torch's default generator when None.

    Returns
    -------
    indices : numpy.ndarray of int64, shape (batch_size,)
        Sorted ascending (segment order); never a leaf of priority 0.
    probabilities : numpy.ndarray of float64, shape (batch_size,)
        ``leaves[indices] / total``, each ``> 0``.

    Raises
    ------
    EmptyBufferError
        Every leaf is 0.
    InvalidArgumentError
        ``batch_size`` is negative.

    Examples
    --------
    >>> import torch
    >>> from mmbuffer import tree as T
    >>> tr = T.init(4)
    >>> T.update(tr, [0, 3], [1.0, 3.0])
    >>> idx, p = T.sample(tr, 4, torch.Generator().manual_seed(0))
    >>> idx.tolist(), p.tolist()
    ([0, 3, 3, 3], [0.25, 0.75, 0.75, 0.75])
    """
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, (int, np.integer))
        or batch_size < 0
    ):
        raise InvalidArgumentError(f"batch_size: expected an int >= 0, got {batch_size!r}")
    mass = float(tree._sum[1])
    if not mass > 0:
        raise EmptyBufferError(
            "sample: expected a tree with total priority > 0, got total 0 (no live row)"
        )
    n = int(batch_size)
    u = torch.rand(n, generator=generator, dtype=torch.float64).numpy()
    u += np.arange(n, dtype=np.float64)
    u *= mass / n if n else 0.0
    idx, value = _find(tree, u)
    return idx, value.astype(np.float64) / mass


def range_sum(tree: PriorityTree, start: int, stop: int) -> float:
    """Sum of ``leaves[start:stop]`` in O(log P) nodes plus two partial blocks.

    Parameters
    ----------
    tree : PriorityTree
    start, stop : int
        ``0 <= start <= stop <= capacity``.

    Raises
    ------
    InvalidArgumentError
        The range is outside ``[0, capacity]``.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(1000)
    >>> T.set_range(tr, 0, 1000, 1.0)
    >>> T.range_sum(tr, 10, 990), T.range_sum(tr, 5, 5)
    (980.0, 0.0)
    """
    start, stop = _check_range(tree, start, stop)
    b0 = (start + BLOCK - 1) >> _SHIFT  # first whole block
    b1 = stop >> _SHIFT  # past the last whole block
    leaf = tree._leaf
    if b0 >= b1:
        return float(leaf[start:stop].astype(np.float64).sum())
    acc = float(leaf[start : b0 * BLOCK].astype(np.float64).sum())
    acc += float(leaf[b1 * BLOCK : stop].astype(np.float64).sum())
    s = tree._sum
    lo, hi = tree._width + b0, tree._width + b1
    while lo < hi:
        if lo & 1:
            acc += float(s[lo])
            lo += 1
        if hi & 1:
            hi -= 1
            acc += float(s[hi])
        lo >>= 1
        hi >>= 1
    return acc


def prefix_sum(tree: PriorityTree, stop: int) -> float:
    """Sum of ``leaves[:stop]``; same as ``range_sum(tree, 0, stop)``.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(100)
    >>> T.set_range(tr, 0, 100, 2.0)
    >>> T.prefix_sum(tr, 65)
    130.0
    """
    return range_sum(tree, 0, stop)


def check(tree: PriorityTree) -> float:
    """Largest disagreement between the stored nodes and the leaves.

    Recomputes every block from its leaves and every node from its stored
    children, in chunks (bounded RAM, like :func:`rebuild`). Returns the
    largest relative difference ``|stored - recomputed| / max(|stored|,
    |recomputed|)`` of the sums; ``inf`` when any min or max differs (they
    are exact), a neutral slot is not neutral, or a leaf is NaN, infinite or
    negative. ``0.0`` means the tree is exactly what :func:`rebuild` makes.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(100)
    >>> T.update(tr, [1, 50], [1.0, 2.0])
    >>> T.check(tr)
    0.0
    >>> tr.sums[1] = 3.5  # corrupt the root
    >>> T.check(tr)
    0.14285714285714285
    """
    width, nblocks = tree._width, tree._nblocks
    s, mn, mx = tree._sum, tree._min, tree._max
    neutral = (
        s[0] == 0 and mn[0] == np.inf and mx[0] == 0
        and not s[width + nblocks :].any()
        and bool((mn[width + nblocks :] == np.inf).all())
        and not mx[width + nblocks :].any()
    )
    if not neutral:
        return float("inf")
    worst = 0.0
    for c in range(0, nblocks, _CHUNK_BLOCKS):
        e = min(c + _CHUNK_BLOCKS, nblocks)
        rows = _span_rows(tree, c, e)
        if not (rows >= 0).all() or not np.isfinite(rows).all():
            return float("inf")
        sums, mins, maxs = _block_stats(rows)
        lo, hi = width + c, width + e
        if not (np.array_equal(mn[lo:hi], mins) and np.array_equal(mx[lo:hi], maxs)):
            return float("inf")
        worst = max(worst, _rel(s[lo:hi], sums))
    lo, hi = width, 2 * width
    while lo > 1:
        lo, hi = lo >> 1, ((hi - 1) >> 1) + 1
        for c in range(lo, hi, _CHUNK_NODES):
            e = min(c + _CHUNK_NODES, hi)
            pair = tree._sum2[c:e]
            worst = max(worst, _rel(s[c:e], pair[:, 0] + pair[:, 1]))
            pair32 = tree._min2[c:e]
            if not np.array_equal(mn[c:e], np.minimum(pair32[:, 0], pair32[:, 1])):
                return float("inf")
            pair32 = tree._max2[c:e]
            if not np.array_equal(mx[c:e], np.maximum(pair32[:, 0], pair32[:, 1])):
                return float("inf")
    return worst


def _rel(stored: Float64Array, fresh: Float64Array) -> float:
    """Largest ``|a - b| / max(|a|, |b|)`` (0 where both are 0, inf for NaN)."""
    diff = np.abs(stored - fresh)
    if not diff.any():
        return 0.0
    scale = np.maximum(np.abs(stored), np.abs(fresh))
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(diff == 0, 0.0, diff / scale)  # NaN stays NaN
    worst = float(rel.max())
    return worst if worst == worst else float("inf")
