"""Blocked priority tree: sums, minima and maxima of row priorities.

The tree is four flat numpy arrays, allocated by the caller (in a store they
are ``numpy.memmap`` views of files) and changed in place by the pure
functions of this module. The functions never loop in Python over rows or
batch items, only over the depth of the tree (at most ~30 levels).

Layout
------
For a tree over ``capacity >= 1`` rows:

- ``nblocks = ceil(capacity / BLOCK)`` with ``BLOCK = 64``: leaves are grouped
  in blocks of 64 consecutive rows; the last block may be partial and reads as
  if padded with zeros.
- ``P = 2 ** ceil(log2(nblocks))`` leaf slots of the heap (``P = 1`` when
  ``nblocks = 1``); the heap has ``depth = log2(P)`` levels above its slots.

========  =======  ===========  ==============================================
name      dtype    shape        content
========  =======  ===========  ==============================================
leaves    float32  (capacity,)  priority of each row, already transformed
                                (``(p + eps) ** alpha`` is the caller's
                                business); ``0.0`` for a row that is not live.
                                Leaves must be finite and ``>= 0``.
sums      float64  (2 * P,)     heap of sums: node ``1`` is the root, node
                                ``P + b`` the sum of block ``b``'s 64 leaves,
                                node ``i`` is ``sums[2 i] + sums[2 i + 1]``.
mins      float32  (2 * P,)     same heap, minimum over the leaves ``> 0`` of
                                the subtree; ``+inf`` when it has none.
maxs      float32  (2 * P,)     same heap, maximum over the leaves of the
                                subtree; ``0`` when it has none.
========  =======  ===========  ==============================================

Node ``0`` (unused) and the padding slots ``P + b``, ``b >= nblocks``, hold
the neutral values (sum 0, min ``+inf``, max 0). Arrays must be C-contiguous:
nodes are read in child pairs through ``reshape(P, 2)``, leaves in whole
blocks through ``reshape(-1, 64)``. A block sum is the float64 sum of its 64
leaves, always computed by ``np.add.reduceat`` over whole blocks (one fixed
order per block, however many blocks are recomputed at once).

Size: ``4 * capacity + 32 * P`` bytes (:func:`nbytes`); since ``P < 2 *
nblocks``, ``32 * P <= capacity + 64``: at most 5 bytes per row plus 64 bytes
(4.9 bytes per row at 6e8 rows).

Exactness
---------
Every write recomputes each touched block from its 64 leaves, then every
touched ancestor from its two children (mins and maxs stop at the first level
where none changed: no ancestor's can); nothing is ever incremented by a
delta, so the float64 sums accumulate no drift however many updates are made.
From a consistent tree, any sequence of :func:`update` and :func:`set_range`
leaves the arrays bit-identical to a fresh :func:`rebuild` of the same leaves.

Cost and concurrency
--------------------
:func:`update` of ``k`` rows and :func:`sample` of ``k`` draws cost
O(k log k + 64 k + k depth) in a fixed number of numpy calls per level.
:func:`rebuild` and :func:`check` stream the leaves in chunks (bounded RAM).
One writer; readers in other processes may map the files read-only and see
writes at once, so a read during a write can see a block whose leaves disagree
with its sum: :func:`find_prefix` still never returns a zero leaf while its
block has a nonzero one, but such probabilities are approximate.

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

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from .errors import EmptyBufferError, InvalidArgumentError

__all__ = [
    "BLOCK", "PriorityTree", "layout", "nbytes", "init", "reset", "update", "set_range",
    "total", "min_live", "max_live", "find_prefix", "sample", "range_sum", "prefix_sum",
    "rebuild", "check",
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
Stats = tuple[Float64Array, Float32Array, Float32Array]


def _geometry(capacity: int) -> tuple[int, int]:
    """Return ``(nblocks, P)`` for ``capacity`` rows."""
    if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity < 1:
        raise InvalidArgumentError(f"capacity: expected an int >= 1, got {capacity!r}")
    nblocks = (int(capacity) + BLOCK - 1) >> _SHIFT
    return nblocks, 1 << (nblocks - 1).bit_length()


def layout(capacity: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shapes and dtypes of the four arrays of a tree over ``capacity`` rows.

    Returns ``name -> (shape, dtype)`` for ``leaves``, ``sums``, ``mins`` and
    ``maxs``, the keyword arguments of :class:`PriorityTree`. ``capacity`` may
    be any size (row ids are int64); :class:`InvalidArgumentError` unless it
    is a positive integer.

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

    Frozen, but the arrays are mutated in place by :func:`update`,
    :func:`set_range`, :func:`reset` and :func:`rebuild`. They are C-contiguous
    1-D arrays of the shapes and dtypes :func:`layout` gives (else
    :class:`InvalidArgumentError`), possibly ``numpy.memmap`` objects: the
    fields keep them (for ``flush``), the functions compute on plain ndarray
    views. ``PriorityTree(**arrays)`` takes a mapping keyed like :func:`layout`.

    Examples
    --------
    >>> import numpy as np
    >>> from mmbuffer import tree as T
    >>> tr = T.PriorityTree(**{k: np.zeros(s, d) for k, (s, d) in T.layout(10).items()})
    >>> T.reset(tr)  # fresh zero-filled arrays need min = +inf
    >>> tr.capacity, tr.width, tr.depth
    (10, 1, 0)
    """

    leaves: Float32Array
    sums: Float64Array
    mins: Float32Array
    maxs: Float32Array
    _leaf: Float32Array = field(init=False, repr=False)
    _rows: Float32Array = field(init=False, repr=False)  # whole blocks, [nfull, 64]
    _sum: Float64Array = field(init=False, repr=False)
    _min: Float32Array = field(init=False, repr=False)
    _max: Float32Array = field(init=False, repr=False)
    _shifts: Int64Array = field(init=False, repr=False)  # [[1], [2], ..., [depth]]
    _nblocks: int = field(init=False, repr=False)
    _nfull: int = field(init=False, repr=False)
    _width: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        leaf = _plain("leaves", self.leaves, np.float32, None)
        nblocks, width = _geometry(leaf.shape[0])
        nfull = leaf.shape[0] >> _SHIFT
        put = object.__setattr__
        put(self, "_leaf", leaf)
        put(self, "_rows", leaf[: nfull * BLOCK].reshape(nfull, BLOCK))
        put(self, "_sum", _plain("sums", self.sums, np.float64, 2 * width))
        put(self, "_min", _plain("mins", self.mins, np.float32, 2 * width))
        put(self, "_max", _plain("maxs", self.maxs, np.float32, 2 * width))
        depth = width.bit_length() - 1
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
        raise InvalidArgumentError(f"{name}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype != np.dtype(dtype):
        raise InvalidArgumentError(f"{name}: expected dtype {np.dtype(dtype)}, got {arr.dtype}")
    if arr.ndim != 1 or (size is not None and arr.shape[0] != size):
        expected = "(capacity,)" if size is None else f"({size},)"
        raise InvalidArgumentError(f"{name}: expected shape {expected}, got {arr.shape}")
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError(f"{name}: expected C-contiguous, got strides {arr.strides}")
    return arr.view(np.ndarray)


def init(capacity: int) -> PriorityTree:
    """A tree over ``capacity >= 1`` rows in RAM, all leaves 0 (nothing live).

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
    ``+inf``, not 0. Example: :class:`PriorityTree`.
    """
    for arr, neutral in ((tree._leaf, 0), (tree._sum, 0), (tree._min, np.inf), (tree._max, 0)):
        arr.fill(neutral)


# -- computing nodes -------------------------------------------------------------


def _block_stats(rows: Float32Array) -> Stats:
    """Sum (float64), min over ``> 0`` and max of each row of ``rows`` [k, 64].

    The one definition of a block's values, shared by :func:`update`,
    :func:`set_range`, :func:`rebuild` and :func:`check`.
    """
    flat = np.ascontiguousarray(rows).reshape(-1)
    starts = np.arange(0, flat.shape[0], BLOCK, dtype=np.int64)
    sums = np.add.reduceat(flat.astype(np.float64), starts)
    # Min and max on the bit patterns, which order like the values for
    # float32 >= 0 and reduce faster. As uint32, (bits - 1) sends 0.0 above
    # every positive value, so the min skips non-live leaves; an all-zero
    # block wraps back to 0 and becomes +inf. As int32, a negative (invalid)
    # leaf sorts below 0.0 and is never the max, as with floats.
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
    """The leaves of the contiguous real blocks ``[b0, b1)`` as [b1 - b0, 64]."""
    if b1 <= tree._nfull:
        return tree._rows[b0:b1]
    return _block_rows(tree, np.arange(b0, b1, dtype=np.int64))


def _propagate(tree: PriorityTree, nodes: Int64Array) -> None:
    """Recompute all ancestors of the sorted, unique block-level heap ``nodes``."""
    depth = tree.depth
    if depth == 0:
        return
    if nodes.shape[0] * depth <= _LEVELS_AT_ONCE:
        # The ids of every level in one array, one row per level; the
        # duplicates near the root are harmless (they write equal values).
        _recompute(tree, nodes >> tree._shifts)
        return
    up = nodes  # big batches: dedupe level by level instead
    for _ in range(depth):
        up = (up >> 1)[_run_ends(up >> 1, last=False)]
        _recompute(tree, up[None, :])


def _recompute(tree: PriorityTree, levels: Int64Array) -> None:
    """Recompute the nodes of each row of ``levels`` from their children, rows in order."""
    s, mn, mx = tree._sum, tree._min, tree._max
    s2, mn2, mx2 = s.reshape(-1, 2), mn.reshape(-1, 2), mx.reshape(-1, 2)
    # Child pairs are gathered into fixed buffers whose column views are made
    # once: at ~256 nodes a level the cost is numpy's per-call overhead, so
    # every call saved per level counts. mode="clip" lets take write straight
    # into ``out`` (the ids are valid by construction). Once a whole level of
    # mins (maxs) comes out unchanged, no ancestor's can change: stop there
    # (random updates rarely change a min or max more than ~6 levels up).
    k = levels.shape[1]
    pair64, new64 = np.empty((k, 2), np.float64), np.empty(k, np.float64)
    pair32, new32 = np.empty((k, 2), np.float32), np.empty(k, np.float32)
    old32 = np.empty(k, np.float32)
    l64, r64, l32, r32 = pair64[:, 0], pair64[:, 1], pair32[:, 0], pair32[:, 1]
    do_min = do_max = True
    for up in levels:
        s2.take(up, axis=0, out=pair64, mode="clip")
        np.add(l64, r64, out=new64)
        s[up] = new64
        if do_min:
            mn2.take(up, axis=0, out=pair32, mode="clip")
            np.minimum(l32, r32, out=new32)
            mn.take(up, out=old32, mode="clip")
            if do_min := bool((old32 != new32).any()):
                mn[up] = new32
        if do_max:
            mx2.take(up, axis=0, out=pair32, mode="clip")
            np.maximum(l32, r32, out=new32)
            mx.take(up, out=old32, mode="clip")
            if do_max := bool((old32 != new32).any()):
                mx[up] = new32


def _run_ends(ids: Int64Array, last: bool) -> npt.NDArray[np.bool_]:
    """Mask of the last (or first) element of each run of equal sorted ``ids``."""
    mask = np.ones(ids.shape[0], dtype=bool)
    np.not_equal(ids[1:], ids[:-1], out=mask[:-1] if last else mask[1:])
    return mask


def _blocks_span(tree: PriorityTree, b0: int, b1: int) -> None:
    """Recompute the heap slots of the real blocks ``[b0, b1)`` from the leaves."""
    w = tree._width
    for c in range(b0, b1, _CHUNK_BLOCKS):
        e = min(c + _CHUNK_BLOCKS, b1)
        sums, mins, maxs = _block_stats(_span_rows(tree, c, e))
        tree._sum[w + c : w + e], tree._min[w + c : w + e], tree._max[w + c : w + e] = (
            sums, mins, maxs
        )


def _upward(lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """Chunks ``[c, e)`` of the ancestors of the nodes ``[lo, hi)``, level by level up."""
    while lo > 1:
        lo, hi = lo >> 1, ((hi - 1) >> 1) + 1
        for c in range(lo, hi, _CHUNK_NODES):
            yield c, min(c + _CHUNK_NODES, hi)


def _parents(tree: PriorityTree, c: int, e: int) -> Stats:
    """Sums, mins and maxs of the nodes ``[c, e)`` recomputed from their children."""
    s, mn, mx = tree._sum[2 * c : 2 * e], tree._min[2 * c : 2 * e], tree._max[2 * c : 2 * e]
    return s[0::2] + s[1::2], np.minimum(mn[0::2], mn[1::2]), np.maximum(mx[0::2], mx[1::2])


def _levels_span(tree: PriorityTree, lo: int, hi: int) -> None:
    """Recompute every ancestor of the block-level heap nodes ``[lo, hi)``."""
    for c, e in _upward(lo, hi):
        tree._sum[c:e], tree._min[c:e], tree._max[c:e] = _parents(tree, c, e)


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
    indices : array_like of int
        Row ids in ``[0, capacity)``; negative ids are refused, not wrapped.
    values : array_like of float
        Transformed priorities, broadcastable to ``indices``; cast to float32
        (a positive value below float32's range becomes 0, i.e. not live).
        Checking them (finite, ``>= 0``) is the caller's job.

    Raises
    ------
    InvalidArgumentError
        An index is not an integer or is outside ``[0, capacity)``, or the
        shapes do not broadcast; nothing is written then.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(10)
    >>> T.update(tr, [2, 5, 2], [1.0, 3.0, 4.0])  # index 2 ends at 4.0
    >>> tr.leaves[[2, 5]].tolist(), T.total(tr)
    ([4.0, 3.0], 7.0)
    """
    idx = np.asarray(indices)
    if idx.size and idx.dtype.kind not in "iu":
        raise InvalidArgumentError(f"indices: expected integers, got dtype {idx.dtype}")
    idx = idx.astype(np.int64, copy=False)
    val = np.asarray(values, dtype=np.float32)
    if val.shape != idx.shape:
        try:
            val = np.broadcast_to(val, idx.shape)
        except ValueError:
            raise InvalidArgumentError(
                f"values: expected a shape broadcastable to {idx.shape}, got {val.shape}"
            ) from None
    idx, val = idx.ravel(), val.ravel()
    if idx.shape[0] == 0:
        return
    if idx.shape[0] > 1:  # sort (memmap-friendly) and keep the last write of each id
        order = idx.argsort(kind="stable")
        idx = idx.take(order)
        keep = _run_ends(idx, last=True)
        idx, val = idx[keep], val.take(order[keep])
    if idx[0] < 0 or idx[-1] >= tree.capacity:
        bad = idx[0] if idx[0] < 0 else idx[-1]
        raise InvalidArgumentError(
            f"indices: expected row ids in [0, {tree.capacity}), got {int(bad)}"
        )
    tree._leaf[idx] = val
    blocks = idx >> _SHIFT
    blocks = blocks[_run_ends(blocks, last=False)]
    nodes = blocks + tree._width
    sums, mins, maxs = _block_stats(_block_rows(tree, blocks))
    tree._sum[nodes], tree._min[nodes], tree._max[nodes] = sums, mins, maxs
    _propagate(tree, nodes)


def set_range(tree: PriorityTree, start: int, stop: int, value: npt.ArrayLike) -> None:
    """Set ``leaves[start:stop] = value`` and recompute the touched nodes.

    For the contiguous rows a ring writes or evicts: O(stop - start) for the
    leaves plus O(touched blocks + log P) for the nodes, with slices only. The
    result is bit-identical to :func:`update` on the same rows.

    Parameters
    ----------
    start, stop : int
        ``0 <= start <= stop <= capacity``; an empty range does nothing.
    value : float or array_like
        A scalar or ``stop - start`` values (cast to float32).

    Raises
    ------
    InvalidArgumentError
        The range is outside ``[0, capacity]`` or ``value`` has another shape.

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
    if not 0 <= int(start) <= int(stop) <= tree.capacity:
        raise InvalidArgumentError(f"start, stop: expected 0 <= start <= stop <= "
                                   f"{tree.capacity}, got start={start}, stop={stop}")
    return int(start), int(stop)


def rebuild(tree: PriorityTree) -> None:
    """Recompute every node from the leaves, in place.

    Streams the leaves in chunks of ``2**22`` rows (bounded RAM) and restores
    node 0 and the padding slots to their neutral values.

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
        arr[0] = arr[width + nblocks :] = neutral
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
    >>> T.total(tr), T.min_live(tr), T.max_live(tr)
    (0.75, 0.25, 0.5)
    """
    return float(tree._sum[1])


def min_live(tree: PriorityTree) -> float:
    """Smallest leaf ``> 0``; ``inf`` when no leaf is live (example: :func:`total`)."""
    return float(tree._min[1])


def max_live(tree: PriorityTree) -> float:
    """Largest leaf; ``0.0`` when no leaf is live (example: :func:`total`)."""
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
    child, left, go = np.empty(n, np.int64), np.empty(n, np.float64), np.empty(n, bool)
    for _ in range(depth):  # preallocated outputs: a level costs 5 numpy calls
        np.left_shift(node, 1, out=child)
        s.take(child, out=left, mode="clip")
        np.greater_equal(t, left, out=go)
        if guarded:
            go |= left <= 0
            go &= s.take(child + 1) > 0
        np.subtract(t, left, out=t, where=go)
        np.add(child, go, out=node)
    return node


def _find(tree: PriorityTree, targets: Float64Array) -> tuple[Int64Array, Float32Array]:
    """Leaf index and leaf value for each of the 1-D float64 ``targets``."""
    s, depth = tree._sum, tree.depth
    t = targets.copy()
    node = _descend(s, t, depth, guarded=False)
    empty = s.take(node) <= 0
    if empty.any():  # rare: redo those targets with the guarded descent
        redo = targets[empty]
        node[empty] = _descend(s, redo, depth, guarded=True)
        t[empty] = redo
    blocks = node - tree._width
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
    flat = rows.reshape(-1)
    base = np.arange(t.shape[0], dtype=np.int64) * BLOCK
    value = flat.take(base + np.minimum(j, BLOCK - 1))
    bad = (j == BLOCK) | (value <= 0)
    if not bad.any():
        return blocks * BLOCK + j, value
    live = rows[bad] > 0
    jb = j[bad][:, None]
    pos = np.arange(BLOCK, dtype=np.int64)
    prev = np.where(live & (pos <= jb), pos, -1).max(axis=1)
    nxt = np.where(live & (pos >= jb), pos, BLOCK - 1).min(axis=1)
    j[bad] = fixed = np.where(prev >= 0, prev, nxt)
    value[bad] = flat.take(base[bad] + fixed)
    # an all-zero block (only under a torn read) must still give a valid row id
    return np.minimum(blocks * BLOCK + j, tree.capacity - 1), value


def find_prefix(tree: PriorityTree, targets: npt.ArrayLike) -> Int64Array:
    """Leaf holding each target mass: the inverse of the cumulative sum.

    For a target ``t`` in ``[0, total)`` the result is the ``i`` with
    ``cumsum(leaves)[i - 1] <= t < cumsum(leaves)[i]``, found by descending
    the block heap (a loop over depth) and then a float64 cumsum inside the
    block. The result is never a leaf of priority 0: rounding that would land
    on a zero leaf or past the block is moved to the nearest nonzero leaf of
    that block, and ``t >= total`` gives the last nonzero leaf.

    ``targets`` may have any shape; the int64 result has the same.
    :class:`EmptyBufferError` when every leaf is 0.

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
    batch_size : int
        Number of draws, ``>= 0``.
    generator : torch.Generator, optional
        Source of the uniforms; torch's default generator when None.

    Returns
    -------
    indices : numpy.ndarray of int64, shape (batch_size,)
        Nondecreasing (segment order); never a leaf of priority 0.
    probabilities : numpy.ndarray of float64, shape (batch_size,)
        ``leaves[indices] / total``, each ``> 0``.

    Raises
    ------
    EmptyBufferError
        Every leaf is 0.
    InvalidArgumentError
        ``batch_size`` is not an int ``>= 0``.

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
    is_int = isinstance(batch_size, int | np.integer) and not isinstance(batch_size, bool)
    if not is_int or batch_size < 0:
        raise InvalidArgumentError(f"batch_size: expected an int >= 0, got {batch_size!r}")
    mass = float(tree._sum[1])
    if not mass > 0:
        raise EmptyBufferError(
            "sample: expected a tree with total priority > 0, got total 0 (no live row)"
        )
    n = int(batch_size)
    u = torch.rand(n, generator=generator, dtype=torch.float64).numpy()
    idx, value = _find(tree, (u + np.arange(n, dtype=np.float64)) * (mass / max(n, 1)))
    return idx, value.astype(np.float64) / mass


def range_sum(tree: PriorityTree, start: int, stop: int) -> float:
    """Sum of ``leaves[start:stop]`` from O(log P) nodes plus two partial blocks.

    :class:`InvalidArgumentError` unless ``0 <= start <= stop <= capacity``.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(1000)
    >>> T.set_range(tr, 0, 1000, 1.0)
    >>> T.range_sum(tr, 10, 990), T.range_sum(tr, 5, 5), T.prefix_sum(tr, 65)
    (980.0, 0.0, 65.0)
    """
    start, stop = _check_range(tree, start, stop)
    b0, b1 = (start + BLOCK - 1) >> _SHIFT, stop >> _SHIFT  # whole blocks [b0, b1)
    leaf, s = tree._leaf, tree._sum
    if b0 >= b1:
        return float(leaf[start:stop].astype(np.float64).sum())
    acc = float(leaf[start : b0 * BLOCK].astype(np.float64).sum())
    acc += float(leaf[b1 * BLOCK : stop].astype(np.float64).sum())
    lo, hi = tree._width + b0, tree._width + b1
    while lo < hi:  # the classic bottom-up segment-tree walk over [lo, hi)
        if lo & 1:
            acc, lo = acc + float(s[lo]), lo + 1
        if hi & 1:
            hi -= 1
            acc += float(s[hi])
        lo, hi = lo >> 1, hi >> 1
    return acc


def prefix_sum(tree: PriorityTree, stop: int) -> float:
    """Sum of ``leaves[:stop]``: ``range_sum(tree, 0, stop)``."""
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
    pad = slice(width + nblocks, None)
    neutral = (mn[pad] == np.inf).all() and not (s[pad].any() or mx[pad].any())
    if s[0] or mn[0] != np.inf or mx[0] or not neutral:
        return float("inf")
    worst = 0.0
    for c in range(0, nblocks, _CHUNK_BLOCKS):
        e = min(c + _CHUNK_BLOCKS, nblocks)
        rows = _span_rows(tree, c, e)
        if not ((rows >= 0).all() and np.isfinite(rows).all()):
            return float("inf")
        sums, mins, maxs = _block_stats(rows)
        lo, hi = width + c, width + e
        if not (np.array_equal(mn[lo:hi], mins) and np.array_equal(mx[lo:hi], maxs)):
            return float("inf")
        worst = max(worst, _rel(s[lo:hi], sums))
    for c, e in _upward(width, 2 * width):
        sums, mins, maxs = _parents(tree, c, e)
        if not (np.array_equal(mn[c:e], mins) and np.array_equal(mx[c:e], maxs)):
            return float("inf")
        worst = max(worst, _rel(s[c:e], sums))
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
