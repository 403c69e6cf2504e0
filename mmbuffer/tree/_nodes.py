"""Node values of a priority tree computed from its leaves and slots.

The one definition of a block's sum, min and max and of a row's running sums,
and the sweeps that recompute or re-read contiguous spans of blocks and rows
in chunks (bounded RAM); shared by the writes and :func:`~mmbuffer.tree.check`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

import numpy as np

from ._layout import (
    BLOCK,
    FANOUT,
    FSHIFT,
    Float32Array,
    Float64Array,
    Int64Array,
    PriorityTree,
)

CHUNK_BLOCKS: Final = 1 << 16  # blocks per chunk in rebuild/check/set_range: 4M leaves
CHUNK_ROWS: Final = 1 << 16  # tree rows per chunk when sweeping a level
_INF_BITS: Final = np.float32(np.inf).view(np.uint32)

Stats = tuple[Float64Array, Float32Array, Float32Array]


def block_stats(rows: Float32Array) -> Stats:
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


def running(sums: Float64Array) -> Float64Array:
    """Running sums [k, 17] of slot sums [k, 16]: the one definition of ``prefix`` rows."""
    out = np.zeros((sums.shape[0], FANOUT + 1), np.float64)
    src = sums if sums.flags.writeable else sums.copy()  # torch refuses read-only maps
    import torch  # on use: `mmbuffer info`/`verify` never import torch

    out[:, 1:] = torch.cumsum(torch.from_numpy(src), 1).numpy()
    return out


def block_rows(tree: PriorityTree, blocks: Int64Array) -> Float32Array:
    """Gather the leaves of ``blocks`` (any order, duplicates allowed) as [k, 64]."""
    nfull = tree.views.nfull
    if nfull == tree.views.nblocks:
        return tree.views.full.take(blocks, axis=0, mode="clip")
    tail = np.zeros(BLOCK, np.float32)
    tail[: tree.capacity - nfull * BLOCK] = tree.views.leaf[nfull * BLOCK :]
    if nfull == 0:
        return np.tile(tail, (blocks.shape[0], 1))
    rows = tree.views.full.take(np.minimum(blocks, nfull - 1), axis=0)
    rows[blocks >= nfull] = tail
    return rows


def span_rows(tree: PriorityTree, b0: int, b1: int) -> Float32Array:
    """The leaves of the contiguous real blocks ``[b0, b1)`` as [b1 - b0, 64]."""
    if b1 <= tree.views.nfull:
        return tree.views.full[b0:b1]
    return block_rows(tree, np.arange(b0, b1, dtype=np.int64))


def reduce_rows(op: np.ufunc, rows: Float32Array) -> Float32Array:
    """``op.reduce`` of each row of [k, 16]. Along rows numpy loops once per
    row; over the transposed copy it is 4x faster at k = 256."""
    return op.reduce(np.ascontiguousarray(rows.T), axis=0)  # type: ignore[no-any-return]


def block_chunks(b0: int, b1: int) -> Iterator[tuple[int, int]]:
    """Chunks ``[c, e)`` of at most ``CHUNK_BLOCKS`` blocks, in order, covering ``[b0, b1)``."""
    for c in range(b0, b1, CHUNK_BLOCKS):
        yield c, min(c + CHUNK_BLOCKS, b1)


def blocks_span(tree: PriorityTree, b0: int, b1: int) -> None:
    """Recompute the level-``D`` slots of the real blocks ``[b0, b1)`` from the leaves."""
    s, mn, mx = tree.views.slot[-1]
    for c, e in block_chunks(b0, b1):
        s[c:e], mn[c:e], mx[c:e] = block_stats(span_rows(tree, c, e))


def upward(tree: PriorityTree, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """``(d, c, e)``: chunks of the local rows of level ``d`` above the level-``D`` slots ``[lo, hi)``."""
    for d in range(len(tree.views.levels) - 1, -1, -1):
        lo, hi = lo >> FSHIFT, ((hi - 1) >> FSHIFT) + 1
        for c in range(lo, hi, CHUNK_ROWS):
            yield d, c, min(c + CHUNK_ROWS, hi)


def row_values(tree: PriorityTree, d: int, c: int, e: int) -> Stats:
    """Running sums [e - c, 17], mins and maxs of the local rows ``[c, e)`` of level ``d``."""
    o = tree.views.levels[d][0]
    pre = running(tree.views.sum[o + c : o + e])
    return (pre, reduce_rows(np.minimum, tree.views.min[o + c : o + e]),
            reduce_rows(np.maximum, tree.views.max[o + c : o + e]))


def levels_span(tree: PriorityTree, lo: int, hi: int) -> None:
    """Recompute every row above the level-``D`` slots ``[lo, hi)``."""
    for d, c, e in upward(tree, lo, hi):
        pre, mins, maxs = row_values(tree, d, c, e)
        o = tree.views.levels[d][0]
        tree.views.pre[o + c : o + e] = pre
        if d > 0:
            s, mn, mx = tree.views.slot[d - 1]
            s[c:e], mn[c:e], mx[c:e] = pre[:, FANOUT], mins, maxs


def padding(tree: PriorityTree) -> Iterator[tuple[int, int]]:
    """Flat slot ranges ``[lo, hi)`` with nothing under them, level by level."""
    levels = tree.views.levels
    for d, (o, r) in enumerate(levels):
        used = levels[d + 1][1] if d + 1 < len(levels) else tree.views.nblocks
        yield o * FANOUT + used, (o + r) * FANOUT
