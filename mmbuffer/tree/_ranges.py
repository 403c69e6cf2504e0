"""Range queries on a priority tree: :func:`range_sums` and :func:`find_in_ranges`.

A range [a, b) of leaves is cut into at most 2 D + 4 *pieces*, each a run of
consecutive slots of one row (or leaves of one block), in leaf order::

    column 0            leaves [a, ...) of a's block
    columns 1 .. D+1    left pieces on levels D, D-1, ..., 0 (the meeting row's run too)
    columns D+2 .. 2D+2 right pieces on levels 0, 1, ..., D
    column 2D+3         leaves [..., b) of b's block

A piece's mass is the sum of its (at most 64) non-negative values, never the
difference of two running sums: a range holding 1e-9 of priority next to
rows holding 1e8 keeps its mass to float64 precision.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgumentError
from ._layout import BLOCK, FANOUT, FSHIFT, SHIFT, Float32Array, Float64Array, Int64Array, PriorityTree
from ._nodes import block_rows


@dataclass(frozen=True, slots=True)
class _Pieces:
    node: Int64Array  # [k, P]: block (columns 0 and P-1) or row of the column's level
    lo: Int64Array  # [k, P]: first slot (leaf) of the piece in its row (block)
    hi: Int64Array  # [k, P]: one past its last; hi <= lo for an absent piece
    mass: Float64Array  # [k, P]


def _piece_level(tree: PriorityTree, col: int) -> int:
    """Level of column ``col`` of :class:`_Pieces` (-1 for the two leaf columns)."""
    depth = len(tree.views.levels)
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
    o, r = tree.views.levels[d]
    return tree.views.sum[o : o + r].take(rows, axis=0, mode="clip")


def _run_sums(flat: npt.NDArray[Any], start: Int64Array, length: Int64Array) -> Float64Array:
    """Float64 sums of ``flat[start : start + length]`` (``length >= 0``; a 2-D ``flat``
    of rows of 16 slots counts them in C order), added in order:
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
    vals = flat.take(idx) if flat.ndim == 1 else flat[idx >> FSHIFT, idx & (FANOUT - 1)]
    out[use] = np.add.reduceat(vals, begins, dtype=np.float64)
    return out


_Run = tuple[int, Int64Array, Int64Array, Int64Array, Any, int]


def _runs(tree: PriorityTree, a: Int64Array, b: Int64Array) -> Iterator[_Run]:
    """The pieces of the ranges ``[a, b)`` (``0 <= a < b <= capacity``), a column at a time:
    ``(column, node, lo, hi, flat values, log2 of their row length)``."""
    depth = len(tree.views.levels)
    first, last = a >> SHIFT, (b - 1) >> SHIFT
    same = first == last
    head_hi = np.where(same, b - (first << SHIFT), BLOCK)
    yield 0, first, a - (first << SHIFT), head_hi, tree.views.leaf, SHIFT
    zero = np.zeros_like(a)
    yield 2 * depth + 1, last, zero, np.where(same, 0, b - (last << SHIFT)), tree.views.leaf, SHIFT
    x, y = np.where(same, 0, first + 1), np.where(same, 0, last)  # whole blocks [x, y)
    for d in range(depth - 1, -1, -1):  # slots [x, y) of level d
        active = x < y
        if not active.any():
            return
        gx, gy = x >> FSHIFT, (y - 1) >> FSHIFT
        meet = gx == gy
        more = active & ~meet
        top = ((y - 1) & (FANOUT - 1)) + 1
        o, r = tree.views.levels[d]
        flat = tree.views.sum[o : o + r]  # [r, 16]: slot i of the level is [i >> 4, i & 15]
        lo = np.where(active, x & (FANOUT - 1), 0)
        yield depth - d, gx, lo, np.where(active, np.where(meet, top, FANOUT), 0), flat, FSHIFT
        yield depth + 1 + d, gy, zero, np.where(more, top, 0), flat, FSHIFT
        x, y = np.where(more, gx + 1, 0), np.where(more, gy, 0)


def _pieces(tree: PriorityTree, a: Int64Array, b: Int64Array) -> _Pieces:
    """The pieces of the ranges ``[a, b)`` as [k, 2 D + 4] arrays, with their masses."""
    shape = (a.shape[0], 2 * len(tree.views.levels) + 2)
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
    k, depth = a.shape[0], len(tree.views.levels)
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
            node[at] = (node[at] << FSHIFT) + j
    # descend whole subtrees (every leaf under them is inside the range)
    for d in range(1, depth):
        at = np.flatnonzero((level >= 0) & (level < d))
        if at.shape[0]:
            j, t[at] = _pick(_level_rows(tree, d, node[at]), t[at])
            node[at] = (node[at] << FSHIFT) + j
    whole = level >= 0
    plo[whole], phi[whole] = 0, BLOCK
    leaves = _masked(block_rows(tree, node).astype(np.float64), plo, phi)
    j, _ = _pick(leaves, t)
    idx = (node << SHIFT) + j
    value = leaves[rows, j].astype(np.float32)
    stray = (idx < a) | (idx >= b)  # a range without a positive leaf (or a torn read)
    if stray.any():
        idx[stray] = a[stray]
        value[stray] = tree.views.leaf.take(a[stray])
    return idx.reshape(shape), value.reshape(shape)
