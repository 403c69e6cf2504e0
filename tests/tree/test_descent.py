"""The compiled descent (``mmbuffer.kernels.descent``) against the scan it documents,
written out in Python: the same leaf, value and count of empty rows for every target,
on trees with rows and blocks that are not of finite sums >= 0 (torn or damaged) and
targets at and past the edges, where its branch-free paths must hand over to the scan."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mmbuffer import tree as T
from mmbuffer.kernels import descent


def scan(values: np.ndarray, t: float) -> tuple[int, int, float]:
    """The documented rule over one row or block: (first index whose running sum passes
    ``t``, or -1; last index with a value > 0, or -1; the running sum before the first)."""
    run, last = 0.0, -1
    for i, v in enumerate(values.astype(np.float64)):
        if v > 0:
            last = i
            if run + v > t:
                return i, last, run
        run += v
    return -1, last, run


def reference(tr: T.PriorityTree, targets: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Leaves of ``targets`` as ``descend`` documents them, the count of empty rows met,
    and how many row scans met a value that is not finite and >= 0."""
    v = tr.views
    leaf, ns, offs = v.leaf, v.nodes, v.offs
    odd_scans = 0
    out, empty = [], 0
    for target in targets:
        t, node, ok = max(float(target), 0.0), 0, True
        depth = len(offs) - 1
        for d in range(depth):
            row = ns[offs[d] + node, :16]
            odd_scans += not (np.isfinite(row) & (row >= 0)).all()
            j, last, run = scan(row, t)
            if j < 0:
                if last < 0:
                    ok, last = False, 0
                j, t = last, math.inf
            else:
                t -= run
            below = offs[d + 2] - offs[d + 1] if d + 1 < depth else -(-len(leaf) // 64)
            node = min(node * 16 + j, below - 1)  # a slot with nothing under it: the last
        lo = node * 64
        hi = min(lo + 64, len(leaf))
        if lo >= len(leaf):
            lo, hi = len(leaf) - 1, len(leaf)
        block = leaf[lo:hi]
        odd_scans += ok and not (np.isfinite(block) & (block >= 0)).all()
        j, last, _ = scan(block, t) if ok else (-1, -1, 0.0)
        pick = lo + (j if j >= 0 else last)
        if j < 0 and last < 0:
            empty += 1
            pick = lo
        out.append(pick)
    return np.array(out, np.int64), empty, odd_scans


def damaged_tree(cap: int, seed: int) -> T.PriorityTree:
    """Random leaves (a third zero), then some slot sums and leaves set to NaN, inf, -1
    or 0 behind the tree's back (as a torn read or a damaged file shows them)."""
    rng = np.random.default_rng(seed)
    leaves = (rng.random(cap) * (rng.random(cap) > 1 / 3)).astype(np.float32)
    tr = T.init(cap)
    T.update(tr, np.arange(cap), leaves)
    ns = tr.views.nodes
    for bad in (np.nan, np.inf, -1.0, 0.0):
        rows = rng.integers(0, ns.shape[0], 3)
        ns[rows, rng.integers(0, 16, 3)] = bad
        tr.leaves[rng.integers(0, cap, 5)] = bad
    tr.leaves[cap - 200 : cap - 140] = 0.0  # a zero run across a block edge
    return tr


@pytest.mark.parametrize("cap", [1, 63, 1000, 70_001, 300_000])
def test_descend_matches_the_documented_scan(cap: int) -> None:
    # 70,001 and 300,000 rows have a third and a fourth level: rows the branch-free
    # path scans (levels below the top two)
    assert len(T.init(300_000).views.offs) - 1 > 2
    odd = 0
    for seed in range(3):
        tr = damaged_tree(cap, seed)
        total = float(np.nansum(tr.views.nodes[0, :16][np.isfinite(tr.views.nodes[0, :16])]))
        rng = np.random.default_rng(seed)
        edges = [0.0, -1.0, total, np.nextafter(total, 0), 2 * total, np.inf, np.nan, 1e-300]
        targets = np.concatenate([np.sort(rng.random(2000)) * total, rng.random(500) * total * 1.1, edges])
        want, want_empty, odd_scans = reference(tr, targets)
        v = tr.views
        got, values, empty = descent.find(v.leaf, v.nodes, v.offs, targets)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(values, v.leaf[want])
        assert empty == want_empty
        odd += odd_scans
    assert cap < 1000 or odd > 0  # the damaged rows and blocks were on the paths taken


def test_a_damaged_tree_is_never_read_past_its_arrays() -> None:
    # every slot above the blocks set to 1.0: the slots with no row or block under them
    # lead past the level's rows; what lies past the node array must not change a pick
    cap = 75_120  # levels of 1, 5 and 74 rows: the last rows have slots with nothing under
    picks = []
    for beyond in (0.0, np.nan, 1e300):
        tr = T.init(cap)
        T.update(tr, np.arange(cap), np.ones(cap, np.float32))
        v = tr.views
        rows = v.nodes.shape[0]
        room = np.full((rows + 300, 32), beyond)
        room[:rows] = v.nodes
        room[: v.offs[-2], :16] = 1.0
        nodes = room[:rows]
        targets = np.linspace(0.0, 16.0, 4001)
        idx, _, empty = descent.find(v.leaf, nodes, v.offs, targets)
        assert ((idx >= 0) & (idx < cap)).all() and empty == 0
        picks.append(idx)
    np.testing.assert_array_equal(picks[0], picks[1])
    np.testing.assert_array_equal(picks[0], picks[2])
