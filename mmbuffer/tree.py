"""Blocked priority tree: sums, minima and maxima of row priorities.

The tree is five numpy arrays, allocated by the caller (in a store they are
``numpy.memmap`` views of files) and changed in place by the pure functions
of this module. The functions never loop in Python over rows or batch items,
only over the levels of the tree (at most 8 below 2**38 rows).

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

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from .errors import EmptyBufferError, InvalidArgumentError

__all__ = [
    "BLOCK", "FANOUT", "PriorityTree", "layout", "nbytes", "init", "reset", "update",
    "set_range", "total", "min_live", "max_live", "find_prefix", "sample", "range_sums",
    "find_in_ranges", "rebuild", "check",
]

BLOCK: Final = 64
"""Leaves per block (the leaf level of the tree)."""
FANOUT: Final = 16
"""Slots per row of the tree above the blocks."""

_SHIFT: Final = 6  # log2(BLOCK)
_FSHIFT: Final = 4  # log2(FANOUT)
_CHUNK_BLOCKS: Final = 1 << 16  # blocks per chunk in rebuild/check/set_range: 4M leaves
_CHUNK_ROWS: Final = 1 << 16  # tree rows per chunk when sweeping a level
_FLAT_ROWS: Final = 256  # a descent starts with one search over a level this small
_LEVELS_AT_ONCE: Final = 1 << 14  # update: row ids of all levels at once up to this many
_INF_BITS: Final = np.float32(np.inf).view(np.uint32)

Float32Array = npt.NDArray[np.float32]
Float64Array = npt.NDArray[np.float64]
Int64Array = npt.NDArray[np.int64]
Stats = tuple[Float64Array, Float32Array, Float32Array]
_NAMES: Final = ("leaves", "sums", "prefix", "mins", "maxs")


def _geometry(capacity: int) -> tuple[int, tuple[int, ...]]:
    """Return ``(nblocks, (r_0, ..., r_D))`` for ``capacity`` rows."""
    if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity < 1:
        raise InvalidArgumentError(f"capacity: expected an int >= 1, got {capacity!r}")
    nblocks = (int(capacity) + BLOCK - 1) >> _SHIFT
    rows = [(nblocks + FANOUT - 1) >> _FSHIFT]
    while rows[-1] > 1:
        rows.append((rows[-1] + FANOUT - 1) >> _FSHIFT)
    return nblocks, tuple(reversed(rows))


def layout(capacity: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shapes and dtypes of the five arrays of a tree over ``capacity`` rows.

    Returns ``name -> (shape, dtype)`` for ``leaves``, ``sums``, ``prefix``,
    ``mins`` and ``maxs``, the keyword arguments of :class:`PriorityTree`.
    ``capacity`` may be any size (row ids are int64);
    :class:`InvalidArgumentError` unless it is a positive integer.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> for name, (shape, dtype) in T.layout(5000).items():
    ...     print(name, shape, dtype)
    leaves (5000,) float32
    sums (6, 16) float64
    prefix (6, 17) float64
    mins (6, 16) float32
    maxs (6, 16) float32
    """
    _, rows = _geometry(capacity)
    r = sum(rows)
    return {
        "leaves": ((int(capacity),), "float32"),
        "sums": ((r, FANOUT), "float64"),
        "prefix": ((r, FANOUT + 1), "float64"),
        "mins": ((r, FANOUT), "float32"),
        "maxs": ((r, FANOUT), "float32"),
    }


def nbytes(capacity: int) -> int:
    """Total bytes of the five arrays: ``4 * capacity + 392 * R``.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> round(T.nbytes(600_000_000) / 600_000_000, 4)
    4.4083
    """
    _, rows = _geometry(capacity)
    return 4 * int(capacity) + (24 * FANOUT + 8) * sum(rows)


