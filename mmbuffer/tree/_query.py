"""Reads of a priority tree: totals and extremes, and the descent that inverts the
cumulative sum (:func:`find_prefix`, :func:`sample`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..errors import EmptyBufferError, InvalidArgumentError
from ._layout import (
    BLOCK,
    FANOUT,
    FSHIFT,
    Float32Array,
    Float64Array,
    Int64Array,
    PriorityTree,
)
from ._nodes import block_rows

if TYPE_CHECKING:
    import torch


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
    return float(tree.views.pre[0, FANOUT])


def min_live(tree: PriorityTree) -> float:
    """Smallest leaf ``> 0``; ``inf`` when no leaf is live (example: :func:`total`)."""
    return float(tree.views.min[0].min())


def max_live(tree: PriorityTree) -> float:
    """Largest leaf; ``0.0`` when no leaf is live (example: :func:`total`)."""
    return float(tree.views.max[0].max())


def _descend(tree: PriorityTree, t: Float64Array, guarded: bool) -> Int64Array:
    """Block holding each target (``>= 0``); ``t`` becomes the rest within it.

    First one search over the running sums of all slots of the deepest level
    of at most ``FLAT_ROWS`` rows (the levels above are skipped); then one
    ``prefix`` row per level: the slot ``j`` with ``prefix[j] <= t <
    prefix[j + 1]`` (the last one when ``t`` reaches the row's total), and
    ``t -= prefix[j]``. Rounding, or a target past the total, can lead into
    a slot of sum 0; the guarded descent takes the nearest nonzero slot
    before, else after, instead.
    """
    k, top = t.shape[0], tree.views.top
    sums = tree.views.slot[top][0]
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
    for o, r in tree.views.levels[top + 1 :]:  # preallocated outputs: a level costs 10 numpy calls
        tree.views.pre[o : o + r].take(node, axis=0, out=buf, mode="clip")
        np.greater(buf, t_col, out=above)  # column 0 (0.0) is never above t >= 0
        above.argmax(axis=1, out=j)  # first running sum above t; 0 when none is
        j -= 1
        j &= FANOUT - 1  # none above: the last slot
        if guarded:
            np.copyto(j, _nearest(tree.views.sum[o : o + r].take(node, axis=0) > 0, j))
        np.add(base, j, out=at)
        flat.take(at, out=rest, mode="clip")
        t -= rest
        if guarded:
            np.maximum(t, 0.0, out=t)  # moved right past t: start at the slot's beginning
        node <<= FSHIFT
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
    astray = blocks >= tree.views.nblocks  # a padding slot (rounding, t >= total): redone below
    np.minimum(blocks, tree.views.nblocks - 1, out=blocks)
    rows = block_rows(tree, blocks)
    import torch  # on use: `mmbuffer info`/`verify` never import torch

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
    import torch  # on use: `mmbuffer info`/`verify` never import torch

    u = torch.rand(n, generator=generator, dtype=torch.float64).numpy()
    idx, value = _find(tree, (u + np.arange(n, dtype=np.float64)) * (mass / max(n, 1)))
    return idx, value.astype(np.float64) / mass
