"""The priority tree's descent (:mod:`mmbuffer.kernels.tree` holds its layout and its
update): the leaf holding each target mass, one compiled pass per batch, nogil.

A descent adds a row's slot sums in slot order, as the update added them into the
parent, so its running sums are exactly the totals the parents hold. Where a row's
scan would exit its loop at a slot that differs from draw to draw, the exit
mispredicts (about 16 ns a row on the dev VM): :func:`_first_past` and
:func:`_first_past4` find the same slot or leaf with no branch per slot, by counting
the running sums that do not pass the target, and leave the rare case they do not
cover (no slot passes, a row or block that is not of finite sums ``>= 0``) to the
scan as written. They never see a target that is not a number: the root row's scan
finds no slot for it, and the descent goes on past the mass (``t = inf``).

>>> import numpy as np
>>> from mmbuffer.kernels import tree as K
>>> leaf = np.zeros(100, np.float32); nodes = np.zeros((1, 32))
>>> offs = np.array([0, 1], np.int64)
>>> K.update(leaf, nodes, offs, np.array([3, 70]), np.array([1.0, 2.0], np.float32))
>>> find(leaf, nodes, offs, np.array([0.5, 1.0, 2.5]))[0].tolist()
[3, 70, 70]
"""

from __future__ import annotations

from typing import Any, Final

import numba
import numpy as np
import numpy.typing as npt

__all__ = ["descend", "find"]

#: levels of at most this many rows (1 MiB: about a core's L2 on the dev VM) are scanned
#: without a branch per slot; in a larger level the rows come from memory, and the
#: branchy scan, which runs ahead past its prediction, waits less (benchmarks/HISTORY.md)
SMALL_LEVEL: Final = 4096


@numba.njit(nogil=True, cache=True)
def _first_past(ns: Any, g: int, t: float, ps: Any) -> tuple[int, float]:
    """The first slot of row ``g`` whose running sum passes ``t``, and the running sum
    before it, without a branch per slot; ``(-1, 0.0)`` where the scan as written must
    decide. With sums ``>= 0`` the running sums never fall, so those ``<= t`` come
    first and their count is the slot (whose sum is then ``> 0``)."""
    p = 0.0
    h = 0
    low = 0.0
    for c in range(16):
        s = ns[g, c]
        low = min(low, s)
        p += s
        ps[c + 1] = p
        h += p <= t
    if h < 16 and low >= 0.0 and p < np.inf:
        return h, ps[h]
    return -1, 0.0


@numba.njit(nogil=True, cache=True)
def _first_past4(leaf: Any, node: Any, t: Any, k: int, hit: Any) -> None:
    """As :func:`_first_past`, over the 64 leaves of the blocks of draws ``k`` to ``k + 3``
    at once (four independent chains of additions; one waits 4 cycles an addition):
    ``hit[k + q]`` is the leaf, left as it is where the scan as written must decide."""
    b0, b1, b2, b3 = node[k] * 64, node[k + 1] * 64, node[k + 2] * 64, node[k + 3] * 64
    if max(max(b0, b1), max(b2, b3)) + 64 > leaf.shape[0]:  # the last block may be partial
        return
    t0, t1, t2, t3 = t[k], t[k + 1], t[k + 2], t[k + 3]
    p0 = p1 = p2 = p3 = w0 = w1 = w2 = w3 = 0.0
    h0 = h1 = h2 = h3 = 0
    for i in range(64):
        v0, v1 = np.float64(leaf[b0 + i]), np.float64(leaf[b1 + i])
        v2, v3 = np.float64(leaf[b2 + i]), np.float64(leaf[b3 + i])
        w0, w1, w2, w3 = min(w0, v0), min(w1, v1), min(w2, v2), min(w3, v3)
        p0 += v0
        p1 += v1
        p2 += v2
        p3 += v3
        h0 += p0 <= t0
        h1 += p1 <= t1
        h2 += p2 <= t2
        h3 += p3 <= t3
    for q, (h, w, p, b) in enumerate(((h0, w0, p0, b0), (h1, w1, p1, b1), (h2, w2, p2, b2), (h3, w3, p3, b3))):
        if h < 64 and w >= 0.0 and p < np.inf:
            hit[k + q] = b + h


