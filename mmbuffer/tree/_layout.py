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
FLAT_ROWS: Final = 256  # a descent starts with one search over a level this small

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
    """Shapes and dtypes of the five arrays of a tree over ``capacity`` rows.

    Returns ``name -> (shape, dtype)`` for ``leaves``, ``sums``, ``prefix``,
    ``mins`` and ``maxs``, the keyword arguments of :class:`PriorityTree`.
    ``capacity`` may be any size (row ids are int64);
    :class:`InvalidArgumentError` unless it is a positive integer.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> for name, (shape, dtype) in T.layout(5000).items():
    ...     print(name, shape, dtype)
    leaves (5000,) float32
    sums (6, 16) float64
    prefix (6, 17) float64
    mins (6, 16) float32
    maxs (6, 16) float32
    """
    _, rows = geometry(capacity)
    r = sum(rows)
    return {
        "leaves": ((int(capacity),), "float32"),
        "sums": ((r, FANOUT), "float64"),
        "prefix": ((r, FANOUT + 1), "float64"),
        "mins": ((r, FANOUT), "float32"),
        "maxs": ((r, FANOUT), "float32"),
    }


def nbytes(capacity: int) -> int:
    """Total bytes of the five arrays: ``4 * capacity + 392 * R``.

    Examples
    --------
    >>> from mmbuffer import tree as T
    >>> round(T.nbytes(600_000_000) / 600_000_000, 4)
    4.4083
    """
    _, rows = geometry(capacity)
    return 4 * int(capacity) + (24 * FANOUT + 8) * sum(rows)


@dataclass(frozen=True, slots=True, eq=False)
class Views:
    """Plain ndarray views of a tree's arrays, and its geometry: what the
    functions of :mod:`mmbuffer.tree` compute on (built by :class:`PriorityTree`)."""

    leaf: Float32Array
    full: Float32Array  # the whole blocks of leaves, [nfull, 64]
    sum: Float64Array
    pre: Float64Array
    min: Float32Array
    max: Float32Array
    levels: tuple[tuple[int, int], ...]  # (o_d, r_d)
    slot: tuple[tuple[Any, Any, Any], ...]  # flat sums, mins, maxs of the slots of each
    # level: slot i of level d is child i of the level
    top: int  # the deepest level of at most FLAT_ROWS rows, where a descent starts
    nblocks: int
    nfull: int  # whole blocks (nblocks - 1 when the last one is partial)


@dataclass(frozen=True, slots=True, eq=False)
class PriorityTree:
    """The five arrays of a priority tree (see :mod:`mmbuffer.tree`).

    Frozen, but the arrays are mutated in place by :func:`update`,
    :func:`set_range`, :func:`reset` and :func:`rebuild`. They are C-contiguous
    arrays of the shapes and dtypes :func:`layout` gives (else
    :class:`InvalidArgumentError`), possibly ``numpy.memmap`` objects: the
    fields keep them (for ``flush``), the functions compute on plain ndarray
    views of them (``views``, a :class:`Views`). ``PriorityTree(**arrays)``
    takes a mapping keyed like :func:`layout`.

    Examples
    --------
    >>> import numpy as np
    >>> from mmbuffer import tree as T
    >>> tr = T.PriorityTree(**{k: np.zeros(s, d) for k, (s, d) in T.layout(10).items()})
    >>> T.reset(tr)  # fresh zero-filled arrays need min = +inf
    >>> tr.capacity, tr.depth, len(tr.arrays)
    (10, 1, 5)
    """

    leaves: Float32Array
    sums: Float64Array
    prefix: Float64Array
    mins: Float32Array
    maxs: Float32Array
    views: Views = field(init=False, repr=False)

    def __post_init__(self) -> None:
        leaf = _plain("leaves", self.leaves, np.float32, None)
        shapes = layout(leaf.shape[0])
        nblocks, rows = geometry(leaf.shape[0])
        nfull = leaf.shape[0] >> SHIFT
        s, pre, mn, mx = (_plain(name, getattr(self, name), dtype, shapes[name][0])
                          for name, dtype in (("sums", np.float64), ("prefix", np.float64),
                                              ("mins", np.float32), ("maxs", np.float32)))
        offsets = np.cumsum((0,) + rows[:-1]).tolist()
        levels = tuple(zip(offsets, rows))
        flat = [a.reshape(-1) for a in (s, mn, mx)]
        slot = tuple(tuple(a[o * FANOUT : (o + r) * FANOUT] for a in flat) for o, r in levels)
        top = max(d for d, r in enumerate(rows) if r <= FLAT_ROWS)
        full = leaf[: nfull * BLOCK].reshape(nfull, BLOCK)
        object.__setattr__(self, "views", Views(leaf, full, s, pre, mn, mx, levels, slot, top,
                                                nblocks, nfull))

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
        """The five arrays as given, in :func:`layout` order (to flush or map them)."""
        return (self.leaves, self.sums, self.prefix, self.mins, self.maxs)


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
    arrays = {k: np.zeros(shape, dtype) for k, (shape, dtype) in layout(capacity).items()}
    arrays["mins"].fill(np.inf)
    return PriorityTree(**arrays)


def reset(tree: PriorityTree) -> None:
    """Set every leaf to 0 and every node to its neutral value, in place.

    Call it on freshly allocated (zero-filled) arrays: the neutral min is
    ``+inf``, not 0. Example: :class:`PriorityTree`.
    """
    v = tree.views
    for arr, neutral in ((v.leaf, 0), (v.sum, 0), (v.pre, 0), (v.min, np.inf), (v.max, 0)):
        arr.fill(neutral)
