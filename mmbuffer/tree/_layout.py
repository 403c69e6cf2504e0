"""Geometry and state of a priority tree: shapes of the five arrays, the frozen
:class:`PriorityTree` over them, and a fresh or reset tree.

The layout is specified in the docstring of :mod:`mmbuffer.tree`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgumentError

BLOCK: Final = 64
"""Leaves per block (the leaf level of the tree)."""
FANOUT: Final = 16
"""Slots per row of the tree above the blocks."""

SHIFT: Final = 6  # log2(BLOCK)
FSHIFT: Final = 4  # log2(FANOUT)
NODE_WORDS: Final = 32  # float64 words per node row: 16 sums, 16 uint32 min codes, 16 float32 maxs

Float32Array = npt.NDArray[np.float32]
Float64Array = npt.NDArray[np.float64]
Int64Array = npt.NDArray[np.int64]


def geometry(capacity: int) -> tuple[int, tuple[int, ...]]:
    """Return ``(nblocks, (r_0, ..., r_D))`` for ``capacity`` rows."""
    if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity < 1:
        raise InvalidArgumentError(f"capacity: expected an int >= 1, got {capacity!r}")
    nblocks = (int(capacity) + BLOCK - 1) >> SHIFT
    rows = [(nblocks + FANOUT - 1) >> FSHIFT]
    while rows[-1] > 1:
        rows.append((rows[-1] + FANOUT - 1) >> FSHIFT)
    return nblocks, tuple(reversed(rows))


def layout(capacity: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shapes and dtypes of the two arrays of a tree over ``capacity`` rows.

    Returns ``name -> (shape, dtype)`` for ``leaves`` and ``nodes``, the keyword
    arguments of :class:`PriorityTree`. ``capacity`` may be any size (row ids are
    int64); :class:`InvalidArgumentError` unless it is a positive integer.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> for name, (shape, dtype) in T.layout(5000).items():
    ...     print(name, shape, dtype)
    leaves (5000,) float32
    nodes (6, 32) float64
    """
    _, rows = geometry(capacity)
    return {"leaves": ((int(capacity),), "float32"), "nodes": ((sum(rows), NODE_WORDS), "float64")}


def nbytes(capacity: int) -> int:
    """Total bytes of the two arrays: ``4 * capacity + 256 * R``.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> round(T.nbytes(600_000_000) / 600_000_000, 4)
    4.2667
    """
    _, rows = geometry(capacity)
    return 4 * int(capacity) + 8 * NODE_WORDS * sum(rows)


@dataclass(frozen=True, slots=True, eq=False)
class Views:
    """Plain ndarray views of a tree's arrays, and its geometry: what the
    functions of :mod:`mmbuffer.tree` compute on (built by :class:`PriorityTree`)."""

    leaf: Float32Array
    nodes: Float64Array  # [R, 32]
    sum: Float64Array  # [R, 16] view: the slot sums
    min_code: npt.NDArray[np.uint32]  # [R, 16] view
    max: Float32Array  # [R, 16] view
    offs: Int64Array  # [depth + 1]: level d is the rows [offs[d], offs[d + 1])
    levels: tuple[tuple[int, int], ...]  # (o_d, r_d)
    nblocks: int


