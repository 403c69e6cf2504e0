"""Consistency check of a priority tree: :func:`check`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InvalidArgumentError
from ..kernels import load
from ._layout import Int64Array, PriorityTree


def spans_array(tree: PriorityTree, spans: Sequence[tuple[int, int]] | None) -> Int64Array:
    """``spans`` as int64 [k, 2], checked (``None``: every leaf)."""
    if spans is None:
        return np.array([[0, tree.capacity]], np.int64)
    out = np.array(list(spans), np.int64).reshape(-1, 2)
    bad = (out[:, 0] < 0) | (out[:, 0] > out[:, 1]) | (out[:, 1] > tree.capacity)
    if bad.any():
        a, b = out[int(np.argmax(bad))].tolist()
        raise InvalidArgumentError(
            f"spans: expected 0 <= start <= stop <= {tree.capacity}, got ({a}, {b})"
        )
    return out


def check(tree: PriorityTree, *, spans: Sequence[tuple[int, int]] | None = None) -> float:
    """Largest disagreement between the stored nodes and the leaves.

    Recomputes every block from its leaves and every row from its stored
    slots in one compiled pass (no temporaries). ``spans``, a sequence of leaf
    ranges ``(start, stop)``, limits that to the blocks and rows above them,
    O(the spans' rows): the caller promises that every leaf outside them is 0
    (rows a store never wrote), and every slot with no span under it must then
    be empty; ``None`` (the default) checks every leaf. Returns the largest relative
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
    >>> tr = T.init(1000)
    >>> T.update(tr, [1, 900], [1.0, 2.0])
    >>> T.check(tr, spans=[(0, 10), (850, 950)]), T.check(tr, spans=[(0, 10)])  # row 900 outside
    (0.0, inf)
    """
    v = tree.views
    worst: float = load("tree").sweep(v.leaf, v.nodes, v.offs, spans_array(tree, spans), write=False)
    return worst
