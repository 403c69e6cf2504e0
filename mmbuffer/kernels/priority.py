"""Compiled steps of prioritized replay: a batch's draw, and an update's checks, in one
call each (the Python around the tree's kernels was about 60% of a PER step:
benchmarks/HISTORY.md, "Where a step's time goes").

:func:`draw` does what ``samplers._draw.prioritized`` did in some 20 numpy calls: the
root's total, the stratified targets ``(u + k) * total / n``, the descent
(:func:`mmbuffer.kernels.descent.descend`, run again for a read torn by a concurrent
write, as ``tree.sample``), each row's leaf, whether it is sampleable as a transition
(``Layout.absolute`` against the view's cursors, ``[first_start, visible_end)`` of its
lane) and its importance weight ``(leaf / min live leaf) ** -beta``, with the same
floating-point operations in the same order: the rows and weights are bit-identical to
the numpy code's for the same uniforms ``u``.

:func:`prepare` does what ``Writer.update_priorities`` did before the tree's update:
the values' check (finite, ``>= 0``), the rows' range, their liveness against the
lanes' cursors when sampled (``written_at``) and now, and ``(p + eps) ** alpha``, and
returns the live rows and their float32 leaves in order (the tree's update keeps the
last of a repeated row). A refusal is a status and nothing is written: the caller
raises the typed error.

>>> import numpy as np
>>> from mmbuffer.kernels import priority as P
>>> status, rows, leaves = P.prepare(np.array([5, 9, 2]), np.array([1.0, 3.0, 0.0]), 8, 4,
...     np.array([7, 3]), np.array([0, 0]), None, 0.0, 1.0, True)
>>> status, rows.tolist(), leaves.tolist()  # row 9 >= capacity 8: refused, status 2
(2, [], [])
>>> P.prepare(np.array([7, 2]), np.array([1.0, 4.0]), 8, 4, np.array([7, 3]), np.array([0, 0]),
...     None, 0.0, 0.5, True)[1:]  # row 7 (lane 1's 4th row) not written yet: not live
(array([2]), array([2.], dtype=float32))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt

from .descent import descend
from .tree import INF_BITS

__all__ = ["BAD_INDEX", "BAD_VALUE", "EMPTY", "draw", "prepare"]

EMPTY: Final = 1  # draw: no leaf > 0
BAD_VALUE: Final = 1  # prepare: a value is NaN, infinite or negative
BAD_INDEX: Final = 2  # prepare: a row id is outside [0, capacity)

_F = TypeVar("_F", bound=Callable[..., Any])


def _jit(fn: _F) -> _F:
    return cast(_F, numba.njit(nogil=True, cache=True)(fn))


@_jit
def _absolute(row: int, cursor: int, lane_size: int) -> int:
    """``Layout.absolute_at`` of one row (Python's floor modulo, as numpy's)."""
    return cursor - 1 - (cursor - 1 - row % lane_size) % lane_size


@_jit
def _draw(leaf: Any, ns: Any, nu: Any, offs: Any, u: Any, lane_size: int, written: Any, first: Any,
          counts: Any, beta: float, rows: Any, values: Any, ok: Any, weights: Any) -> tuple[int, int]:
    """Returns ``(status, draws not sampleable)``; fills ``rows``, ``values`` (the leaves
    as float64, ``(leaf / total) * total`` as ``tree.sample``'s probabilities times the
    total), ``ok`` and ``weights``."""
    n = u.shape[0]
    mass = 0.0
    for c in range(16):  # the root row's running sum, in slot order (tree.total)
        mass += ns[0, c]
    if not mass > 0:
        return EMPTY, 0
    step = mass / max(n, 1)
    t = np.empty(n, np.float64)
    for k in range(n):
        t[k] = (u[k] + np.float64(k)) * step
    leaves = np.empty(n, np.float32)
    empty, _ = descend(leaf, ns, offs, t, rows, leaves)
    if empty:  # only a read torn by a concurrent write meets an empty row: descend once more
        again = np.flatnonzero(leaves <= 0)
        r2 = np.empty(again.shape[0], np.int64)
        v2 = np.empty(again.shape[0], np.float32)
        descend(leaf, ns, offs, t[again], r2, v2)
        for i in range(again.shape[0]):
            rows[again[i]] = r2[i]
            leaves[again[i]] = v2[i]
    code = np.uint32(0)
    for c in range(16):
        code = max(code, nu[0, 32 + c])
    least = np.inf
    if code:  # tree.min_live: the float32 whose bits the min code encodes
        least = np.float64(np.array([np.uint32(INF_BITS) - code]).view(np.float32)[0])
    bad = 0
    for k in range(n):
        v = (np.float64(leaves[k]) / mass) * mass
        values[k] = v
        weights[k] = np.float32((v / least) ** (-beta))
        r = rows[k]
        lane = r // lane_size
        w = written[lane]
        a = _absolute(r, w, lane_size)
        ok[k] = w > 0 and a >= first[lane] and a < first[lane] + counts[lane]
        bad += not ok[k]
    return 0, bad


@_jit
def _prepare(idx: Any, pri: Any, capacity: int, lane_size: int, now: Any, first: Any, snap: Any,
             eps: float, alpha: float, transform: bool, out_idx: Any, out_val: Any) -> tuple[int, int]:
    """Returns ``(status, live rows)``; fills the first entries of ``out_idx``/``out_val``."""
    n = idx.shape[0]
    one = pri.shape[0] == 1 and n != 1  # a scalar value for every row
    for i in range(pri.shape[0] if n else 0):
        p = pri[i]
        if not (p >= 0 and p < np.inf):
            return BAD_VALUE, 0
    for i in range(n):
        if idx[i] < 0 or idx[i] >= capacity:
            return BAD_INDEX, 0
    m = 0
    for i in range(n):
        r = idx[i]
        lane = r // lane_size
        s = snap[lane]
        a = _absolute(r, s, lane_size)  # the row's absolute id when it was sampled
        if s > 0 and a >= first[lane] and a < now[lane]:
            v = pri[0] if one else pri[i]
            if transform:
                v = (v + eps) ** alpha
            out_idx[m] = r
            out_val[m] = np.float32(v)
            m += 1
    return 0, m


Int64Array = npt.NDArray[np.int64]


def draw(leaf: npt.NDArray[np.float32], nodes: npt.NDArray[np.float64], offs: Int64Array,
         u: npt.NDArray[np.float64], lane_size: int, written: Int64Array, first: Int64Array,
         counts: Int64Array, beta: float) -> tuple[int, int, Int64Array, npt.NDArray[np.float64],
                                                   npt.NDArray[np.bool_], npt.NDArray[np.float32]]:
    """``(status, not sampleable, rows, leaves, sampleable, weights)`` of the draws of
    uniforms ``u`` in ``[0, 1)`` (status :data:`EMPTY`: the tree's total is 0).
    ``written``, ``first``, ``counts``: per lane, the cursor, ``first_start`` and the
    sampleable transitions (``visible_end - first_start``)."""
    n = u.shape[0]
    rows = np.empty(n, np.int64)
    values = np.empty(n, np.float64)
    ok = np.empty(n, np.bool_)
    weights = np.empty(n, np.float32)
    status, bad = _draw(leaf, nodes, nodes.view(np.uint32), offs, u, lane_size, written, first, counts,
                        float(beta), rows, values, ok, weights)
    return int(status), int(bad), rows, values, ok, weights


def prepare(idx: Int64Array, pri: npt.NDArray[np.float64], capacity: int, lane_size: int,
            now: Int64Array, first: Int64Array, snap: Int64Array | None, eps: float, alpha: float,
            transform: bool) -> tuple[int, Int64Array, npt.NDArray[np.float32]]:
    """``(status, live rows, their leaves)`` of an update of rows ``idx`` (flat int64)
    to values ``pri`` (float64, one per row or one for all); ``transform``: the
    leaves are ``(pri + eps) ** alpha``, else ``pri``. A row is live when it holds
    what it held when the lanes' cursors were ``snap`` (``now`` when None) and is in
    ``[first, now)`` of its lane. Status :data:`BAD_VALUE` or :data:`BAD_INDEX`:
    nothing is returned (the caller refuses)."""
    n = idx.shape[0]
    out_idx = np.empty(n, np.int64)
    out_val = np.empty(n, np.float32)
    status, m = _prepare(idx, pri, int(capacity), int(lane_size), now, first, now if snap is None else snap,
                         float(eps), float(alpha), bool(transform), out_idx, out_val)
    return int(status), out_idx[:m], out_val[:m]