@dataclass(frozen=True, slots=True, eq=False)
class PriorityTree:
    """The two arrays of a priority tree (see :mod:`mmbuffer.tree`).

    Frozen, but the arrays are mutated in place by :func:`update`,
    :func:`set_range`, :func:`reset` and :func:`rebuild`. They are C-contiguous
    arrays of the shapes and dtypes :func:`layout` gives (else
    :class:`InvalidArgumentError`), possibly ``numpy.memmap`` objects: the
    fields keep them (for ``flush``), the functions compute on plain ndarray
    views of them (``views``, a :class:`Views`). ``PriorityTree(**arrays)``
    takes a mapping keyed like :func:`layout`; all-zero arrays are an empty tree.

    Examples
    --------
    >>> import numpy as np
    >>> from mmbuffer import tree as T
    >>> tr = T.PriorityTree(**{k: np.zeros(s, d) for k, (s, d) in T.layout(10).items()})
    >>> tr.capacity, tr.depth, len(tr.arrays), T.min_live(tr)
    (10, 1, 2, inf)
    >>> T.update(tr, [4], [2.5])
    >>> tr.sums[0, :2].tolist(), tr.mins[0, :2].tolist(), tr.maxs[0, :2].tolist()
    ([2.5, 0.0], [2.5, inf], [2.5, 0.0])
    """

    leaves: Float32Array
    nodes: Float64Array
    views: Views = field(init=False, repr=False)

    def __post_init__(self) -> None:
        leaf = _plain("leaves", self.leaves, np.float32, None)
        shapes = layout(leaf.shape[0])
        nblocks, rows = geometry(leaf.shape[0])
        nodes = _plain("nodes", self.nodes, np.float64, shapes["nodes"][0])
        offsets = np.cumsum((0,) + rows).tolist()
        levels = tuple(zip(offsets[:-1], rows))
        views = Views(leaf, nodes, nodes[:, :FANOUT], nodes.view(np.uint32)[:, 2 * FANOUT : 3 * FANOUT],
                      nodes.view(np.float32)[:, 3 * FANOUT :], np.array(offsets, np.int64), levels, nblocks)
        object.__setattr__(self, "views", views)

    @property
    def capacity(self) -> int:
        """Number of leaves (rows)."""
        return int(self.views.leaf.shape[0])

    @property
    def depth(self) -> int:
        """``D + 1``: levels of rows above the blocks."""
        return len(self.views.levels)

    @property
    def arrays(self) -> tuple[Any, ...]:
        """The two arrays as given, in :func:`layout` order (to flush or map them)."""
        return (self.leaves, self.nodes)

    @property
    def sums(self) -> Float64Array:
        """Slot sums, [R, 16] (a writable view)."""
        return self.views.sum

    @property
    def maxs(self) -> Float32Array:
        """Slot maxima, [R, 16] (a writable view; 0 for a slot without a live leaf)."""
        return self.views.max

    @property
    def min_codes(self) -> npt.NDArray[np.uint32]:
        """Slot minima as stored, [R, 16] (a writable view): ``0x7F800000 - bits(min)``."""
        return self.views.min_code

    @property
    def mins(self) -> Float32Array:
        """Slot minima over the leaves ``> 0``, [R, 16] (a copy; ``inf``: none)."""
        bits = np.uint32(0x7F800000) - self.views.min_code
        return bits.view(np.float32)


def node_rows(tree: PriorityTree, start: int, stop: int) -> list[tuple[int, int]]:
    """The rows ``[lo, hi)`` of ``nodes``, one range per level, that a write of the
    leaves ``[start, stop)`` (``start < stop``) may store into: what a store
    allocates on disk before such a write (a store into a hole of a full disk
    is a SIGBUS). Depth + 1 ranges, ``O(depth)``.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> T.node_rows(T.init(100_000), 5000, 70_000)  # levels of 1, 6 and 98 rows
    [(0, 1), (1, 6), (12, 77)]
    """
    rows = []
    lo, hi = int(start) >> SHIFT, ((int(stop) - 1) >> SHIFT) + 1  # blocks: slots of the last level
    for o, _ in reversed(tree.views.levels):
        lo, hi = lo >> FSHIFT, ((hi - 1) >> FSHIFT) + 1
        rows.append((o + lo, o + hi))
    return rows[::-1]


def _plain(name: str, arr: Any, dtype: type, shape: tuple[int, ...] | None) -> Any:
    """Validate one array of a tree and return a plain ndarray view of it."""
    if not isinstance(arr, np.ndarray):
        raise InvalidArgumentError(f"{name}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype != np.dtype(dtype):
        raise InvalidArgumentError(f"{name}: expected dtype {np.dtype(dtype)}, got {arr.dtype}")
    if (arr.ndim != 1) if shape is None else (arr.shape != shape):
        expected = "(capacity,)" if shape is None else str(shape)
        raise InvalidArgumentError(f"{name}: expected shape {expected}, got {arr.shape}")
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError(f"{name}: expected C-contiguous, got strides {arr.strides}")
    return arr.view(np.ndarray)


def init(capacity: int) -> PriorityTree:
    """A tree over ``capacity >= 1`` rows in RAM, all leaves 0 (nothing live).

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> tr = T.init(5)
    >>> T.total(tr), T.min_live(tr), T.max_live(tr)
    (0.0, inf, 0.0)
    """
    return PriorityTree(**{k: np.zeros(shape, dtype) for k, (shape, dtype) in layout(capacity).items()})


def reset(tree: PriorityTree) -> None:
    """Set every leaf to 0 and every node to its neutral value (all zero bytes), in place.

    Not needed on freshly allocated zero-filled arrays (or a sparse file): they
    already are an empty tree. Example: :class:`PriorityTree`.
    """
    tree.views.leaf.fill(0)
    tree.views.nodes.fill(0)