@dataclass(frozen=True, slots=True, eq=False)
class PriorityTree:
    """The five arrays of a priority tree (see the module docstring).

    Frozen, but the arrays are mutated in place by :func:`update`,
    :func:`set_range`, :func:`reset` and :func:`rebuild`. They are C-contiguous
    arrays of the shapes and dtypes :func:`layout` gives (else
    :class:`InvalidArgumentError`), possibly ``numpy.memmap`` objects: the
    fields keep them (for ``flush``), the functions compute on plain ndarray
    views. ``PriorityTree(**arrays)`` takes a mapping keyed like :func:`layout`.

    Examples
    --------
    >>> import numpy as np
    >>> from mmbuffer import tree as T
    >>> tr = T.PriorityTree(**{k: np.zeros(s, d) for k, (s, d) in T.layout(10).items()})
    >>> T.reset(tr)  # fresh zero-filled arrays need min = +inf
    >>> tr.capacity, tr.depth, len(tr.arrays)
    (10, 1, 5)
    """

    leaves: Float32Array
    sums: Float64Array
    prefix: Float64Array
    mins: Float32Array
    maxs: Float32Array
    _leaf: Float32Array = field(init=False, repr=False)
    _rows: Float32Array = field(init=False, repr=False)  # whole blocks, [nfull, 64]
    _sum: Float64Array = field(init=False, repr=False)
    _pre: Float64Array = field(init=False, repr=False)
    _min: Float32Array = field(init=False, repr=False)
    _max: Float32Array = field(init=False, repr=False)
    _levels: tuple[tuple[int, int], ...] = field(init=False, repr=False)  # (o_d, r_d)
    _slot: tuple[tuple[Any, Any, Any], ...] = field(init=False, repr=False)  # flat sums, mins, maxs
    # of the slots of each level: slot i of level d is child i of the level
    _top: int = field(init=False, repr=False)  # see _descend
    _nblocks: int = field(init=False, repr=False)
    _nfull: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        leaf = _plain("leaves", self.leaves, np.float32, None)
        shapes = layout(leaf.shape[0])
        nblocks, rows = _geometry(leaf.shape[0])
        nfull = leaf.shape[0] >> _SHIFT
        put = object.__setattr__
        put(self, "_leaf", leaf)
        put(self, "_rows", leaf[: nfull * BLOCK].reshape(nfull, BLOCK))
        for attr, name, dtype in (("_sum", "sums", np.float64), ("_pre", "prefix", np.float64),
                                  ("_min", "mins", np.float32), ("_max", "maxs", np.float32)):
            put(self, attr, _plain(name, getattr(self, name), dtype, shapes[name][0]))
        offsets = np.cumsum((0,) + rows[:-1]).tolist()
        put(self, "_levels", tuple(zip(offsets, rows)))
        flat = [a.reshape(-1) for a in (self._sum, self._min, self._max)]
        put(self, "_slot", tuple(tuple(a[o * FANOUT : (o + r) * FANOUT] for a in flat)
                                 for o, r in self._levels))
        put(self, "_top", max(d for d, r in enumerate(rows) if r <= _FLAT_ROWS))
        put(self, "_nblocks", nblocks)
        put(self, "_nfull", nfull)

    @property
    def capacity(self) -> int:
        """Number of leaves (rows)."""
        return int(self._leaf.shape[0])

    @property
    def depth(self) -> int:
        """``D + 1``: levels of rows above the blocks."""
        return len(self._levels)

    @property
    def arrays(self) -> tuple[Any, ...]:
        """The five arrays as given, in :func:`layout` order (to flush or map them)."""
        return (self.leaves, self.sums, self.prefix, self.mins, self.maxs)


