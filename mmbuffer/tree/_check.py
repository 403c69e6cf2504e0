"""Consistency check of a priority tree: :func:`check`."""

from __future__ import annotations

import numpy as np

from ._layout import FANOUT, Float64Array, PriorityTree
from ._nodes import block_chunks, block_stats, padding, row_values, span_rows, upward


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
    for lo, hi in padding(tree):
        s, mn, mx = (a.reshape(-1)[lo:hi] for a in (tree.views.sum, tree.views.min, tree.views.max))
        if s.any() or mx.any() or not (mn == np.inf).all():
            return float("inf")
    worst = 0.0
    s, mn, mx = tree.views.slot[-1]
    for c, e in block_chunks(0, tree.views.nblocks):
        rows = span_rows(tree, c, e)
        if not ((rows >= 0).all() and np.isfinite(rows).all()):
            return float("inf")
        sums, mins, maxs = block_stats(rows)
        if not (np.array_equal(mn[c:e], mins) and np.array_equal(mx[c:e], maxs)):
            return float("inf")
        worst = max(worst, _rel(s[c:e], sums))
    for d, c, e in upward(tree, 0, tree.views.nblocks):
        pre, mins, maxs = row_values(tree, d, c, e)
        o = tree.views.levels[d][0]
        worst = max(worst, _rel(tree.views.pre[o + c : o + e], pre))
        if d > 0:
            s, mn, mx = tree.views.slot[d - 1]
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
