"""Leaves of a priority tree gathered block by block (the range queries' last step)."""

from __future__ import annotations

import numpy as np

from ._layout import BLOCK, Float32Array, Int64Array, PriorityTree


def block_rows(tree: PriorityTree, blocks: Int64Array) -> Float32Array:
    """Gather the leaves of ``blocks`` (any order, duplicates allowed) as [k, 64]; a
    partial last block reads as if padded with zeros."""
    leaf, cap = tree.views.leaf, tree.capacity
    idx = (blocks[:, None] << 6) + np.arange(BLOCK, dtype=np.int64)
    rows = leaf.take(idx, mode="clip")
    if cap % BLOCK:
        rows[idx >= cap] = 0.0
    return rows
