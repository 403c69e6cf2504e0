"""Reads of a priority tree: totals and extremes, and the descent that inverts the
cumulative sum (:func:`find_prefix`, :func:`sample`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

from ..errors import EmptyBufferError, InvalidArgumentError
from ..kernels import load
from ._layout import Float32Array, Float64Array, Int64Array, PriorityTree


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
    return float(np.cumsum(tree.views.sum[0])[-1])  # the root row's running sum, in slot order


def min_live(tree: PriorityTree) -> float:
    """Smallest leaf ``> 0``; ``inf`` when no leaf is live (example: :func:`total`)."""
    code = int(tree.views.min_code[0].max())
    return float(np.uint32(0x7F800000 - code).view(np.float32)) if code else float("inf")


def max_live(tree: PriorityTree) -> float:
    """Largest leaf; ``0.0`` when no leaf is live (example: :func:`total`)."""
    return float(tree.views.max[0].max())


def _find(tree: PriorityTree, targets: Float64Array) -> tuple[Int64Array, Float32Array]:
    """Leaf index and leaf value for each of the 1-D float64 ``targets`` (compiled descent)."""
    kernels = load("descent")
    v = tree.views
    t = np.ascontiguousarray(targets)
    idx, value, empty = kernels.find(v.leaf, v.nodes, v.offs, t)
    if empty:  # only a read torn by a concurrent write meets an empty row: descend once more
        again = np.flatnonzero(value <= 0)
        idx[again], value[again], _ = kernels.find(v.leaf, v.nodes, v.offs, t[again])
    return idx, value


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
    import torch  # on use: `mmbuffer info`/`verify` never import torch

    n = int(batch_size)
    u = torch.rand(n, generator=generator, dtype=torch.float64).numpy()
    idx, value = _find(tree, (u + np.arange(n, dtype=np.float64)) * (mass / max(n, 1)))
    return idx, value.astype(np.float64) / mass
