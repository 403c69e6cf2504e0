"""Which pages of a tree's two arrays a write of some blocks can change: what a
writer that keeps its tree changes private between commits (``_ledger/touched.py``)
writes to the file at a commit.

A write of a block's leaves stores into those leaves and, at each level, into the
node row above the block (see :mod:`mmbuffer.tree`); a page is ``PAGE`` bytes of an
array, counted from its first byte.

>>> from mmbuffer import tree as T
>>> import numpy as np
>>> from mmbuffer.tree._pages import pages
>>> tr = T.init(100_000)  # 1,563 blocks; node rows 1 + 7 + 98
>>> leaves, nodes = pages(tr, np.array([0, 1000]), [(1500, 1563)])
>>> leaves.tolist(), nodes.tolist()
([0, 62, 93, 94, 95, 96, 97], [0, 4, 6])
"""

from __future__ import annotations

import mmap

import numpy as np

from ._layout import FSHIFT, PriorityTree

PAGE = mmap.PAGESIZE


def pages(tree: PriorityTree, blocks: np.ndarray, ranges: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique page numbers of ``leaves`` and of ``nodes`` that a write of the
    ``blocks`` (block ids) and of the block ranges ``[lo, hi)`` in ``ranges`` may
    store into. Vectorized: O(blocks + pages of the ranges)."""
    views = tree.views
    leaf_bytes, row_bytes = tree.views.leaf.itemsize << 6, views.nodes.strides[0]  # a block's leaves, a node row
    blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)
    leaf, node = [blocks * leaf_bytes // PAGE], []
    depth = len(views.levels)
    for d, (offset, _) in enumerate(views.levels):
        shift = FSHIFT * (depth - d)  # blocks per slot of a row of level d
        node.append((offset + (blocks >> shift)) * row_bytes // PAGE)
    for lo, hi in ranges:
        if hi <= lo:
            continue
        leaf.append(np.arange(lo * leaf_bytes // PAGE, ((hi * leaf_bytes - 1) // PAGE) + 1, dtype=np.int64))
        for d, (offset, _) in enumerate(views.levels):
            shift = FSHIFT * (depth - d)
            a, b = offset + (lo >> shift), offset + ((hi - 1) >> shift) + 1
            node.append(np.arange(a * row_bytes // PAGE, ((b * row_bytes - 1) // PAGE) + 1, dtype=np.int64))
    return np.unique(np.concatenate(leaf)), np.unique(np.concatenate(node) if node else np.zeros(0, np.int64))
