"""Writes to a priority tree: :func:`update`, :func:`set_range` and :func:`rebuild`,
each recomputing the touched blocks and rows (never incrementing by a delta)."""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgumentError
from ._layout import FANOUT, FSHIFT, SHIFT, Float32Array, Int64Array, PriorityTree
from ._nodes import (
    block_rows,
    block_stats,
    blocks_span,
    levels_span,
    padding,
    reduce_rows,
)

LEVELS_AT_ONCE: Final = 1 << 14  # update: row ids of all levels at once up to this many


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
    ``FLAT_ROWS`` rows are recomputed whole.
    """
    v = tree.views
    levels, top = v.levels, v.top
    dedupe = kids.shape[0] * len(levels) > LEVELS_AT_ONCE  # else duplicates write equal values
    for d in range(len(levels) - 1, -1, -1):
        o, r = levels[d]
        if d <= top:  # a small level: all its rows
            kids = np.arange(r, dtype=np.int64)
            low, high = (kids if x.shape[0] else x for x in (low, high))
        else:
            kids = kids >> FSHIFT
            if dedupe:
                kids = kids[_run_ends(kids, last=False)]
            low, high = low >> FSHIFT, high >> FSHIFT
        rows = kids + o
        import torch  # on use: `mmbuffer info`/`verify` never import torch

        cum = torch.cumsum(torch.from_numpy(v.sum.take(rows, axis=0)), 1).numpy()
        v.pre[rows, 1:] = cum  # column 0 is always 0
        if d == 0:
            return
        s, mn, mx = v.slot[d - 1]
        s[kids] = cum[:, FANOUT - 1]
        if low.shape[0]:
            low = _changed(mn, low, reduce_rows(np.minimum, v.min.take(low + o, axis=0)))
        if high.shape[0]:
            high = _changed(mx, high, reduce_rows(np.maximum, v.max.take(high + o, axis=0)))


def _changed(slots: Float32Array, ids: Int64Array, new: Float32Array) -> Int64Array:
    """Write ``new`` into ``slots[ids]`` where it differs; return those ids.

    Writing only changes matters for a memory-mapped tree: a store of an
    equal value still dirties the page, which the kernel must write back.
    """
    diff = slots.take(ids) != new
    ids = ids[diff]
    slots[ids] = new[diff]
    return ids


def update(tree: PriorityTree, indices: npt.ArrayLike, values: npt.ArrayLike) -> None:
    """Set ``leaves[indices] = values`` and recompute the touched nodes.

    Batch-first: ``indices`` may have any shape and repeat; a repeated index
    takes the value of its last occurrence in C order (last write wins), as if
    the pairs were applied one by one. Each touched block is recomputed from
    its 64 leaves, then each touched row from its slots, so no rounding
    accumulates (see "Exactness" in :mod:`mmbuffer.tree`).

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
    tree.views.leaf[idx] = val
    blocks = idx >> SHIFT
    blocks = blocks[_run_ends(blocks, last=False)]
    s, mn, mx = tree.views.slot[-1]
    sums, mins, maxs = block_stats(block_rows(tree, blocks))
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
    tree.views.leaf[start:stop] = val
    b0, b1 = start >> SHIFT, ((stop - 1) >> SHIFT) + 1
    blocks_span(tree, b0, b1)
    levels_span(tree, b0, b1)


def _check_range(tree: PriorityTree, start: int, stop: int) -> tuple[int, int]:
    if not 0 <= int(start) <= int(stop) <= tree.capacity:
        raise InvalidArgumentError(f"start, stop: expected 0 <= start <= stop <= "
                                   f"{tree.capacity}, got start={start}, stop={stop}")
    return int(start), int(stop)


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
    for lo, hi in padding(tree):
        for arr, neutral in ((tree.views.sum, 0.0), (tree.views.min, np.inf),
                             (tree.views.max, 0.0)):
            arr.reshape(-1)[lo:hi] = neutral
    blocks_span(tree, 0, tree.views.nblocks)
    levels_span(tree, 0, tree.views.nblocks)