@numba.njit(nogil=True, cache=True)
def descend(leaf: Any, ns: Any, offs: Any, targets: Any, out_idx: Any, out_val: Any) -> tuple[int, float]:
    """Leaf holding each target mass; returns how many descents met an empty row
    (and the sum of the prefetching loads, which keeps the compiler from dropping them).

    Per level: the first slot whose running sum passes ``t`` (``run <= t < run +
    s``, so ``s > 0``), else the last slot with ``s > 0`` (rounding or a target
    past the total), whose subtree is then searched for its last positive leaf.
    A row without a positive slot (only a torn read under a concurrent write)
    ends the descent at its first leaf. A slot with no row or block under it (zero
    in a sound tree) leads to the level's last, so a damaged file is never read past.

    The batch descends level by level: first a pass that only loads each
    target's row (independent loads, so the cache misses of a tree larger than
    the caches overlap), then the scans, which hit the cache.
    """
    depth = offs.shape[0] - 1
    cap = leaf.shape[0]
    n = targets.shape[0]
    node = np.zeros(n, np.int64)
    t = np.empty(n, np.float64)
    ok = np.ones(n, np.bool_)
    ps = np.zeros(17)  # a row's running sums (_first_past)
    for k in range(n):
        t[k] = max(targets[k], 0.0)
    sink = 0.0
    for d in range(depth):
        o = offs[d]
        if d > 1:
            for k in range(n):
                sink += ns[o + node[k], 0] + ns[o + node[k], 8]
        # the top two levels' rows are the same for most draws: their exits predict well
        branchless = d > 1 and offs[d + 1] - o <= SMALL_LEVEL
        below = offs[d + 2] - offs[d + 1] if d + 1 < depth else (cap + 63) >> 6  # rows or blocks under
        for k in range(n):
            g = o + node[k]
            tk = t[k]
            j, run = _first_past(ns, g, tk, ps) if branchless else (-1, 0.0)
            last = -1
            if j < 0:
                for c in range(16):
                    s = ns[g, c]
                    if s > 0:
                        last = c
                        if run + s > tk:
                            j = c
                            break
                    run += s
            if j < 0:
                if last < 0:
                    ok[k] = False
                    last = 0
                j = last
                t[k] = np.inf  # past this row's mass: its last positive leaf
            else:
                t[k] = tk - run
            node[k] = min(node[k] * 16 + j, below - 1)  # a damaged row's slot past its children
    for k in range(n):  # node[k] < ceil(cap / 64) (the bound above): its block starts below cap
        lo = node[k] * 64
        sink += leaf[lo] + leaf[min(lo + 16, cap - 1)] + leaf[min(lo + 32, cap - 1)] + leaf[min(lo + 48, cap - 1)]
    hit = np.full(n, -1, np.int64)
    for k in range(0, n - 3, 4):
        _first_past4(leaf, node, t, k, hit)
    empty = 0
    for k in range(n):
        lo = node[k] * 64
        hi = min(lo + 64, cap)
        pick = hit[k] if ok[k] else -1
        last = -1
        run = 0.0
        tk = t[k]
        if ok[k] and pick < 0:
            for i in range(lo, hi):
                v = np.float64(leaf[i])
                if v > 0:
                    last = i
                    if run + v > tk:
                        pick = i
                        break
                run += v
        if pick < 0:
            pick = last
        if pick < 0:
            empty += 1
            pick = lo
        out_idx[k] = pick
        out_val[k] = leaf[pick]
    return empty, sink


def find(leaf: npt.NDArray[np.float32], nodes: npt.NDArray[np.float64], offs: npt.NDArray[np.int64],
         targets: npt.NDArray[np.float64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], int]:
    """Leaf index and value for each 1-D float64 target, and the count of descents
    that met an empty row (a torn read)."""
    idx = np.empty(targets.shape[0], np.int64)
    val = np.empty(targets.shape[0], np.float32)
    empty, _ = descend(leaf, nodes, offs, targets, idx, val)
    return idx, val, int(empty)
