"""Consistency check of a priority tree: :func:`check`."""

from __future__ import annotations

from ._layout import PriorityTree


def check(tree: PriorityTree) -> float:
    """Largest disagreement between the stored nodes and the leaves.

    Recomputes every block from its leaves and every row from its stored
    slots in one compiled pass (no temporaries). Returns the largest relative
    difference ``|stored - recomputed| / max(|stored|, |recomputed|)`` of the
    slot sums; ``inf`` when any min or max differs (they are exact), a padding
    slot is not neutral (zero), or a leaf is NaN, infinite or negative. ``0.0``
    means the tree is exactly what :func:`rebuild` makes.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(100)
    >>> T.update(tr, [1, 50], [1.0, 2.0])
    >>> T.check(tr)
    0.0
    >>> tr.sums[0, 0] = 3.5  # corrupt the first block's sum (3.0)
    >>> T.check(tr)
    0.14285714285714285
    """
    from ..kernels import tree as kernels

    v = tree.views
    return kernels.check(v.leaf, v.nodes, v.offs)
