"""Compiled kernels of the priority tree (:mod:`mmbuffer.tree`): update, span refresh
and check, over the arrays themselves (memory maps included), nogil; its descent is
:mod:`mmbuffer.kernels.descent`.

The node record of a row ``g`` of the tree is 32 float64 = 256 bytes (16 rows
fill a 4 KiB page exactly), so a descent or an update touches one page per
level:

=====================  ========  =============================================
float64 columns 0-15   float64   slot sums (float64 sum of the leaves under it)
as uint32, 32-47       uint32    min codes: ``0x7F800000 - bits(min live)``, 0
                                 when the slot has no leaf ``> 0``
as float32, 48-63      float32   maxs: largest leaf under the slot (0: none)
=====================  ========  =============================================

Every neutral value is all-zero bytes, so a file hole reads as an empty subtree
and a fresh tree needs no write. A min code orders the other way round from the
value (bit patterns of floats ``>= 0`` order like the floats): the min of
values is the max of codes.

The wrappers take ``ns`` (the nodes as float64 [R, 32]), ``nu`` (uint32 [R, 64])
and ``nf`` (float32 [R, 64]) views of one buffer, the leaves as float32 and as
uint32, and ``offs``: int64 [depth + 1], level ``d``'s rows are
``[offs[d], offs[d + 1])``; the slots of the last level are the blocks of 64
leaves. Writes store a value only where it differs (an equal store would still
dirty a page of a mapped file, or allocate a hole).

Examples
--------
>>> import numpy as np
>>> from mmbuffer.kernels import tree as K
>>> leaf = np.zeros(100, np.float32); nodes = np.zeros((1, 32))
>>> offs = np.array([0, 1], np.int64)
>>> K.update(leaf, nodes, offs, np.array([3, 70]), np.array([1.0, 2.0], np.float32))
>>> nodes[0, :3].tolist(), float(K.decode_min(nodes.view(np.uint32)[0, 32:48]).min())
([1.0, 2.0, 0.0], 1.0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt

INF_BITS: Final = 0x7F800000
BLOCK: Final = 64
FANOUT: Final = 16

_F = TypeVar("_F", bound=Callable[..., Any])


def _jit(fn: _F) -> _F:
    return cast(_F, numba.njit(nogil=True, cache=True)(fn))


# --------------------------------------------------------------------- node values
@_jit
def _block(leaf: Any, leafu: Any, b: int) -> tuple[float, Any, Any]:
    """Sum (float64, in order), min code and max (as its float32 bits) of block
    ``b``'s leaves. Two loops: the sum's chain of additions, then the extremes as
    integer maxima without a branch (the bits of floats ``>= 0`` order like the
    floats; a branch per leaf mispredicted on random priorities: 125 -> 92 us per
    update of 256 rows at 1e8, benchmarks/HISTORY.md)."""
    lo = b * 64
    hi = min(lo + 64, leaf.shape[0])
    s = 0.0
    for i in range(lo, hi):
        s += np.float64(leaf[i])
    code = np.uint32(0)
    mx = np.uint32(0)
    for i in range(lo, hi):
        u = leafu[i]
        live = leaf[i] > 0
        code = max(code, np.uint32(INF_BITS) - u if live else np.uint32(0))
        mx = max(mx, u if live else np.uint32(0))
    return s, code, mx


@_jit
def _row(ns: Any, nu: Any, nf: Any, g: int) -> tuple[float, Any, Any]:
    """Total (running sum in slot order), min code and max (float32 bits) of row ``g``."""
    s = 0.0
    for c in range(16):
        s += ns[g, c]
    code = np.uint32(0)
    mx = np.uint32(0)
    for c in range(16):
        code = max(code, nu[g, 32 + c])
        mx = max(mx, nu[g, 48 + c])
    return s, code, mx


@_jit
def _store(ns: Any, nu: Any, nf: Any, g: int, c: int, s: float, code: int, mx: int) -> None:
    """Store slot ``c`` of row ``g`` (``mx``: the max's float32 bits) where it differs."""
    if ns[g, c] != s:
        ns[g, c] = s
    if nu[g, 32 + c] != code:
        nu[g, 32 + c] = code
    if nu[g, 48 + c] != mx:
        nu[g, 48 + c] = mx


@_jit
def _touch(ns: Any, g: int) -> Any:
    """Load the 4 cache lines of node row ``g`` (a prefetch: see ``descent.descend``)."""
    return ns[g, 0] + ns[g, 8] + ns[g, 16] + ns[g, 24]


@_jit
def _refresh(leaf: Any, leafu: Any, ns: Any, nu: Any, nf: Any, offs: Any, kids: Any) -> float:
    """Recompute the slots of the sorted, unique blocks ``kids`` and every row above;
    returns the sum of the prefetching loads (which keeps them)."""
    depth = offs.shape[0] - 1
    o = offs[depth - 1]
    cap = leaf.shape[0]
    sink = 0.0
    for b in kids:
        lo = b * 64
        sink += _touch(ns, o + (b >> 4)) + leaf[lo] + leaf[min(lo + 16, cap - 1)]
        sink += leaf[min(lo + 32, cap - 1)] + leaf[min(lo + 48, cap - 1)]
    for b in kids:
        s, code, mx = _block(leaf, leafu, b)
        _store(ns, nu, nf, o + (b >> 4), b & 15, s, code, mx)
    n = kids.shape[0]
    rows = kids.copy()
    for d in range(depth - 1, 0, -1):
        o, op = offs[d], offs[d - 1]
        if d > 2:
            for i in range(n):
                sink += _touch(ns, op + (rows[i] >> 8))
        m = 0
        prev = -1
        for i in range(n):
            r = rows[i] >> 4
            if r != prev:
                rows[m] = r
                m += 1
                prev = r
                s, code, mx = _row(ns, nu, nf, o + r)
                _store(ns, nu, nf, op + (r >> 4), r & 15, s, code, mx)
        n = m
    return sink


@_jit
def _blocks_of(idx: Any) -> Any:
    """The sorted, unique blocks of rows ``idx``: one pass when the rows are sorted
    (a prioritized batch's are: stratified), else ``np.unique``."""
    n = idx.shape[0]
    kids = np.empty(n, np.int64)
    m = 0
    for i in range(n):
        b = idx[i] >> 6
        if m and b < kids[m - 1]:
            return np.unique(idx >> 6)
        if m == 0 or b != kids[m - 1]:
            kids[m] = b
            m += 1
    return kids[:m]


@_jit
def _update(leaf: Any, leafu: Any, ns: Any, nu: Any, nf: Any, offs: Any, idx: Any, val: Any) -> float:
    for i in range(idx.shape[0]):  # in order: a repeated id keeps its last value
        leaf[idx[i]] = val[i]
    return _refresh(leaf, leafu, ns, nu, nf, offs, _blocks_of(idx))


@_jit
def _span(leaf: Any, leafu: Any, ns: Any, nu: Any, nf: Any, offs: Any, b0: int, b1: int) -> None:
    """Recompute the slots of the blocks ``[b0, b1)`` and every row above them."""
    depth = offs.shape[0] - 1
    o = offs[depth - 1]
    for b in range(b0, b1):
        s, code, mx = _block(leaf, leafu, b)
        _store(ns, nu, nf, o + (b >> 4), b & 15, s, code, mx)
    lo, hi = b0, b1
    for d in range(depth - 1, 0, -1):
        o, op = offs[d], offs[d - 1]
        lo, hi = lo >> 4, ((hi - 1) >> 4) + 1
        for r in range(lo, hi):
            s, code, mx = _row(ns, nu, nf, o + r)
            _store(ns, nu, nf, op + (r >> 4), r & 15, s, code, mx)


@_jit
def _fill(leaf: Any, lo: int, hi: int, value: Any) -> None:
    for i in range(lo, hi):
        if leaf[i] != value:
            leaf[i] = value


# --------------------------------------------------------------------- checks
@_jit
def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    d = abs(a - b)
    if d != d:
        return np.inf
    return d / max(abs(a), abs(b))


@_jit
def _rows_above(sa: Any, sb: Any, i: int, d: int, shift: int, nrows: int) -> tuple[int, int]:
    """Local rows of level ``d`` above span ``i`` (the root row for every span)."""
    if d == 0:
        return 0, 1
    if sb[i] <= sa[i]:
        return 0, 0
    return sa[i] >> (shift + 4), min(((sb[i] - 1) >> (shift + 4)) + 1, nrows)


@_jit
def _expected(leaf: Any, leafu: Any, ns: Any, nu: Any, nf: Any, offs: Any, sa: Any, sb: Any,
              d: int, shift: int, k: int) -> tuple[bool, float, Any, Any]:
    """Whether a span lies under child ``k`` of level ``d``, and the child's values
    (zeros when none does: nothing under it is reachable)."""
    c0 = k << shift
    c1 = c0 + (1 << shift)
    if c0 < leaf.shape[0]:
        for j in range(sa.shape[0]):
            if sa[j] < c1 and sb[j] > c0:
                if d == offs.shape[0] - 2:
                    s, code, mx = _block(leaf, leafu, k)
                else:
                    s, code, mx = _row(ns, nu, nf, offs[d + 1] + k)
                return True, s, code, mx
    return False, 0.0, np.uint32(0), np.uint32(0)


@_jit
def _check_spans(leaf: Any, leafu: Any, ns: Any, nu: Any, nf: Any, offs: Any, sa: Any, sb: Any) -> float:
    """The largest relative disagreement of a slot sum with its recomputation from
    the children, over the rows above the leaf spans ``[sa[i], sb[i])``; inf for
    a min/max mismatch, a slot with no span under it that is not zero, or a leaf
    in a span that is NaN, infinite or negative. The leaves outside the spans are
    not read: O(the spans' rows), not O(capacity)."""
    depth = offs.shape[0] - 1
    worst = 0.0
    for i in range(sa.shape[0]):
        for x in range(sa[i], sb[i]):
            v = leaf[x]
            if not (v >= 0 and v < np.inf):
                return np.inf
    for d in range(depth - 1, -1, -1):
        shift = 6 + 4 * (depth - 1 - d)  # log2 of the leaves under a slot of level d
        o, nrows = offs[d], offs[d + 1] - offs[d]
        for i in range(sa.shape[0] if d > 0 else 1):
            r0, r1 = _rows_above(sa, sb, i, d, shift, nrows)
            for r in range(r0, r1):
                for c in range(16):
                    under, s, code, mx = _expected(leaf, leafu, ns, nu, nf, offs, sa, sb, d, shift, r * 16 + c)
                    if nu[o + r, 32 + c] != code or nu[o + r, 48 + c] != mx:
                        return np.inf
                    if not under and ns[o + r, c] != 0:  # must be empty: exactly
                        return np.inf
                    worst = max(worst, _rel(ns[o + r, c], s))
    return worst


@_jit
def _rebuild_spans(leaf: Any, leafu: Any, ns: Any, nu: Any, nf: Any, offs: Any, sa: Any, sb: Any) -> None:
    """Recompute, bottom up, every slot of the rows above the leaf spans (the
    traversal of :func:`_check_spans`), storing only what differs."""
    depth = offs.shape[0] - 1
    for d in range(depth - 1, -1, -1):
        shift = 6 + 4 * (depth - 1 - d)
        o, nrows = offs[d], offs[d + 1] - offs[d]
        for i in range(sa.shape[0] if d > 0 else 1):
            r0, r1 = _rows_above(sa, sb, i, d, shift, nrows)
            for r in range(r0, r1):
                for c in range(16):
                    _, s, code, mx = _expected(leaf, leafu, ns, nu, nf, offs, sa, sb, d, shift, r * 16 + c)
                    _store(ns, nu, nf, o + r, c, s, code, mx)


# --------------------------------------------------------------------- wrappers
Int64Array = npt.NDArray[np.int64]


def _views(nodes: npt.NDArray[np.float64]) -> tuple[Any, Any]:
    return nodes.view(np.uint32), nodes.view(np.float32)


def update(leaf: npt.NDArray[np.float32], nodes: npt.NDArray[np.float64], offs: Int64Array,
           idx: Int64Array, val: npt.NDArray[np.float32]) -> None:
    """Set ``leaf[idx] = val`` in order (last write wins) and recompute the touched
    blocks and rows. ``idx`` must be in range (the caller checks)."""
    nu, nf = _views(nodes)
    _update(leaf, leaf.view(np.uint32), nodes, nu, nf, offs, idx, val)


def refresh_span(leaf: npt.NDArray[np.float32], nodes: npt.NDArray[np.float64], offs: Int64Array,
                 b0: int, b1: int) -> None:
    """Recompute the blocks ``[b0, b1)`` (``b0 < b1``) and the rows above them."""
    nu, nf = _views(nodes)
    _span(leaf, leaf.view(np.uint32), nodes, nu, nf, offs, int(b0), int(b1))


def fill(leaf: npt.NDArray[np.float32], lo: int, hi: int, value: Any) -> None:
    """``leaf[lo:hi] = value``, storing only where a leaf differs."""
    _fill(leaf, int(lo), int(hi), np.float32(value))


def sweep(leaf: npt.NDArray[np.float32], nodes: npt.NDArray[np.float64], offs: Int64Array,
          spans: Int64Array, *, write: bool) -> float:
    """Check (``write=False``) or rebuild (``write=True``) the nodes above the leaf
    spans ``spans`` [k, 2] (see :func:`mmbuffer.tree.check`)."""
    nu, nf = _views(nodes)
    sa, sb = np.ascontiguousarray(spans[:, 0]), np.ascontiguousarray(spans[:, 1])
    if write:
        _rebuild_spans(leaf, leaf.view(np.uint32), nodes, nu, nf, offs, sa, sb)
        return 0.0
    return float(_check_spans(leaf, leaf.view(np.uint32), nodes, nu, nf, offs, sa, sb))


def decode_min(codes: npt.NDArray[np.uint32]) -> npt.NDArray[np.float32]:
    """Min values of min codes (``inf`` for code 0)."""
    bits = np.uint32(INF_BITS) - codes.astype(np.uint32)
    return bits.view(np.float32)


def encode_min(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint32]:
    """Min codes of min values ``> 0`` (``inf`` gives 0)."""
    return np.uint32(INF_BITS) - np.asarray(values, np.float32).view(np.uint32)
