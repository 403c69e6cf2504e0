"""Writes to a priority tree: :func:`update`, :func:`set_range` and :func:`rebuild`,
each recomputing the touched blocks and rows (never incrementing by a delta)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgumentError
from ..kernels import load
from ._check import spans_array
from ._layout import SHIFT, PriorityTree


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
    idx = np.ascontiguousarray(idx.reshape(-1))
    val = np.ascontiguousarray(val.reshape(-1))
    if idx.shape[0] == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= tree.capacity:
        raise InvalidArgumentError(
            f"indices: expected row ids in [0, {tree.capacity}), got {lo if lo < 0 else hi}"
        )
    kernels = load("tree")
    v = tree.views
    kernels.update(v.leaf, v.nodes, v.offs, idx, val)


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
    kernels = load("tree")
    v = tree.views
    if val.ndim:
        v.leaf[start:stop] = val
    else:  # writes only the leaves that differ: evicting never-written rows allocates nothing
        kernels.fill(v.leaf, start, stop, val)
    kernels.refresh_span(v.leaf, v.nodes, v.offs, start >> SHIFT, ((stop - 1) >> SHIFT) + 1)


def _check_range(tree: PriorityTree, start: int, stop: int) -> tuple[int, int]:
    if not 0 <= int(start) <= int(stop) <= tree.capacity:
        raise InvalidArgumentError(f"start, stop: expected 0 <= start <= stop <= "
                                   f"{tree.capacity}, got start={start}, stop={stop}")
    return int(start), int(stop)


def rebuild(tree: PriorityTree, *, spans: Sequence[tuple[int, int]] | None = None) -> None:
    """Recompute every node from the leaves, in place.

    One compiled pass over the leaves and rows (no temporaries) that also
    restores the padding slots to their neutral value (zero); it stores only
    the values that differ, so the untouched (zero) regions of a sparse tree
    file stay holes.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(300)
    >>> tr.leaves[:] = 1.0  # written behind the tree's back
    >>> T.rebuild(tr)
    >>> T.total(tr), T.check(tr)
    (300.0, 0.0)
    """
    kernels = load("tree")
    v = tree.views
    kernels.sweep(v.leaf, v.nodes, v.offs, spans_array(tree, spans), write=True)