def _plain(name: str, arr: Any, dtype: type, shape: tuple[int, ...] | None) -> Any:
    """Validate one array of a tree and return a plain ndarray view of it."""
    if not isinstance(arr, np.ndarray):
        raise InvalidArgumentError(f"{name}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype != np.dtype(dtype):
        raise InvalidArgumentError(f"{name}: expected dtype {np.dtype(dtype)}, got {arr.dtype}")
    if (arr.ndim != 1) if shape is None else (arr.shape != shape):
        expected = "(capacity,)" if shape is None else str(shape)
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
    for arr, neutral in ((tree._leaf, 0), (tree._sum, 0), (tree._pre, 0), (tree._min, np.inf),
                         (tree._max, 0)):
        arr.fill(neutral)


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


def _running(sums: Float64Array) -> Float64Array:
    """Running sums [k, 17] of slot sums [k, 16]: the one definition of ``prefix`` rows."""
    out = np.zeros((sums.shape[0], FANOUT + 1), np.float64)
    src = sums if sums.flags.writeable else sums.copy()  # torch refuses read-only maps
    out[:, 1:] = torch.cumsum(torch.from_numpy(src), 1).numpy()
    return out


def _block_rows(tree: PriorityTree, blocks: Int64Array) -> Float32Array:
    """Gather the leaves of ``blocks`` (any order, duplicates allowed) as [k, 64]."""
    nfull = tree._nfull
    if nfull == tree._nblocks:
        return tree._rows.take(blocks, axis=0, mode="clip")
    tail = np.zeros(BLOCK, np.float32)
    tail[: tree.capacity - nfull * BLOCK] = tree._leaf[nfull * BLOCK :]
    if nfull == 0:
        return np.tile(tail, (blocks.shape[0], 1))
    rows = tree._rows.take(np.minimum(blocks, nfull - 1), axis=0)
    rows[blocks >= nfull] = tail
    return rows


def _span_rows(tree: PriorityTree, b0: int, b1: int) -> Float32Array:
    """The leaves of the contiguous real blocks ``[b0, b1)`` as [b1 - b0, 64]."""
    if b1 <= tree._nfull:
        return tree._rows[b0:b1]
    return _block_rows(tree, np.arange(b0, b1, dtype=np.int64))


def _run_ends(ids: Int64Array, last: bool) -> npt.NDArray[np.bool_]:
    """Mask of the last (or first) element of each run of equal sorted ``ids``."""
    mask = np.ones(ids.shape[0], dtype=bool)
    np.not_equal(ids[1:], ids[:-1], out=mask[:-1] if last else mask[1:])
    return mask


def _propagate(tree: PriorityTree, kids: Int64Array, low: Int64Array, high: Int64Array) -> None:
    """Recompute the rows above the sorted, unique level-``D`` slots ``kids``.

    ``low`` and ``high`` are the slots among ``kids`` whose min and max changed:
    only their rows' mins and maxs are recomputed, and those stop at the first
    level where none changed (no ancestor's can). Levels of at most
    ``_FLAT_ROWS`` rows are recomputed whole.
    """
    levels, top = tree._levels, tree._top
    dedupe = kids.shape[0] * len(levels) > _LEVELS_AT_ONCE  # else duplicates write equal values
    for d in range(len(levels) - 1, -1, -1):
        o, r = levels[d]
        if d <= top:  # a small level: all its rows
            kids = np.arange(r, dtype=np.int64)
            low, high = (kids if x.shape[0] else x for x in (low, high))
        else:
            kids = kids >> _FSHIFT
            if dedupe:
                kids = kids[_run_ends(kids, last=False)]
            low, high = low >> _FSHIFT, high >> _FSHIFT
        rows = kids + o
        cum = torch.cumsum(torch.from_numpy(tree._sum.take(rows, axis=0)), 1).numpy()
        tree._pre[rows, 1:] = cum  # column 0 is always 0
        if d == 0:
            return
        s, mn, mx = tree._slot[d - 1]
        s[kids] = cum[:, FANOUT - 1]
        if low.shape[0]:
            low = _changed(mn, low, _reduce_rows(np.minimum, tree._min.take(low + o, axis=0)))
        if high.shape[0]:
            high = _changed(mx, high, _reduce_rows(np.maximum, tree._max.take(high + o, axis=0)))


def _reduce_rows(op: np.ufunc, rows: Float32Array) -> Float32Array:
    """``op.reduce`` of each row of [k, 16]. Along rows numpy loops once per
    row; over the transposed copy it is 4x faster at k = 256."""
    return op.reduce(np.ascontiguousarray(rows.T), axis=0)  # type: ignore[no-any-return]


def _changed(slots: Float32Array, ids: Int64Array, new: Float32Array) -> Int64Array:
    """Write ``new`` into ``slots[ids]`` where it differs; return those ids.

    Writing only changes matters for a memory-mapped tree: a store of an
    equal value still dirties the page, which the kernel must write back.
    """
    diff = slots.take(ids) != new
    ids = ids[diff]
    slots[ids] = new[diff]
    return ids


def _blocks_span(tree: PriorityTree, b0: int, b1: int) -> None:
    """Recompute the level-``D`` slots of the real blocks ``[b0, b1)`` from the leaves."""
    s, mn, mx = tree._slot[-1]
    for c in range(b0, b1, _CHUNK_BLOCKS):
        e = min(c + _CHUNK_BLOCKS, b1)
        s[c:e], mn[c:e], mx[c:e] = _block_stats(_span_rows(tree, c, e))


def _upward(tree: PriorityTree, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """``(d, c, e)``: chunks of the local rows of level ``d`` above the level-``D`` slots ``[lo, hi)``."""
    for d in range(len(tree._levels) - 1, -1, -1):
        lo, hi = lo >> _FSHIFT, ((hi - 1) >> _FSHIFT) + 1
        for c in range(lo, hi, _CHUNK_ROWS):
            yield d, c, min(c + _CHUNK_ROWS, hi)


def _row_values(tree: PriorityTree, d: int, c: int, e: int) -> tuple[Float64Array, Float32Array, Float32Array]:
    """Running sums [e - c, 17], mins and maxs of the local rows ``[c, e)`` of level ``d``."""
    o = tree._levels[d][0]
    pre = _running(tree._sum[o + c : o + e])
    return (pre, _reduce_rows(np.minimum, tree._min[o + c : o + e]),
            _reduce_rows(np.maximum, tree._max[o + c : o + e]))


def _levels_span(tree: PriorityTree, lo: int, hi: int) -> None:
    """Recompute every row above the level-``D`` slots ``[lo, hi)``."""
    for d, c, e in _upward(tree, lo, hi):
        pre, mins, maxs = _row_values(tree, d, c, e)
        o = tree._levels[d][0]
        tree._pre[o + c : o + e] = pre
        if d > 0:
            s, mn, mx = tree._slot[d - 1]
            s[c:e], mn[c:e], mx[c:e] = pre[:, FANOUT], mins, maxs


# -- writes ------------------------------------------------------------------


def update(tree: PriorityTree, indices: npt.ArrayLike, values: npt.ArrayLike) -> None:
    """Set ``leaves[indices] = values`` and recompute the touched nodes.

    Batch-first: ``indices`` may have any shape and repeat; a repeated index
    takes the value of its last occurrence in C order (last write wins), as if
    the pairs were applied one by one. Each touched block is recomputed from
    its 64 leaves, then each touched row from its slots, so no rounding
    accumulates (see "Exactness" in the module docstring).

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
    s, mn, mx = tree._slot[-1]
    sums, mins, maxs = _block_stats(_block_rows(tree, blocks))
    s[blocks] = sums
    _propagate(tree, blocks, _changed(mn, blocks, mins), _changed(mx, blocks, maxs))


def set_range(tree: PriorityTree, start: int, stop: int, value: npt.ArrayLike) -> None:
    """Set ``leaves[start:stop] = value`` and recompute the touched nodes.

    For the contiguous rows a ring writes or evicts: O(stop - start) for the
    leaves plus O(touched blocks + 16 D) for the nodes, with slices only. The
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
    _levels_span(tree, b0, b1)


def _check_range(tree: PriorityTree, start: int, stop: int) -> tuple[int, int]:
    if not 0 <= int(start) <= int(stop) <= tree.capacity:
        raise InvalidArgumentError(f"start, stop: expected 0 <= start <= stop <= "
                                   f"{tree.capacity}, got start={start}, stop={stop}")
    return int(start), int(stop)


def _padding(tree: PriorityTree) -> Iterator[tuple[int, int]]:
    """Flat slot ranges ``[lo, hi)`` with nothing under them, level by level."""
    levels = tree._levels
    for d, (o, r) in enumerate(levels):
        used = levels[d + 1][1] if d + 1 < len(levels) else tree._nblocks
        yield o * FANOUT + used, (o + r) * FANOUT


def rebuild(tree: PriorityTree) -> None:
    """Recompute every node from the leaves, in place.

    Streams the leaves in chunks of ``2**22`` rows (bounded RAM) and restores
    the padding slots to their neutral values.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(300)
    >>> tr.leaves[:] = 1.0  # written behind the tree's back
    >>> T.rebuild(tr)
    >>> T.total(tr), T.check(tr)
    (300.0, 0.0)
    """
    for lo, hi in _padding(tree):
        for arr, neutral in ((tree._sum, 0.0), (tree._min, np.inf), (tree._max, 0.0)):
            arr.reshape(-1)[lo:hi] = neutral
    _blocks_span(tree, 0, tree._nblocks)
    _levels_span(tree, 0, tree._nblocks)


# -- reads -------------------------------------------------------------------


def total(tree: PriorityTree) -> float:
    """Sum of all leaves (the root row's total), as a Python float.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(3)
    >>> T.update(tr, [0, 2], [0.25, 0.5])
    >>> T.total(tr), T.min_live(tr), T.max_live(tr)
    (0.75, 0.25, 0.5)
    """
    return float(tree._pre[0, FANOUT])


def min_live(tree: PriorityTree) -> float:
    """Smallest leaf ``> 0``; ``inf`` when no leaf is live (example: :func:`total`)."""
    return float(tree._min[0].min())


def max_live(tree: PriorityTree) -> float:
    """Largest leaf; ``0.0`` when no leaf is live (example: :func:`total`)."""
    return float(tree._max[0].max())


def _descend(tree: PriorityTree, t: Float64Array, guarded: bool) -> Int64Array:
    """Block holding each target (``>= 0``); ``t`` becomes the rest within it.

    First one search over the running sums of all slots of the deepest level
    of at most ``_FLAT_ROWS`` rows (the levels above are skipped); then one
    ``prefix`` row per level: the slot ``j`` with ``prefix[j] <= t <
    prefix[j + 1]`` (the last one when ``t`` reaches the row's total), and
    ``t -= prefix[j]``. Rounding, or a target past the total, can lead into
    a slot of sum 0; the guarded descent takes the nearest nonzero slot
    before, else after, instead.
    """
    k, top = t.shape[0], tree._top
    sums = tree._slot[top][0]
    alive = np.flatnonzero(sums > 0) if guarded else None
    if alive is not None:
        sums = sums[alive]
    cum = np.zeros(sums.shape[0] + 1, np.float64)
    np.cumsum(sums, out=cum[1:])
    at = np.searchsorted(cum, t, "right") - 1  # cum[at] <= t < cum[at + 1]
    np.minimum(at, sums.shape[0] - 1, out=at)
    t -= cum.take(at)
    node = at if alive is None else alive.take(at)
    buf, above = np.empty((k, FANOUT + 1), np.float64), np.empty((k, FANOUT + 1), bool)
    j, at, rest = np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.float64)
    flat, base = buf.reshape(-1), np.arange(0, k * (FANOUT + 1), FANOUT + 1, dtype=np.int64)
    t_col = t[:, None]
    for o, r in tree._levels[top + 1 :]:  # preallocated outputs: a level costs 10 numpy calls
        tree._pre[o : o + r].take(node, axis=0, out=buf, mode="clip")
        np.greater(buf, t_col, out=above)  # column 0 (0.0) is never above t >= 0
        above.argmax(axis=1, out=j)  # first running sum above t; 0 when none is
        j -= 1
        j &= FANOUT - 1  # none above: the last slot
        if guarded:
            np.copyto(j, _nearest(tree._sum[o : o + r].take(node, axis=0) > 0, j))
        np.add(base, j, out=at)
        flat.take(at, out=rest, mode="clip")
        t -= rest
        if guarded:
            np.maximum(t, 0.0, out=t)  # moved right past t: start at the slot's beginning
        node <<= _FSHIFT
        node += j
    return node


def _nearest(live: npt.NDArray[np.bool_], j: Int64Array) -> Int64Array:
    """Per row of ``live`` [k, n]: the last True at or before ``j``, else the first after."""
    pos = np.arange(live.shape[1], dtype=np.int64)
    prev = np.where(live & (pos <= j[:, None]), pos, -1).max(axis=1)
    nxt = np.where(live & (pos >= j[:, None]), pos, live.shape[1] - 1).min(axis=1)
    return np.where(prev >= 0, prev, nxt)  # type: ignore[no-any-return]


def _find(
    tree: PriorityTree, targets: Float64Array, guarded: bool = False
) -> tuple[Int64Array, Float32Array]:
    """Leaf index and leaf value for each of the 1-D float64 ``targets``."""
    t = np.maximum(targets, 0.0)  # a copy; -0.0 and negatives become +0.0
    blocks = _descend(tree, t, guarded)
    astray = blocks >= tree._nblocks  # a padding slot (rounding, t >= total): redone below
    np.minimum(blocks, tree._nblocks - 1, out=blocks)
    rows = _block_rows(tree, blocks)
    cum = torch.cumsum(torch.from_numpy(rows), 1, dtype=torch.float64).numpy()
    below = cum <= t[:, None]
    j = below.argmin(axis=1)  # first prefix sum above t: cum[j-1] <= t < cum[j]
    j[below[:, -1]] = BLOCK
    # The in-block cumsum adds in another order than the block sum the descent
    # used, so t can reach past the block's last prefix sum (j == 64, and a
    # target >= total lands there too). j can also point at a zero leaf (a
    # partial last block, a torn concurrent read). Move such picks to the last
    # nonzero leaf before j, else the first one after it: sampling must never
    # return a row of zero priority.
    flat = rows.reshape(-1)
    base = np.arange(t.shape[0], dtype=np.int64) * BLOCK
    value = flat.take(base + np.minimum(j, BLOCK - 1))
    bad = (j == BLOCK) | (value <= 0) | astray
    if not bad.any():
        return blocks * BLOCK + j, value
    j[bad] = fixed = _nearest(rows[bad] > 0, j[bad])
    value[bad] = flat.take(base[bad] + fixed)
    idx = blocks * BLOCK + j
    empty = (value <= 0) | astray  # a block of zeros: the descent went astray too
    if empty.any() and not guarded:  # rare: redo those targets with the guarded descent
        idx[empty], value[empty] = _find(tree, targets[empty], guarded=True)
    # an all-zero block (only under a torn read) must still give a valid row id
    return np.minimum(idx, tree.capacity - 1), value


def find_prefix(tree: PriorityTree, targets: npt.ArrayLike) -> Int64Array:
    """Leaf holding each target mass: the inverse of the cumulative sum.

    For a target ``t`` in ``[0, total)`` the result is the ``i`` with
    ``cumsum(leaves)[i - 1] <= t < cumsum(leaves)[i]``, found by descending
    the tree (a loop over its levels) and then a float64 cumsum inside the
    block. The result is never a leaf of priority 0: rounding that would land
    on a zero leaf or past the block is moved to the nearest nonzero leaf of
    that block, ``t < 0`` gives the first nonzero leaf and ``t >= total`` the
    last.

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
    if not total(tree) > 0:
        raise EmptyBufferError("find_prefix: expected a tree with total > 0, got total 0")
    idx, _ = _find(tree, t.reshape(-1))
    return idx.reshape(t.shape)


# -- range queries -----------------------------------------------------------
#
# A range [a, b) of leaves is cut into at most 2 D + 4 *pieces*, each a run of
# consecutive slots of one row (or leaves of one block), in leaf order:
#
#   column 0            leaves [a, ...) of a's block
#   columns 1 .. D+1    left pieces on levels D, D-1, ..., 0 (the meeting row's run too)
#   columns D+2 .. 2D+2 right pieces on levels 0, 1, ..., D
#   column 2D+3         leaves [..., b) of b's block
#
# A piece's mass is the sum of its (at most 64) non-negative values, never the
# difference of two running sums: a range holding 1e-9 of priority next to
# rows holding 1e8 keeps its mass to float64 precision.


@dataclass(frozen=True, slots=True)
class _Pieces:
    node: Int64Array  # [k, P]: block (columns 0 and P-1) or row of the column's level
    lo: Int64Array  # [k, P]: first slot (leaf) of the piece in its row (block)
    hi: Int64Array  # [k, P]: one past its last; hi <= lo for an absent piece
    mass: Float64Array  # [k, P]


def _piece_level(tree: PriorityTree, col: int) -> int:
    """Level of column ``col`` of :class:`_Pieces` (-1 for the two leaf columns)."""
    depth = len(tree._levels)
    if col == 0 or col == 2 * depth + 1:
        return -1
    return depth - col if col <= depth else col - depth - 1


def _masked(values: Float64Array, lo: Int64Array, hi: Int64Array) -> Float64Array:
    """``values`` [k, n] with the entries outside ``[lo, hi)`` of each row set to 0."""
    pos = np.arange(values.shape[1], dtype=np.int64)
    inside = (pos >= lo[:, None]) & (pos < hi[:, None])
    return np.where(inside, values, 0.0)


def _level_rows(tree: PriorityTree, d: int, rows: Int64Array) -> Float64Array:
    """Slot sums [k, 16] of the local rows ``rows`` of level ``d``."""
    o, r = tree._levels[d]
    return tree._sum[o : o + r].take(rows, axis=0, mode="clip")


def _run_sums(flat: npt.NDArray[Any], start: Int64Array, length: Int64Array) -> Float64Array:
    """Float64 sums of ``flat[start : start + length]`` (``length >= 0``), added in order:
    one gather of exactly the values needed and one ``reduceat``."""
    out = np.zeros(start.shape[0], np.float64)
    use = np.flatnonzero(length > 0)
    if use.shape[0] == 0:
        return out
    n = length[use]
    ends = np.cumsum(n)
    begins = ends - n
    idx = np.arange(int(ends[-1]), dtype=np.int64)
    idx += np.repeat(start[use] - begins, n)
    out[use] = np.add.reduceat(flat.take(idx), begins, dtype=np.float64)
    return out


_Run = tuple[int, Int64Array, Int64Array, Int64Array, Any, int]


def _runs(tree: PriorityTree, a: Int64Array, b: Int64Array) -> Iterator[_Run]:
    """The pieces of the ranges ``[a, b)`` (``0 <= a < b <= capacity``), a column at a time:
    ``(column, node, lo, hi, flat values, log2 of their row length)``."""
    depth = len(tree._levels)
    first, last = a >> _SHIFT, (b - 1) >> _SHIFT
    same = first == last
    head_hi = np.where(same, b - (first << _SHIFT), BLOCK)
    yield 0, first, a - (first << _SHIFT), head_hi, tree._leaf, _SHIFT
    zero = np.zeros_like(a)
    yield 2 * depth + 1, last, zero, np.where(same, 0, b - (last << _SHIFT)), tree._leaf, _SHIFT
    x, y = np.where(same, 0, first + 1), np.where(same, 0, last)  # whole blocks [x, y)
    for d in range(depth - 1, -1, -1):  # slots [x, y) of level d
        active = x < y
        if not active.any():
            return
        gx, gy = x >> _FSHIFT, (y - 1) >> _FSHIFT
        meet = gx == gy
        more = active & ~meet
        top = ((y - 1) & (FANOUT - 1)) + 1
        flat = tree._slot[d][0]
        lo = np.where(active, x & (FANOUT - 1), 0)
        yield depth - d, gx, lo, np.where(active, np.where(meet, top, FANOUT), 0), flat, _FSHIFT
        yield depth + 1 + d, gy, zero, np.where(more, top, 0), flat, _FSHIFT
        x, y = np.where(more, gx + 1, 0), np.where(more, gy, 0)


def _pieces(tree: PriorityTree, a: Int64Array, b: Int64Array) -> _Pieces:
    """The pieces of the ranges ``[a, b)`` as [k, 2 D + 4] arrays, with their masses."""
    shape = (a.shape[0], 2 * len(tree._levels) + 2)
    node, lo, hi = (np.zeros(shape, np.int64) for _ in range(3))
    mass = np.zeros(shape, np.float64)
    for col, at, first, stop, flat, shift in _runs(tree, a, b):
        node[:, col], lo[:, col], hi[:, col] = at, first, stop
        mass[:, col] = _run_sums(flat, (at << shift) + first, stop - first)
    return _Pieces(node, lo, hi, mass)


def _check_ranges(
    tree: PriorityTree, starts: npt.ArrayLike, stops: npt.ArrayLike
) -> tuple[Int64Array, Int64Array]:
    a = np.asarray(starts)
    b = np.asarray(stops)
    for name, arr in (("starts", a), ("stops", b)):
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidArgumentError(f"{name}: expected integers, got dtype {arr.dtype}")
    if a.shape != b.shape:
        raise InvalidArgumentError(f"stops: expected the shape of starts {a.shape}, got {b.shape}")
    a, b = a.astype(np.int64).reshape(-1), b.astype(np.int64).reshape(-1)
    bad = (a < 0) | (a > b) | (b > tree.capacity)
    if bad.any():
        i = int(np.argmax(bad))
        raise InvalidArgumentError(
            f"starts, stops: expected 0 <= start <= stop <= {tree.capacity}, "
            f"got start={int(a[i])}, stop={int(b[i])}"
        )
    return a, b


def range_sums(tree: PriorityTree, starts: npt.ArrayLike, stops: npt.ArrayLike) -> Float64Array:
    """Sum of ``leaves[start:stop]`` for each pair, in float64.

    O(k (64 + 32 D)) in a fixed number of numpy calls per level: each range
    is cut into at most ``2 D + 4`` runs of slots (one row, or leaves of one
    block) whose non-negative values are added; never a difference of
    running sums, so a range of tiny mass next to rows of huge mass keeps a
    relative error of a few float64 ulps times the depth.

    Parameters
    ----------
    starts, stops : array_like of int
        Same shape; ``0 <= start <= stop <= capacity``. An empty range sums to 0.

    Returns
    -------
    numpy.ndarray of float64, the shape of ``starts``.

    Raises
    ------
    InvalidArgumentError
        A range outside ``[0, capacity]``, non-integer ids or unequal shapes.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(5000)
    >>> T.update(tr, [3, 70, 4000, 4999], [1.0, 2.0, 4.0, 8.0])
    >>> T.range_sums(tr, [0, 4, 71, 0, 10], [4, 4000, 4999, 5000, 10]).tolist()
    [1.0, 2.0, 4.0, 15.0, 0.0]
    """
    shape = np.shape(starts)
    a, b = _check_ranges(tree, starts, stops)
    out = np.zeros(a.shape[0], np.float64)
    use = np.flatnonzero(b > a)
    if use.shape[0]:
        for _, node, lo, hi, flat, shift in _runs(tree, a[use], b[use]):
            out[use] += _run_sums(flat, (node << shift) + lo, hi - lo)
    return out.reshape(shape)


def _pick(values: Float64Array, t: Float64Array) -> tuple[Int64Array, Float64Array]:
    """Per row of ``values`` [k, n] (>= 0): the entry where the running sum passes
    ``t`` (``cum[j - 1] <= t < cum[j]``, so a positive one), else the last
    positive entry (rounding put ``t`` at or past the row's sum); and ``t``
    minus the sum before it, clipped to ``[0, values[j])``."""
    cum = np.cumsum(values, axis=1)
    above = cum > t[:, None]
    j = above.argmax(axis=1)
    none = ~above[np.arange(values.shape[0]), j]
    if none.any():
        pos = np.arange(values.shape[1], dtype=np.int64)
        j[none] = np.where(values[none] > 0, pos, 0).max(axis=1)
    rows = np.arange(values.shape[0])
    before = cum[rows, j] - values[rows, j]
    rest = np.clip(t - before, 0.0, np.nextafter(values[rows, j], 0.0))
    return j, rest


def find_in_ranges(
    tree: PriorityTree, starts: npt.ArrayLike, stops: npt.ArrayLike, targets: npt.ArrayLike
) -> tuple[Int64Array, Float32Array]:
    """Leaf of each range holding the target mass counted from the range's start.

    For ``start <= i < stop`` and ``t`` in ``[0, range_sums(start, stop))``:
    the ``i`` with ``sum(leaves[start:i]) <= t < sum(leaves[start:i + 1])``,
    found on the pieces of :func:`range_sums` (the run that holds ``t``, its
    slot, then a descent inside that slot's subtree, then the block's
    leaves) so that ``t`` never meets the mass before ``start``: drawing
    ``t`` uniformly in the range's mass picks ``i`` with probability
    ``leaves[i] / range_sums(start, stop)`` to float64 precision, however
    small that mass is against the rows around it. The result is always in
    ``[start, stop)`` and, when the range holds a positive leaf, never a
    zero leaf: a target at or past the range's mass (rounding) gives the
    last positive leaf. Cost: that of :func:`range_sums` plus ``16 D + 64``
    per range.

    Parameters
    ----------
    starts, stops : array_like of int
        Same shape; ``0 <= start < stop <= capacity``.
    targets : array_like of float
        Same shape; negative targets count as 0.

    Returns
    -------
    indices : numpy.ndarray of int64
    values : numpy.ndarray of float32
        ``leaves[indices]``; 0 only for a range without a positive leaf.

    Raises
    ------
    InvalidArgumentError
        An empty range or one outside ``[0, capacity]``, or unequal shapes.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(5000)
    >>> T.update(tr, [3, 70, 4000, 4999], [1.0, 2.0, 4.0, 8.0])
    >>> idx, val = T.find_in_ranges(tr, [0, 4, 4, 4], [5000, 5000, 4999, 4000], [0.5, 0.0, 5.9, 9.0])
    >>> idx.tolist(), val.tolist()
    ([3, 70, 4000, 70], [1.0, 2.0, 4.0, 2.0])
    """
    shape = np.shape(starts)
    a, b = _check_ranges(tree, starts, stops)
    t = np.maximum(np.asarray(targets, dtype=np.float64).reshape(-1), 0.0)
    if t.shape != a.shape:
        raise InvalidArgumentError(
            f"targets: expected the shape of starts {shape}, got {np.shape(targets)}"
        )
    if (b <= a).any():
        i = int(np.argmax(b <= a))
        raise InvalidArgumentError(
            f"starts, stops: expected start < stop, got start={int(a[i])}, stop={int(b[i])}"
        )
    k, depth = a.shape[0], len(tree._levels)
    if k == 0:
        return np.zeros(shape, np.int64), np.zeros(shape, np.float32)
    pc = _pieces(tree, a, b)
    rows = np.arange(k)
    col, t = _pick(pc.mass, t)  # the piece holding t
    node, plo, phi = pc.node[rows, col], pc.lo[rows, col], pc.hi[rows, col]
    level = np.array([_piece_level(tree, c) for c in range(pc.mass.shape[1])], np.int64)[col]
    # a slot of a level piece: the child (row below, or block) under it
    for d in range(depth):
        at = np.flatnonzero(level == d)
        if at.shape[0]:
            vals = _masked(_level_rows(tree, d, node[at]), plo[at], phi[at])
            j, t[at] = _pick(vals, t[at])
            node[at] = (node[at] << _FSHIFT) + j
    # descend whole subtrees (every leaf under them is inside the range)
    for d in range(1, depth):
        at = np.flatnonzero((level >= 0) & (level < d))
        if at.shape[0]:
            j, t[at] = _pick(_level_rows(tree, d, node[at]), t[at])
            node[at] = (node[at] << _FSHIFT) + j
    whole = level >= 0
    plo[whole], phi[whole] = 0, BLOCK
    leaves = _masked(_block_rows(tree, node).astype(np.float64), plo, phi)
    j, _ = _pick(leaves, t)
    idx = (node << _SHIFT) + j
    value = leaves[rows, j].astype(np.float32)
    stray = (idx < a) | (idx >= b)  # a range without a positive leaf (or a torn read)
    if stray.any():
        idx[stray] = a[stray]
        value[stray] = tree._leaf.take(a[stray])
    return idx.reshape(shape), value.reshape(shape)


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
    mass = total(tree)
    if not mass > 0:
        raise EmptyBufferError(
            "sample: expected a tree with total priority > 0, got total 0 (no live row)"
        )
    n = int(batch_size)
    u = torch.rand(n, generator=generator, dtype=torch.float64).numpy()
    idx, value = _find(tree, (u + np.arange(n, dtype=np.float64)) * (mass / max(n, 1)))
    return idx, value.astype(np.float64) / mass


def check(tree: PriorityTree) -> float:
    """Largest disagreement between the stored nodes and the leaves.

    Recomputes every block from its leaves and every row from its stored
    slots, in chunks (bounded RAM, like :func:`rebuild`). Returns the largest
    relative difference ``|stored - recomputed| / max(|stored|,
    |recomputed|)`` of the sums and running sums; ``inf`` when any min or max
    differs (they are exact), a padding slot is not neutral, or a leaf is NaN,
    infinite or negative. ``0.0`` means the tree is exactly what
    :func:`rebuild` makes.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(100)
    >>> T.update(tr, [1, 50], [1.0, 2.0])
    >>> T.check(tr)
    0.0
    >>> tr.prefix[0, 16] = 3.5  # corrupt the root's total
    >>> T.check(tr)
    0.14285714285714285
    """
    for lo, hi in _padding(tree):
        s, mn, mx = (a.reshape(-1)[lo:hi] for a in (tree._sum, tree._min, tree._max))
        if s.any() or mx.any() or not (mn == np.inf).all():
            return float("inf")
    worst = 0.0
    s, mn, mx = tree._slot[-1]
    for c in range(0, tree._nblocks, _CHUNK_BLOCKS):
        e = min(c + _CHUNK_BLOCKS, tree._nblocks)
        rows = _span_rows(tree, c, e)
        if not ((rows >= 0).all() and np.isfinite(rows).all()):
            return float("inf")
        sums, mins, maxs = _block_stats(rows)
        if not (np.array_equal(mn[c:e], mins) and np.array_equal(mx[c:e], maxs)):
            return float("inf")
        worst = max(worst, _rel(s[c:e], sums))
    for d, c, e in _upward(tree, 0, tree._nblocks):
        pre, mins, maxs = _row_values(tree, d, c, e)
        o = tree._levels[d][0]
        worst = max(worst, _rel(tree._pre[o + c : o + e], pre))
        if d > 0:
            s, mn, mx = tree._slot[d - 1]
            if not (np.array_equal(mn[c:e], mins) and np.array_equal(mx[c:e], maxs)):
                return float("inf")
            worst = max(worst, _rel(s[c:e], pre[:, FANOUT]))
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
