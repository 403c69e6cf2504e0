"""Tests of mmbuffer.tree against a naive float64 numpy reference.

Capacities are deliberately not powers of two (and not multiples of the block
size), so padding blocks, a partial last block and a one-block heap are all
exercised.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import math
import pkgutil
import sys

import numpy as np
import pytest
import torch

from mmbuffer._disk import rawio as _format  # populate moved out of _format
from mmbuffer import errors
from mmbuffer import tree as T
from mmbuffer.kernels import tree as K

CAPACITIES = [1, 7, 50, 63, 64, 65, 1000, 4097]


# -- naive reference -----------------------------------------------------------


def naive_tree(leaves: np.ndarray) -> dict[str, np.ndarray]:
    """sums/mins/maxs built with Python-level clarity, float64 sums."""
    cap = leaves.shape[0]
    nblocks = -(-cap // 64)
    counts = [-(-nblocks // 16)]
    while counts[-1] > 1:
        counts.append(-(-counts[-1] // 16))
    counts.reverse()  # rows per level, root first
    padded = np.zeros(counts[-1] * 16 * 64, dtype=np.float64)
    padded[:cap] = leaves
    blocks = padded.reshape(-1, 64)
    # child values of the lowest level: one per block (padding blocks are neutral)
    s = np.array([math.fsum(b) for b in blocks])
    mn = np.array([b[b > 0].min() if (b > 0).any() else np.inf for b in blocks], np.float32)
    mx = blocks.max(axis=1).astype(np.float32)
    levels = []
    for r in reversed(counts):
        s, mn, mx = s[: r * 16].reshape(r, 16), mn[: r * 16].reshape(r, 16), mx[: r * 16].reshape(r, 16)
        pre = np.zeros((r, 17))
        for c in range(16):  # a row's total: its slots added in order
            pre[:, c + 1] = pre[:, c] + s[:, c]
        levels.append((s, mn, mx))
        pad = -(-r // 16) * 16 - r
        s = np.concatenate([pre[:, 16], np.zeros(pad)])
        mn = np.concatenate([mn.min(axis=1), np.full(pad, np.inf, np.float32)])
        mx = np.concatenate([mx.max(axis=1), np.zeros(pad, np.float32)])
    levels.reverse()
    return {name: np.concatenate([lv[i] for lv in levels]) for i, name in enumerate(("sums", "mins", "maxs"))}


def assert_matches_reference(tr: T.PriorityTree, leaves: np.ndarray) -> None:
    np.testing.assert_array_equal(tr.leaves, leaves.astype(np.float32))
    ref = naive_tree(leaves.astype(np.float32).astype(np.float64))
    np.testing.assert_allclose(tr.sums, ref["sums"], rtol=1e-12, atol=0)
    np.testing.assert_array_equal(tr.mins, ref["mins"])
    np.testing.assert_array_equal(tr.maxs, ref["maxs"])
    live = leaves[leaves > 0]
    assert T.total(tr) == pytest.approx(math.fsum(leaves.astype(np.float32).tolist()), rel=1e-12)
    assert T.min_live(tr) == (float(live.min()) if live.size else math.inf)
    assert T.max_live(tr) == (float(live.max()) if live.size else 0.0)
    assert T.check(tr) == 0.0


def assert_same_as_rebuild(tr: T.PriorityTree) -> None:
    fresh = T.init(tr.capacity)
    fresh.leaves[:] = tr.leaves
    T.rebuild(fresh)
    np.testing.assert_array_equal(tr.nodes, fresh.nodes)


def random_leaves(rng: np.random.Generator, n: int, zero_frac: float = 0.3) -> np.ndarray:
    vals = rng.random(n).astype(np.float32) + np.float32(0.01)
    vals[rng.random(n) < zero_frac] = 0.0
    return vals


# -- layout --------------------------------------------------------------------


@pytest.mark.parametrize("cap", CAPACITIES + [6_000_000_000])
def test_layout_shapes_and_size(cap: int) -> None:
    lay = T.layout(cap)
    assert list(lay) == ["leaves", "nodes"]
    nblocks = -(-cap // 64)
    (rows, words), dtype = lay["nodes"]
    assert T.FANOUT == 16 and words == 32 and dtype == "float64"  # 256 bytes: 16 rows per page
    expect, r = 0, nblocks
    while True:  # ceil(nblocks / 16) rows, then ceil of that / 16, ... up to one root row
        r = -(-r // 16)
        expect += r
        if r == 1:
            break
    assert rows == expect
    assert lay["leaves"] == ((cap,), "float32")
    size = sum(math.prod(s) * np.dtype(d).itemsize for s, d in lay.values())
    assert size == T.nbytes(cap) == 4 * cap + 256 * rows
    assert rows <= nblocks / 15 + 10


def test_bytes_per_row_at_scale() -> None:
    for cap in (10**6, 10**8, 6 * 10**8, 2**30 + 1):
        assert T.nbytes(cap) / cap <= 4.27
    assert max(T.nbytes(cap) / cap for cap in range(2000, 100_000, 13)) <= 4.6


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "7"])
def test_layout_refuses_bad_capacity(bad: object) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="capacity"):
        T.layout(bad)  # type: ignore[arg-type]


def test_tree_validates_arrays() -> None:
    ok = {k: np.zeros(s, d) for k, (s, d) in T.layout(100).items()}
    T.PriorityTree(**ok)
    with pytest.raises(errors.InvalidArgumentError, match="nodes: expected dtype float64"):
        T.PriorityTree(**{**ok, "nodes": ok["nodes"].astype(np.float32)})
    with pytest.raises(errors.InvalidArgumentError, match=r"nodes: expected shape \(1, 32\)"):
        T.PriorityTree(**{**ok, "nodes": np.zeros((2, 32))})
    with pytest.raises(errors.InvalidArgumentError, match="C-contiguous"):
        T.PriorityTree(**{**ok, "leaves": np.zeros(200, np.float32)[::2]})
    with pytest.raises(errors.InvalidArgumentError, match="numpy array"):
        T.PriorityTree(**{**ok, "nodes": [[0.0] * 32]})  # type: ignore[arg-type]
    tr = T.init(5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tr.leaves = np.zeros(5, np.float32)  # type: ignore[misc]


def test_zero_bytes_are_an_empty_tree() -> None:
    # every neutral node value is all-zero bytes: a fresh (sparse) file needs no write
    tr = T.init(5000)
    assert not tr.nodes.any() and not tr.leaves.any()
    assert (T.total(tr), T.min_live(tr), T.max_live(tr), T.check(tr)) == (0.0, math.inf, 0.0, 0.0)
    assert (tr.mins == np.inf).all()
    T.update(tr, [70, 4000], [0.5, 2.0])
    T.update(tr, [70, 4000], [0.0, 0.0])  # back to empty: back to zero bytes
    assert not tr.nodes.any()
    np.testing.assert_array_equal(K.decode_min(K.encode_min(np.float32([1e-30, 1.0, 3e38]))),
                                  np.float32([1e-30, 1.0, 3e38]))


@pytest.mark.parametrize("cap", CAPACITIES)
def test_init_and_reset(cap: int) -> None:
    tr = T.init(cap)
    assert tr.capacity == cap
    assert (T.total(tr), T.min_live(tr), T.max_live(tr)) == (0.0, math.inf, 0.0)
    assert T.check(tr) == 0.0
    T.set_range(tr, 0, cap, 2.0)
    T.reset(tr)
    assert_matches_reference(tr, np.zeros(cap, np.float32))


# -- writes --------------------------------------------------------------------


@pytest.mark.parametrize("cap", CAPACITIES)
def test_batched_update_matches_sequential(cap: int) -> None:
    rng = np.random.default_rng(cap)
    tr = T.init(cap)
    ref = np.zeros(cap, np.float32)
    for _ in range(30):
        n = int(rng.integers(1, 3 * cap + 2))
        # few distinct ids: many duplicates, resolved last-write-wins
        high = cap if rng.random() < 0.5 else max(1, cap // 8)
        idx = rng.integers(0, high, n)
        val = random_leaves(rng, n)
        T.update(tr, idx, val)
        for i, v in zip(idx.tolist(), val.tolist()):  # the sequential meaning
            ref[i] = v
        np.testing.assert_array_equal(tr.leaves, ref)
    assert_matches_reference(tr, ref)
    assert_same_as_rebuild(tr)


def test_big_batches_with_heavy_duplicates() -> None:
    rng = np.random.default_rng(5)
    for cap in (65, 4097, 70_000):
        tr = T.init(cap)
        ref = np.zeros(cap, np.float32)
        for _ in range(10):
            idx = rng.integers(0, cap, 20_000)
            val = random_leaves(rng, 20_000)
            T.update(tr, idx, val)
            ref[idx] = val  # numpy's fancy assignment is sequential: last write wins
        assert_matches_reference(tr, ref)
        assert_same_as_rebuild(tr)


def test_sorted_batches_equal_a_rebuild() -> None:
    """A sorted batch (a prioritized draw's rows, stratified) takes the update kernel's
    one-pass deduplication of blocks; zeros, -0.0 and denormals in the extremes."""
    rng = np.random.default_rng(8)
    for cap in (64, 1000, 70_001):
        tr = T.init(cap)
        ref = np.zeros(cap, np.float32)
        for _ in range(20):
            idx = np.sort(rng.integers(0, cap, int(rng.integers(1, 600))))
            val = random_leaves(rng, idx.shape[0])
            val[rng.random(idx.shape[0]) < 0.05] = -0.0
            val[rng.random(idx.shape[0]) < 0.05] = 1e-45
            T.update(tr, idx, val)
            ref[idx] = val
        assert_matches_reference(tr, ref)
        assert_same_as_rebuild(tr)


def test_min_and_max_follow_rises_and_falls() -> None:
    tr = T.init(4097)
    T.set_range(tr, 0, 4097, 1.0)
    steps = [([5], 100.0, 1.0, 100.0), ([5], 1.0, 1.0, 1.0), ([4000], 0.125, 0.125, 1.0),
             ([4000], 0.0, 1.0, 1.0), ([7], 1.0, 1.0, 1.0), ([0, 4096], 2.0, 1.0, 2.0)]
    for ids, value, low, high in steps:
        T.update(tr, ids, value)
        assert (T.min_live(tr), T.max_live(tr)) == (low, high)
        assert T.check(tr) == 0.0


def test_last_write_wins_with_heavy_duplicates() -> None:
    tr = T.init(65)
    idx = np.array([3, 64, 3, 3, 0, 64, 3], dtype=np.int32)
    val = np.array([1, 2, 3, 4, 5, 6, 7], dtype=np.float64)
    T.update(tr, idx, val)
    assert tr.leaves[[0, 3, 64]].tolist() == [5.0, 7.0, 6.0]
    assert T.total(tr) == 18.0 and T.min_live(tr) == 5.0 and T.max_live(tr) == 7.0


def test_update_input_forms() -> None:
    tr = T.init(300)
    T.update(tr, np.array([[1, 2], [3, 299]]), 1.5)  # 2-D ids, scalar broadcast
    T.update(tr, torch.tensor([4, 5]), torch.tensor([2.0, 3.0]))
    T.update(tr, [], [])  # no-op
    T.update(tr, np.array([], dtype=np.int64), 1.0)
    T.update(tr, np.array([[7], [8]]), np.array([[1.0], [2.0]]))
    T.update(tr, np.array([9, 10], dtype=np.uint32), np.array([4.0]))  # [1] broadcasts
    ref = np.zeros(300, np.float32)
    ref[[1, 2, 3, 299]] = 1.5
    ref[[4, 5]] = [2.0, 3.0]
    ref[[7, 8]] = [1.0, 2.0]
    ref[[9, 10]] = 4.0
    assert_matches_reference(tr, ref)


@pytest.mark.parametrize("bad", [[-1], [300], [0, 5, 1000]])
def test_update_refuses_out_of_range_ids_and_changes_nothing(bad: list[int]) -> None:
    tr = T.init(300)
    T.update(tr, [10], [1.0])
    before = [a.copy() for a in (tr.leaves, tr.nodes)]
    with pytest.raises(errors.InvalidArgumentError, match=r"\[0, 300\)"):
        T.update(tr, bad, 9.0)
    for a, b in zip(before, (tr.leaves, tr.nodes)):
        np.testing.assert_array_equal(a, b)


def test_update_refuses_bad_kinds() -> None:
    tr = T.init(10)
    with pytest.raises(errors.InvalidArgumentError, match="integers"):
        T.update(tr, [1.5], [1.0])
    with pytest.raises(errors.InvalidArgumentError, match="broadcastable"):
        T.update(tr, [1, 2, 3], [1.0, 2.0])


@pytest.mark.parametrize("cap", CAPACITIES)
def test_set_range_matches_reference_and_update(cap: int) -> None:
    rng = np.random.default_rng(100 + cap)
    tr, twin = T.init(cap), T.init(cap)
    ref = np.zeros(cap, np.float32)
    for k in range(25):
        a, b = np.sort(rng.integers(0, cap + 1, 2))
        value: float | np.ndarray = float(rng.random()) if k % 3 else random_leaves(rng, int(b - a))
        if k % 7 == 6:
            a, b, value = 0, cap, 0.0  # evict all
        T.set_range(tr, int(a), int(b), value)
        ref[a:b] = value
        T.update(twin, np.arange(a, b), np.broadcast_to(np.asarray(value, np.float32), (b - a,)))
    assert_matches_reference(tr, ref)
    for name in ("leaves", "nodes"):  # slices and batches agree bit for bit
        np.testing.assert_array_equal(getattr(tr, name), getattr(twin, name))
    T.set_range(tr, 3 % cap, 3 % cap, 5.0)  # empty range: no-op
    assert_matches_reference(tr, ref)


@pytest.mark.parametrize("start,stop", [(-1, 3), (5, 4), (0, 101)])
def test_set_range_refuses_bad_ranges(start: int, stop: int) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="start"):
        T.set_range(T.init(100), start, stop, 1.0)


def test_set_range_refuses_mismatched_values() -> None:
    tr = T.init(100)
    with pytest.raises(errors.InvalidArgumentError, match=r"shape \(10,\)"):
        T.set_range(tr, 0, 10, np.ones(9))
    assert T.total(tr) == 0.0


def test_sums_exact_after_a_million_updates() -> None:
    cap = 4097
    rng = np.random.default_rng(7)
    tr = T.init(cap)
    for step in range(1000):  # 10^6 updates in batches of 1000, values spanning 1e-8..1e8
        idx = rng.integers(0, cap, 1000)
        val = (10.0 ** rng.uniform(-8, 8, 1000)).astype(np.float32)
        val[rng.random(1000) < 0.2] = 0.0
        T.update(tr, idx, val)
        if step % 100 == 99:
            a = int(rng.integers(0, cap))
            T.set_range(tr, a, min(cap, a + 300), float(rng.random()))
    assert_same_as_rebuild(tr)
    assert T.check(tr) == 0.0
    assert T.total(tr) == pytest.approx(math.fsum(tr.leaves.tolist()), rel=1e-12)


@pytest.mark.parametrize("cap", [65, 1000, 4097])
def test_rebuild_restores_garbage(cap: int) -> None:
    rng = np.random.default_rng(cap)
    tr = T.init(cap)
    T.update(tr, np.arange(cap), random_leaves(rng, cap))
    expected = tr.nodes.copy()
    tr.sums[:] = -1.0  # garbage everywhere, padding included
    tr.min_codes[:] = 5
    tr.maxs[:] = 7.0
    assert T.check(tr) == math.inf
    T.rebuild(tr)
    np.testing.assert_array_equal(tr.nodes, expected)
    assert T.check(tr) == 0.0


def test_check_reports_corruption() -> None:
    rng = np.random.default_rng(3)
    cap = 5000  # 79 blocks: a root row over 5 rows
    tr = T.init(cap)
    T.update(tr, np.arange(cap), random_leaves(rng, cap))
    assert T.check(tr) == 0.0
    tr.sums[1, 3] *= 1 + 1e-9  # a block sum
    assert 0 < T.check(tr) < 1e-8
    T.rebuild(tr)
    tr.sums[0, 1] *= 1 + 1e-9  # a row's total in its parent
    assert 0 < T.check(tr) < 1e-8
    T.rebuild(tr)
    tr.min_codes[0, 1] = K.encode_min(np.float32(0.001))
    assert T.check(tr) == math.inf
    T.rebuild(tr)
    tr.maxs[0, 1] = 1.5
    assert T.check(tr) == math.inf
    T.rebuild(tr)
    for pad in (tr.maxs, tr.min_codes, tr.sums):  # a padding slot
        pad[-1, -1] = 1
        assert T.check(tr) == math.inf
        T.rebuild(tr)
    assert T.check(tr) == 0.0
    for bad in (-1.0, np.nan, np.inf):
        tr.leaves[17] = bad
        assert T.check(tr) == math.inf
    tr.leaves[17] = 0.5
    T.rebuild(tr)
    tr.sums[0, 1] = np.nan
    assert T.check(tr) == math.inf


# -- reads -----------------------------------------------------------------------


@pytest.mark.parametrize("cap", CAPACITIES)
def test_find_prefix_exact_on_integer_priorities(cap: int) -> None:
    # Small integers: every partial sum is exact in float64, so the result
    # must equal searchsorted on the cumsum everywhere, boundaries included.
    rng = np.random.default_rng(300 + cap)
    leaves = rng.integers(0, 5, cap).astype(np.float32)
    leaves[rng.integers(0, cap)] = 3.0
    tr = T.init(cap)
    T.update(tr, np.arange(cap), leaves)
    cs = np.cumsum(leaves.astype(np.float64))
    tot = cs[-1]
    targets = np.concatenate([rng.random(3000) * tot, cs, [0.0, tot - 0.5]])
    targets = targets[targets < tot]
    got = T.find_prefix(tr, targets)
    want = np.searchsorted(cs, targets, side="right")
    np.testing.assert_array_equal(got, want)
    assert (leaves[got] > 0).all()


@pytest.mark.parametrize("cap", CAPACITIES)
def test_find_prefix_matches_searchsorted(cap: int) -> None:
    rng = np.random.default_rng(400 + cap)
    leaves = random_leaves(rng, cap, zero_frac=0.5)
    leaves[rng.integers(0, cap)] = 0.5
    tr = T.init(cap)
    T.update(tr, np.arange(cap), leaves)
    cs = np.cumsum(leaves.astype(np.float64))
    tot = T.total(tr)
    targets = (rng.random(20_000) * tot).reshape(100, 200)
    got = T.find_prefix(tr, targets)
    assert got.shape == targets.shape and got.dtype == np.int64
    want = np.searchsorted(cs, targets, side="right")
    off = got != want
    # Disagreement only where rounding decides: within a hair of a boundary.
    near = np.abs(targets[off] - cs[np.minimum(want[off], got[off])]) <= 1e-12 * tot
    assert near.all(), (targets[off][~near], got[off][~near], want[off][~near])
    assert off.mean() < 1e-3


@pytest.mark.parametrize("cap", CAPACITIES)
def test_find_prefix_never_returns_zero_leaf(cap: int) -> None:
    rng = np.random.default_rng(500 + cap)
    for trial in range(6):
        leaves = (10.0 ** rng.uniform(-8, 8, cap)).astype(np.float32)
        leaves[rng.random(cap) < 0.8] = 0.0
        if trial == 0:  # a single live leaf, last of the last (partial) block
            leaves[:] = 0.0
            leaves[-1] = 1e-8
        if trial == 1:  # a single live leaf at row 0
            leaves[:] = 0.0
            leaves[0] = 1e8
        if not leaves.any():
            leaves[rng.integers(0, cap)] = 1e-3
        tr = T.init(cap)
        T.update(tr, np.arange(cap), leaves)
        tot = T.total(tr)
        cs = np.cumsum(leaves.astype(np.float64))
        block_cs = np.cumsum(tr.sums[-(-(-cap // 64) // 16) :].reshape(-1))
        edges = np.array([0.0, -1.0, tot, np.nextafter(tot, 0), 2 * tot, np.inf, 1e-300])
        targets = np.concatenate([rng.random(5000) * tot, cs, np.nextafter(cs, 0), block_cs, edges])
        got = T.find_prefix(tr, targets)
        assert ((got >= 0) & (got < cap)).all()
        assert (leaves[got] > 0).all()
        last = np.flatnonzero(leaves)[-1]
        assert (got[targets >= tot] == last).all()


def test_find_prefix_and_sample_refuse_empty_tree() -> None:
    tr = T.init(100)
    with pytest.raises(errors.EmptyBufferError):
        T.find_prefix(tr, [0.0])
    with pytest.raises(errors.EmptyBufferError):
        T.sample(tr, 4)
    T.set_range(tr, 10, 20, 1.0)
    T.sample(tr, 4)
    T.set_range(tr, 0, 100, 0.0)
    with pytest.raises(LookupError):  # EmptyBufferError is a LookupError
        T.sample(tr, 4)


def test_sample_basics() -> None:
    rng = np.random.default_rng(9)
    cap = 1000
    leaves = random_leaves(rng, cap, zero_frac=0.6)
    tr = T.init(cap)
    T.update(tr, np.arange(cap), leaves)
    idx, p = T.sample(tr, 256, torch.Generator().manual_seed(1))
    assert idx.shape == p.shape == (256,)
    assert idx.dtype == np.int64 and p.dtype == np.float64
    assert (np.diff(idx) >= 0).all()
    assert (leaves[idx] > 0).all()
    np.testing.assert_allclose(p, leaves[idx].astype(np.float64) / T.total(tr), rtol=1e-15)
    again, _ = T.sample(tr, 256, torch.Generator().manual_seed(1))
    np.testing.assert_array_equal(idx, again)
    other, _ = T.sample(tr, 256, torch.Generator().manual_seed(2))
    assert not np.array_equal(idx, other)
    torch.manual_seed(0)
    default, _ = T.sample(tr, 8)
    assert default.shape == (8,)
    empty, pe = T.sample(tr, 0)
    assert empty.shape == pe.shape == (0,)
    with pytest.raises(errors.InvalidArgumentError, match="batch_size"):
        T.sample(tr, -1)


def chi2_upper_quantile(df: int, z: float = 3.090232306167813) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at N(0,1) quantile z."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


@pytest.mark.parametrize("cap,batch", [(50, 1000), (4097, 4000)])
def test_sample_frequencies_chi_square(cap: int, batch: int) -> None:
    rng = np.random.default_rng(11)
    leaves = (rng.random(cap) * 0.9 + 0.1).astype(np.float32)
    leaves[rng.random(cap) < 0.25] = 0.0
    tr = T.init(cap)
    T.update(tr, np.arange(cap), leaves)
    g = torch.Generator().manual_seed(123)
    counts = np.zeros(cap, dtype=np.int64)
    draws = 0
    while draws < 60 * cap and draws < 300_000:
        idx, _ = T.sample(tr, batch, g)
        counts += np.bincount(idx, minlength=cap)
        draws += batch
    p = leaves.astype(np.float64) / leaves.astype(np.float64).sum()
    assert counts[p == 0].sum() == 0
    live = p > 0
    expected = draws * p[live]
    assert expected.min() >= 5
    stat = float((((counts[live] - expected) ** 2) / expected).sum())
    assert stat < chi2_upper_quantile(int(live.sum()) - 1)  # p > 0.001


def test_chi2_quantile_approximation() -> None:
    # Known values: chi2.ppf(0.999, 10) = 29.588, chi2.ppf(0.999, 100) = 149.449
    assert chi2_upper_quantile(10) == pytest.approx(29.588, rel=1e-2)
    assert chi2_upper_quantile(100) == pytest.approx(149.449, rel=1e-3)


# -- memory-mapped arrays ------------------------------------------------------------


def test_memmap_backed_tree(tmp_path: object) -> None:
    cap = 4097
    rng = np.random.default_rng(12)
    lay = T.layout(cap)
    maps = {
        name: np.lib.format.open_memmap(
            f"{tmp_path}/{name}.npy", mode="w+", dtype=dtype, shape=shape
        )
        for name, (shape, dtype) in lay.items()
    }
    tr = T.PriorityTree(**maps)  # fresh files are zeros: an empty tree
    ram = T.init(cap)
    for _ in range(20):
        idx = rng.integers(0, cap, 300)
        val = random_leaves(rng, 300)
        T.update(tr, idx, val)
        T.update(ram, idx, val)
    T.set_range(tr, 100, 900, 0.25)
    T.set_range(ram, 100, 900, 0.25)
    for m in maps.values():
        m.flush()
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a, pa = T.sample(tr, 512, g1)
    b, pb = T.sample(ram, 512, g2)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(pa, pb)
    # a reader maps the same files read-only and samples the same batch
    ro = T.PriorityTree(**{n: np.load(f"{tmp_path}/{n}.npy", mmap_mode="r") for n in lay})
    c, pc = T.sample(ro, 512, torch.Generator().manual_seed(5))
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(pa, pc)
    assert T.check(ro) == 0.0
    for name in lay:
        np.testing.assert_array_equal(getattr(ro, name), getattr(ram, name))


def _mapped_kib(path: str) -> int:
    """Resident KiB of this process's maps of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                inside = head[-1] == path
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("fallback", [False, True])
def test_warm_maps_every_page(tmp_path: object, monkeypatch: pytest.MonkeyPatch, fallback: bool) -> None:
    cap = 1_000_003
    lay = T.layout(cap)
    files = {name: f"{tmp_path}/{name}.npy" for name in lay}
    maps = {n: np.lib.format.open_memmap(files[n], mode="w+", dtype=d, shape=s) for n, (s, d) in lay.items()}
    tr = T.PriorityTree(**maps)
    T.set_range(tr, 0, cap, np.random.default_rng(0).random(cap).astype(np.float32))
    expected = {n: np.array(a) for n, a in maps.items()}
    for m in maps.values():
        m.flush()
    del tr, maps
    ro = T.PriorityTree(**{n: np.load(files[n], mmap_mode="r") for n in lay})
    assert _mapped_kib(files["leaves"]) < 64  # a fresh map: nothing resident yet
    if fallback:  # the portable path: one read per page
        monkeypatch.setattr(_format.sys, "platform", "other")
    for arr in ro.arrays:
        _format.populate(arr)
    for name in lay:
        assert _mapped_kib(files[name]) * 1024 >= expected[name].nbytes - 4096, name
        np.testing.assert_array_equal(getattr(ro, name), expected[name])
    for arr in T.init(100).arrays:
        _format.populate(arr)  # arrays in RAM: left alone
    assert T.check(ro) == 0.0


# -- range queries -------------------------------------------------------------


def random_ranges(rng: np.random.Generator, cap: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = rng.integers(0, cap + 1, k), rng.integers(0, cap + 1, k)
    short = rng.random(k) < 0.3  # many ranges inside one block or a few blocks
    b[short] = np.minimum(a[short] + rng.integers(0, 130, int(short.sum())), cap)
    return np.minimum(a, b), np.maximum(a, b)


@pytest.mark.parametrize("cap", CAPACITIES + [70_000])
def test_range_sums_match_reference(cap: int) -> None:
    rng = np.random.default_rng(cap)
    leaves = random_leaves(rng, cap) * (10.0 ** rng.uniform(-6, 6, cap)).astype(np.float32)
    tr = T.init(cap)
    T.update(tr, np.arange(cap), leaves)
    a, b = random_ranges(rng, cap, 1000)
    a[:3], b[:3] = [0, 0, cap], [cap, 0, cap]  # everything, and empty ranges
    want = np.array([math.fsum(leaves[x:y].astype(np.float64)) for x, y in zip(a, b)])
    np.testing.assert_allclose(T.range_sums(tr, a, b), want, rtol=1e-13, atol=0)
    got2d = T.range_sums(tr, a[:6].reshape(2, 3), b[:6].reshape(2, 3))
    assert got2d.shape == (2, 3)


def test_range_sums_keep_tiny_mass_next_to_huge() -> None:
    # a difference of running sums would give 0 (or noise) for the tiny ranges
    cap = 5000
    leaves = np.full(cap, 1e30, np.float32)
    tiny = np.array([7, 63, 64, 1000, 1023, 4999])
    leaves[tiny] = np.float32(1e-30)
    tr = T.init(cap)
    T.update(tr, np.arange(cap), leaves)
    got = T.range_sums(tr, tiny, tiny + 1)
    np.testing.assert_allclose(got, np.float32(1e-30), rtol=1e-12)
    idx, val = T.find_in_ranges(tr, tiny, tiny + 1, np.zeros(len(tiny)))
    np.testing.assert_array_equal(idx, tiny)


@pytest.mark.parametrize("cap", CAPACITIES + [70_000])
def test_find_in_ranges_matches_reference(cap: int) -> None:
    rng = np.random.default_rng(cap + 1)
    leaves = random_leaves(rng, cap, zero_frac=0.5) * (10.0 ** rng.uniform(-6, 6, cap)).astype(np.float32)
    leaves[0] = 1.0
    tr = T.init(cap)
    T.update(tr, np.arange(cap), leaves)
    a, b = random_ranges(rng, cap, 3000)
    mass = T.range_sums(tr, a, b)
    keep = mass > 0
    a, b, mass = a[keep], b[keep], mass[keep]
    u = rng.random(len(a))
    u[:5] = [0.0, 1.0, 2.0, -1.0, np.nextafter(1.0, 0.0)]  # edges, past the end, negative
    idx, val = T.find_in_ranges(tr, a, b, u * mass)
    assert ((idx >= a) & (idx < b)).all() and (val > 0).all()
    np.testing.assert_array_equal(val, leaves[idx])
    for x, y, t, i in zip(a, b, u * mass, idx):
        seg = leaves[x:y].astype(np.float64)
        nz = np.flatnonzero(seg > 0)
        if t >= seg.sum():
            assert i == x + nz[-1]
        elif t <= 0:
            assert i == x + nz[0]
        else:
            cum = np.cumsum(seg)
            j = int(np.searchsorted(cum, t, side="right"))
            # a target within rounding of a boundary may go either way, never to a zero leaf
            assert i == x + j or abs(t - cum[min(j, len(cum) - 1)]) <= 1e-12 * seg.sum() or abs(t - cum[j - 1]) <= 1e-12 * seg.sum()


def test_find_in_ranges_frequencies_chi_square() -> None:
    rng = np.random.default_rng(3)
    cap = 4097
    leaves = random_leaves(rng, cap)
    tr = T.init(cap)
    T.update(tr, np.arange(cap), leaves)
    a, b = 100, 3000  # spans several blocks and rows of slots
    n = 200_000
    idx, _ = T.find_in_ranges(tr, np.full(n, a), np.full(n, b), rng.random(n) * T.range_sums(tr, [a], [b])[0])
    counts = np.bincount(idx - a, minlength=b - a)
    p = leaves[a:b].astype(np.float64) / leaves[a:b].astype(np.float64).sum()
    keep = p > 0
    assert counts[~keep].sum() == 0
    stat = float(((counts[keep] - n * p[keep]) ** 2 / (n * p[keep])).sum())
    assert stat < chi2_upper_quantile(int(keep.sum()) - 1)


def test_range_queries_refuse_bad_arguments() -> None:
    tr = T.init(100)
    T.update(tr, [5], [1.0])
    for a, b in (([-1], [3]), ([5], [4]), ([0], [101])):
        with pytest.raises(errors.InvalidArgumentError, match="expected 0 <= start <= stop <= 100"):
            T.range_sums(tr, a, b)
    with pytest.raises(errors.InvalidArgumentError, match="starts: expected integers"):
        T.range_sums(tr, [0.5], [3])
    with pytest.raises(errors.InvalidArgumentError, match="stops: expected the shape"):
        T.range_sums(tr, [0, 1], [3])
    with pytest.raises(errors.InvalidArgumentError, match="expected start < stop"):
        T.find_in_ranges(tr, [3], [3], [0.0])
    with pytest.raises(errors.InvalidArgumentError, match="targets: expected the shape"):
        T.find_in_ranges(tr, [0], [10], [0.0, 1.0])
    idx, val = T.find_in_ranges(tr, [6, 70], [100, 100], [0.0, 1.0])  # no positive leaf: value 0, still in range
    assert idx.tolist() == [6, 70] and val.tolist() == [0.0, 0.0]


def test_doctests() -> None:
    modules = [T, *(importlib.import_module(f"{T.__name__}.{m.name}") for m in pkgutil.iter_modules(T.__path__))]
    results = [doctest.testmod(m, optionflags=doctest.NORMALIZE_WHITESPACE) for m in modules]
    assert sum(r.attempted for r in results) > 20
    assert sum(r.failed for r in results) == 0


# -- sparse, lazy tree -----------------------------------------------------------


def _disk_bytes(root: str) -> int:
    """Bytes of disk allocated under ``root`` (st_blocks, not file sizes)."""
    import os

    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(root) for f in fs)


def _sparse_files(tmp_path: object) -> bool:
    import os

    probe = f"{tmp_path}/probe"
    with open(probe, "wb") as f:
        f.truncate(1 << 30)
    sparse = os.stat(probe).st_blocks * 512 < (1 << 20)
    os.unlink(probe)
    return sparse


def test_untouched_tree_regions_cost_nothing(tmp_path: object) -> None:
    if not _sparse_files(tmp_path):
        pytest.skip("this filesystem has no sparse files")
    cap = 3 * 2**30 + 5  # 12 GiB of leaves as a sparse file
    maps = {n: np.memmap(f"{tmp_path}/{n}", mode="w+", dtype=d, shape=s) for n, (s, d) in T.layout(cap).items()}
    tr = T.PriorityTree(**maps)  # zero bytes: an empty tree, nothing written
    assert (T.total(tr), T.min_live(tr)) == (0.0, math.inf)
    rng = np.random.default_rng(0)
    rows = np.concatenate([np.arange(1000), cap - 1 - np.arange(50), rng.integers(0, cap, 20)])
    vals = random_leaves(rng, rows.shape[0], zero_frac=0.0)
    T.update(tr, rows, vals)
    T.set_range(tr, 5000, 6000, 0.5)
    T.set_range(tr, 2**31, 2**31 + 10**6, 0.0)  # evicting never-written rows writes nothing
    idx, p = T.sample(tr, 4096, torch.Generator().manual_seed(0))
    live = np.union1d(rows, np.arange(5000, 6000))
    assert np.isin(idx, live).all()
    ref = math.fsum(vals[np.unique(rows, return_index=True)[1]].tolist()) + 500.0
    assert T.total(tr) == pytest.approx(ref, rel=1e-12)
    # check and rebuild over the written spans: O(their rows), never the 12 GiB
    spans = [(0, 6000), (cap - 50, cap)] + [(int(r), int(r) + 1) for r in rows[-20:]]
    assert T.check(tr, spans=spans) == 0.0
    assert T.check(tr, spans=spans[:1]) == math.inf  # the last rows are outside: refused
    for lo, hi in T.node_rows(tr, 0, 6000):  # nodes wrong above the first span
        tr.sums[lo:hi] *= 1.5
    assert T.check(tr, spans=spans) > 0.1
    T.rebuild(tr, spans=spans)
    assert T.check(tr, spans=spans) == 0.0
    for m in maps.values():
        m.flush()
    assert _disk_bytes(str(tmp_path)) < 4 << 20


def test_store_with_priorities_is_created_sparse(tmp_path: object) -> None:
    if not _sparse_files(tmp_path):
        pytest.skip("this filesystem has no sparse files")
    import mmbuffer as mb

    path = f"{tmp_path}/s"
    buf = mb.create(path, {"x": ((), "uint8")}, capacity=3_000_000_000, num_streams=2, next_keys=(),
                    priorities=mb.PriorityConfig(alpha=1.0, eps=0.0))
    assert _disk_bytes(path) < 100 << 20
    n = 3000
    for lane in (0, 1):
        buf.extend({"x": np.zeros(n, np.uint8), "truncated": np.arange(n) % 1000 == 999}, stream=lane)
    buf.update_priorities(np.array([1, 2, 1_500_000_001]), np.array([4.0, 5.0, 6.0]))
    buf.commit()
    ro = mb.open(path, mode="r")
    rows, _, _ = ro.sample_indices(256, torch.Generator().manual_seed(0), prioritized=True)
    assert ((rows < n) | ((rows >= 1_500_000_000) & (rows < 1_500_000_000 + n))).all()
    # what verify checks of the tree: the rows below the reservations only
    assert T.check(ro.view().tree, spans=ro.tree_spans()) == 0.0
    ro.close()
    buf.close()
    open(f"{path}/priority/DIRTY", "w").close()  # as a writer killed mid-update leaves it
    buf = mb.open(path, mode="a")  # recovery rebuilds the tree over the written rows only
    assert buf.leaf_priorities([1, 2, 1_500_000_001]).tolist() == [4.0, 5.0, 6.0]
    assert T.check(buf.view().tree, spans=buf.tree_spans()) == 0.0
    assert T.total(buf.view().tree) == 2 * n - 3 + 15.0  # the default 1.0 elsewhere
    # verify and its repair rebuild a ring of 16 bytes per row of capacity (48 GB
    # here): they allocate it sparse (a MemoryError once)
    from mmbuffer._ledger.verify import verify

    assert verify(buf)["ok"]
    buf.view().tree.leaves[5] = 9.0  # a leaf changed behind the tree's back
    report = verify(buf, repair=True)
    assert not report["ok"] and report["repaired"] and verify(buf)["ok"]
    assert T.total(buf.view().tree) == 2 * n - 3 + 15.0 + 8.0
    buf.close()
    assert _disk_bytes(path) < 100 << 20


def test_torn_reads_give_valid_rows() -> None:
    # a reader racing a writer can see nodes that disagree with the leaves: the
    # descent still returns row ids in range, and a positive leaf wherever its
    # block has one
    cap = 5000
    leaves = np.ones(cap, np.float32)
    tr = T.init(cap)
    T.update(tr, np.arange(cap), leaves)
    tr.leaves[64:128] = 0.0  # block 1 zeroed behind the tree's back
    tr.leaves[4000:4010] = 0.0  # part of a block
    targets = np.linspace(0, T.total(tr), 20_001)
    got = T.find_prefix(tr, targets)
    assert ((got >= 0) & (got < cap)).all()
    inside = (got >= 64) & (got < 128)
    assert (tr.leaves[got[~inside]] > 0).all()  # only the all-zero block gives a zero leaf
    assert inside.sum() <= 64 * 20_001 / cap + 2
