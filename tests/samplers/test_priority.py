"""Prioritized replay on the store: distributions, weights, defaults, staleness, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer import tree as T
from conftest import tree_hash
from test_sampling import chi2_pvalue


def make(tmp_path, capacity=1000, streams=1, alpha=0.6, eps=1e-6, max_priority=1.0, next_keys=()):
    return mb.create(
        tmp_path / "p", {"x": ((), "int64")}, capacity=capacity, num_streams=streams, next_keys=next_keys,
        priorities=mb.PriorityConfig(alpha=alpha, eps=eps, max_priority=max_priority),
    )


def fill(buf, n, ep_len=10, stream=0):
    rows = np.arange(n)
    buf.extend({"x": rows, "terminated": rows % ep_len == ep_len - 1}, stream=stream)


def test_transitions_follow_priorities(tmp_path, rng):
    buf = make(tmp_path, capacity=400)
    fill(buf, 400)
    raw = 10.0 ** rng.uniform(-8, 8, 400)
    buf.update_priorities(torch.arange(400), raw)
    p = (raw + 1e-6) ** 0.6
    g = torch.Generator().manual_seed(0)
    counts = np.zeros(400)
    for _ in range(20):
        counts += np.bincount(buf.sample(10_000, prioritized=True, generator=g).indices.numpy(), minlength=400)
    expected = p / p.sum() * counts.sum()
    # group rows of tiny expectation together so every cell expects >= 5 draws
    order = np.argsort(expected)
    cum = np.cumsum(expected[order])
    groups = np.minimum((cum // 20).astype(int), int(cum[-1] // 20) - 1)
    obs = np.bincount(groups, weights=counts[order])
    exp = np.bincount(groups, weights=expected[order])
    assert chi2_pvalue(obs, exp) > 0.001
    assert counts[p / p.sum() < 1e-12].sum() == 0


def test_weights_match_a_float64_reference(tmp_path, rng):
    buf = make(tmp_path, capacity=300, alpha=0.7, eps=0.01)
    fill(buf, 300)
    raw = rng.uniform(0, 5, 300)
    buf.update_priorities(torch.arange(300), raw)
    b = buf.sample(512, prioritized=True, beta=0.5, generator=torch.Generator().manual_seed(1))
    p = (raw + 0.01) ** 0.7
    prob = p / p.sum()
    n = 300
    w = (n * prob) ** -0.5
    want = w[b.indices.numpy()] / w.max()
    np.testing.assert_allclose(b.weights.numpy(), want, rtol=1e-6)


def test_prioritized_slices_start_only_at_valid_starts(tmp_path, rng):
    buf = make(tmp_path, capacity=600, next_keys=())
    lengths = [3, 20, 7, 50, 2, 40, 9, 30]
    done = np.zeros(sum(lengths), bool)
    done[np.cumsum(lengths) - 1] = True
    buf.extend({"x": np.arange(len(done)), "terminated": done})
    raw = 10.0 ** rng.uniform(-4, 4, len(done))
    buf.update_priorities(torch.arange(len(done)), raw)
    L = 8
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    valid = np.concatenate([s + np.arange(n - L + 1) for s, n in zip(starts, lengths) if n >= L])
    p = (raw + 1e-6) ** 0.6
    g = torch.Generator().manual_seed(2)
    counts = np.zeros(len(done))
    for _ in range(10):
        b = buf.sample_slices(5000, L, prioritized=True, beta=1.0, generator=g, keys=["terminated"])
        assert not b.data["terminated"][:, :-1].any()
        counts += np.bincount(b.indices[:, 0].numpy(), minlength=len(done))
    invalid = np.setdiff1d(np.arange(len(done)), valid)
    assert counts[invalid].sum() == 0  # probability exactly 0
    expected = p[valid] / p[valid].sum() * counts.sum()
    order = np.argsort(expected)
    cum = np.cumsum(expected[order])
    groups = np.minimum((cum // 20).astype(int), int(cum[-1] // 20) - 1)
    assert chi2_pvalue(np.bincount(groups, weights=counts[valid][order]), np.bincount(groups, weights=expected[order])) > 0.001
    w = b.weights.numpy()
    np.testing.assert_allclose(w, (p[b.indices[:, 0].numpy()] / p.min()) ** -1.0, rtol=1e-6)


def test_default_priority_follows_the_live_max(tmp_path):
    alpha = 0.5
    buf = make(tmp_path, capacity=10, alpha=alpha, eps=0.0, max_priority=100.0)
    leaves = lambda: buf.view().tree.leaves[:10].astype(float)  # noqa: E731
    buf.extend({"x": np.arange(2)})
    np.testing.assert_allclose(leaves()[:2], 1.0)  # empty buffer: 1, as TorchRL
    buf.update_priorities(torch.tensor([0, 1]), torch.tensor([4.0, 9.0]))
    buf.extend({"x": np.arange(2)})
    np.testing.assert_allclose(leaves()[2:4], 3.0)  # the live max (sqrt 9), not the historical 10
    buf.update_priorities(torch.tensor([1, 2, 3]), torch.tensor([1.0, 1.0, 1.0]))
    buf.extend({"x": np.arange(1)})
    np.testing.assert_allclose(leaves()[4], 2.0)  # the max was lowered: the next default follows (sqrt 4)
    buf.update_priorities(torch.tensor([0, 1, 2, 3, 4]), torch.zeros(5))
    buf.extend({"x": np.arange(1)})
    np.testing.assert_allclose(leaves()[5], 1.0)  # all zero: 1
    buf.update_priorities(torch.tensor([5]), torch.tensor([10_000.0]))
    buf.extend({"x": np.arange(1)})
    np.testing.assert_allclose(leaves()[6], 10.0)  # capped by max_priority ** alpha
    # eviction of the row holding the max: the ring overwrites rows 0.. (an open episode
    # of 10 rows fills the lane; end it so the next write evicts)
    buf.extend({"x": np.arange(3), "terminated": [False, False, True]})
    buf.update_priorities(torch.arange(10), torch.tensor([1.0, 1, 1, 1, 1, 1, 1, 1, 1, 81.0]))
    buf.extend({"x": np.arange(1)})  # overwrites row 0, evicting the episode 0..9 (max at 9)
    assert leaves()[9] == 0 and buf.num_episodes == 0
    np.testing.assert_allclose(leaves()[0], 1.0)  # nothing live holds a priority: 1


def test_stale_updates_are_ignored(tmp_path):
    buf = make(tmp_path, capacity=20)
    fill(buf, 20)
    b = buf.sample(8, prioritized=True, generator=torch.Generator().manual_seed(0))
    fill(buf, 10)  # overwrites rows 0..9 (and evicts their episodes)
    before = buf.view().tree.leaves[:20].copy()
    buf.update_priorities(b.indices, torch.full((8,), 50.0))
    after = buf.view().tree.leaves[:20]
    stale = b.indices.numpy() < 10
    for r in b.indices[~torch.from_numpy(stale)].tolist():
        assert after[r] == pytest.approx((50.0 + 1e-6) ** 0.6, rel=1e-6)
    for r in b.indices[torch.from_numpy(stale)].tolist():
        assert after[r] == before[r]
    assert stale.any() and (~stale).any()


def test_slice_priorities_broadcast_and_duplicates_last_write_wins(tmp_path):
    buf = make(tmp_path, capacity=100)
    fill(buf, 100, ep_len=20)
    b = buf.sample_slices(4, 5, generator=torch.Generator().manual_seed(0))
    buf.update_priorities(b.indices, torch.tensor([1.0, 2.0, 3.0, 4.0]))  # one per slice
    leaves = buf.view().tree.leaves
    want = {}
    for j in range(4):  # overlapping windows: the later slice's value wins
        for r in b.indices[j].tolist():
            want[r] = (j + 1.0 + 1e-6) ** 0.6
    for r, v in want.items():
        assert leaves[r] == pytest.approx(v, rel=1e-6)
    buf.update_priorities(torch.tensor([7, 7, 7]), torch.tensor([1.0, 2.0, 3.0]))
    assert leaves[7] == pytest.approx((3.0 + 1e-6) ** 0.6, rel=1e-6)


def test_bad_priorities_change_nothing(tmp_path):
    buf = make(tmp_path, capacity=50)
    fill(buf, 50)
    buf.commit()
    before = tree_hash(tmp_path / "p")
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(mb.errors.InvalidPriorityError, match="finite values >= 0"):
            buf.update_priorities(torch.tensor([1, 2]), torch.tensor([0.5, bad]))
    with pytest.raises(mb.errors.InvalidPriorityError, match="shape"):
        buf.update_priorities(torch.tensor([1, 2]), torch.tensor([0.5, 0.5, 0.5]))
    with pytest.raises(mb.errors.InvalidArgumentError, match="row ids"):
        buf.update_priorities(torch.tensor([50]), torch.tensor([0.5]))
    for kwargs in ({"beta": -1.0}, {"beta": float("nan")}):
        with pytest.raises(mb.errors.InvalidArgumentError, match="beta"):
            buf.sample(4, prioritized=True, **kwargs)
    assert tree_hash(tmp_path / "p") == before
    plain = mb.create(tmp_path / "q", {"x": ((), "int64")}, capacity=10, next_keys=())
    with pytest.raises(mb.errors.InvalidPriorityError, match="priorities=None"):
        plain.update_priorities(torch.tensor([0]), torch.tensor([1.0]))
    with pytest.raises(mb.errors.InvalidArgumentError):
        mb.PriorityConfig(alpha=-0.1)



def test_priorities_with_trailing_singleton_dims(tmp_path):
    """A TD-error head's ``[B, 1]`` for ``[B]`` indices (and ``[B, L, 1]`` for windows)
    sets the same leaves as ``[B]``; any other extra dimension is refused naming both shapes."""
    buf = make(tmp_path, capacity=50)
    fill(buf, 50)
    leaves = buf.view().tree.leaves
    idx = torch.tensor([3, 9, 4])
    buf.update_priorities(idx, torch.tensor([[1.0], [2.0], [3.0]]))
    np.testing.assert_allclose(leaves[[3, 9, 4]], (np.array([1.0, 2.0, 3.0]) + 1e-6) ** 0.6, rtol=1e-6)
    win = torch.tensor([[10, 11], [20, 21]])
    buf.update_priorities(win, np.full((2, 2, 1, 1), 5.0))
    np.testing.assert_allclose(leaves[[10, 11, 20, 21]], (5.0 + 1e-6) ** 0.6, rtol=1e-6)
    before = tree_hash(tmp_path / "p")
    for bad in (torch.ones(3, 2), torch.ones(1, 3), torch.ones(3, 1, 2)):
        with pytest.raises(mb.errors.InvalidPriorityError) as info:
            buf.update_priorities(idx, bad)
        assert "(3,)" in str(info.value) and str(tuple(bad.shape)) in str(info.value)
    assert tree_hash(tmp_path / "p") == before

def test_tree_survives_many_updates_and_reopen(tmp_path, rng):
    buf = make(tmp_path, capacity=5000, streams=5)
    for s in range(5):
        fill(buf, 1000, ep_len=50, stream=s)
    for _ in range(200):
        idx = rng.integers(0, 5000, 5000)
        buf.update_priorities(torch.from_numpy(idx), torch.from_numpy(rng.exponential(size=5000)))
    total = T.total(buf.view().tree)
    buf.close()
    ro = mb.open(tmp_path / "p", mode="r")
    ref = np.sum(ro.view().tree.leaves[:5000].astype(np.float64))
    assert T.total(ro.view().tree) == total
    assert abs(total - ref) <= 1e-9 * ref
    from mmbuffer._ledger.verify import verify

    assert verify(ro)["ok"]


def test_warm_keeps_the_store_unchanged(tmp_path, rng):
    buf = make(tmp_path, capacity=5000)
    fill(buf, 5000)
    buf.update_priorities(torch.arange(5000), torch.from_numpy(rng.exponential(size=5000)))
    buf.close()
    before = tree_hash(tmp_path / "p")
    ro = mb.open(tmp_path / "p", mode="r")
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a = ro.sample_indices(64, g1, prioritized=True)[0]
    ro.warm()
    b = ro.sample_indices(64, g2, prioritized=True)[0]
    np.testing.assert_array_equal(a, b)
    ro.close()
    assert tree_hash(tmp_path / "p") == before
    plain = mb.create(tmp_path / "u", {"x": ((), "int64")}, capacity=10)
    plain.warm()  # no tree: nothing to do
    plain.close()


def test_leaf_priorities_round_trip_and_bad_values_change_nothing(tmp_path, rng):
    buf = make(tmp_path, capacity=500, alpha=0.5, eps=0.0)
    fill(buf, 300)
    buf.update_priorities(np.arange(300), np.arange(300, dtype=np.float64) ** 2)
    np.testing.assert_allclose(buf.leaf_priorities(np.arange(300)), np.arange(300), rtol=1e-6)
    values = rng.exponential(size=300).astype(np.float32)
    buf.set_leaf_priorities(np.arange(300), values)
    np.testing.assert_array_equal(buf.leaf_priorities(np.arange(300)), values)
    assert buf.leaf_priorities([400]).tolist() == [0.0]  # never written: not live
    buf.set_leaf_priorities([400], [5.0])  # not live: ignored
    assert buf.leaf_priorities([400]).tolist() == [0.0]
    buf.commit()
    before = tree_hash(tmp_path / "p")
    for bad in ([np.nan], [-1.0], [np.inf]):
        with pytest.raises(mb.errors.InvalidPriorityError, match="finite values >= 0"):
            buf.set_leaf_priorities([3], bad)
    with pytest.raises(mb.errors.InvalidArgumentError, match=r"indices: expected row ids in \[0, 500\)"):
        buf.leaf_priorities([500])
    assert tree_hash(tmp_path / "p") == before
    plain = mb.create(tmp_path / "u", {"x": ((), "int64")}, capacity=10)
    with pytest.raises(mb.errors.InvalidPriorityError, match="leaf_priorities: expected a store created with priorities"):
        plain.leaf_priorities([0])


# -- exactness of prioritized starts (issue 10, item 3.4) ----------------------------------
def write_episodes(path, rng, streams=3, lane=997, steps=60, with_next=True):
    """A prioritized store of episodes of 1 to ~220 rows in ``streams`` lanes that wrap,
    an open episode per lane. Returns the buffer and, per lane, the live episodes as
    ``(absolute start, sampleable rows, is_open)`` (a naive reference of the index)."""
    buf = mb.create(path, {"x": ((), "int64")}, capacity=streams * lane, num_streams=streams,
                    next_keys=("x",) if with_next else (), priorities=mb.PriorityConfig(alpha=1.0, eps=0.0))
    written, open_start = [0] * streams, [0] * streams
    episodes = [[] for _ in range(streams)]
    for step in range(steps):
        s = step % streams
        lengths = np.where(rng.random(4) < 0.6, rng.integers(1, 6, 4), rng.integers(6, 200, 4))
        done = np.zeros(int(lengths.sum()) + int(rng.integers(0, 20)), dtype=bool)
        done[np.cumsum(lengths) - 1] = True
        rows = np.arange(written[s], written[s] + len(done))
        final = {"x": np.zeros(int(done.sum()), np.int64)} if with_next else None
        buf.extend({"x": rows, "truncated": done}, stream=s, final_obs=final)
        for a in rows[done]:
            episodes[s].append((open_start[s], int(a) + 1 - open_start[s]))
            open_start[s] = int(a) + 1
        written[s] += len(done)
    assert min(written) > 2 * lane  # every ring wrapped
    layout = []
    for s in range(streams):
        live = [(st, n, False) for st, n in episodes[s] if st >= written[s] - lane]
        n_open = written[s] - open_start[s] - (1 if with_next and written[s] > open_start[s] else 0)
        layout.append(live + [(open_start[s], max(n_open, 0), True)])
    return buf, layout


def naive_starts(buf, layout, slice_len, strict=True):
    """Global rows that may start a window (every sampleable row when not strict)."""
    out = [np.zeros(0, np.int64)]
    for s, eps in enumerate(layout):
        for start, n, _ in eps:
            a = start + np.arange(max(0, n - slice_len + 1) if strict else n)
            out.append(s * buf.lane_size + a % buf.lane_size)
    return np.concatenate(out)


def spy_exact(monkeypatch):
    """Count the draws ``sampling.exact`` makes (the fallback of ``sampling.prioritized``)."""
    from mmbuffer.samplers import _draw as sampling

    calls = []
    real = sampling.exact

    def spy(view, ptree, batch_size, *args, **kwargs):
        calls.append(batch_size)
        return real(view, ptree, batch_size, *args, **kwargs)

    monkeypatch.setattr(sampling, "exact", spy)
    return calls


def test_prioritized_slices_never_fail_when_mass_sits_on_invalid_starts(tmp_path, rng):
    # the tester's scenario: many episodes shorter than L with huge priority, a few long
    # ones with tiny priority; before the fix this raised NoValidSliceError
    buf = make(tmp_path, capacity=7000, streams=2, alpha=1.0, eps=0.0)
    L = 16
    short = np.full(500, 3)
    lengths = np.concatenate([short, [40], short, [25], short[:10]])
    ends = np.cumsum(lengths)
    done = np.zeros(int(ends[-1]) + 5, bool)  # + an open episode of 5 rows
    done[ends - 1] = True
    episodes = [(int(e - n), int(n), False) for e, n in zip(ends, lengths)] + [(int(ends[-1]), 5, True)]
    for s in range(2):
        buf.extend({"x": np.arange(len(done)), "terminated": done}, stream=s)
    layout = [episodes, episodes]
    rows = np.arange(buf.capacity)
    valid = naive_starts(buf, layout, L)
    pri = np.full(buf.capacity, 1e30)  # a difference of running sums (~1e34) would lose the valid mass
    pri[valid] = 1e-3
    at_25 = next(a for a, n, _ in episodes if n == 25)
    in_25 = np.concatenate([s * buf.lane_size + at_25 + np.arange(10) for s in range(2)])  # the 25-row episodes
    assert np.isin(in_25, valid).all() and len(valid) == 2 * (25 + 10)
    pri[in_25] = 1e-2  # 0.2 of the valid mass against 0.05 on the 40-row episodes
    buf.update_priorities(rows, pri)
    g = torch.Generator().manual_seed(0)
    starts = []
    for _ in range(5):
        b = buf.sample_slices(512, L, prioritized=True, generator=g, keys=["terminated"])
        starts.append(b.indices[:, 0].numpy())
        assert not b.data["terminated"][:, :-1].any() and b.mask.all()
    starts = np.concatenate(starts)
    assert np.isin(starts, valid).all()
    assert abs(np.isin(starts, in_25).mean() - 0.8) < 0.04  # 5 standard deviations
    # with no positive priority on a valid start the call fails, naming slice_len
    buf.set_leaf_priorities(valid, np.zeros(len(valid), np.float32))
    with pytest.raises(mb.errors.NoValidSliceError,
                       match=r"slice_len: expected valid starts of windows of 16 rows with positive priority, got none"):
        buf.sample_slices(8, L, prioritized=True, generator=g)


def draw_starts(buf, n_calls, batch, slice_len, strict, g):
    counts = np.zeros(buf.capacity)
    for _ in range(n_calls):
        if slice_len is None:
            idx = buf.sample_indices(batch, g, prioritized=True)[0]
        else:
            idx = buf.slice_indices(batch, slice_len, strict, g, prioritized=True)[0][:, 0]
        counts += np.bincount(idx, minlength=buf.capacity)
    return counts


def assert_frequencies(counts, p, valid):
    invalid = np.setdiff1d(np.arange(len(counts)), valid)
    assert counts[invalid].sum() == 0  # probability exactly 0
    expected = p[valid] / p[valid].sum() * counts.sum()
    # group starts of small expectation so every cell expects >= 20 draws
    order = np.argsort(expected)
    cum = np.cumsum(expected[order])
    groups = np.minimum((cum // 20).astype(int), int(cum[-1] // 20) - 1)
    obs = np.bincount(groups, weights=counts[valid][order])
    exp = np.bincount(groups, weights=expected[order])
    assert len(exp) > 50
    assert chi2_pvalue(obs, exp) > 0.001


@pytest.mark.parametrize("regime", ["rejection", "mixed", "exact"])
@pytest.mark.parametrize("slice_len,strict", [(12, True), (12, False), (None, True)])
def test_prioritized_starts_follow_valid_priorities_exactly(tmp_path, monkeypatch, regime, slice_len, strict):
    rng = np.random.default_rng(10)
    buf, layout = write_episodes(tmp_path / "e", rng)
    valid = naive_starts(buf, layout, slice_len or 1, strict)
    # mass on the valid starts against the rest: ~90%, ~35%, ~1% of the live total
    share = {"rejection": 0.9, "mixed": 0.35, "exact": 0.01}[regime]
    live = naive_starts(buf, layout, 1, strict=False)
    live = np.union1d(live, [s * buf.lane_size + (eps[-1][0] + eps[-1][1]) % buf.lane_size
                             for s, eps in enumerate(layout) if buf.next_keys])  # the open episodes' last rows
    p = np.zeros(buf.capacity)
    p[live] = 10.0 ** rng.uniform(-3, 3, len(live))
    is_valid = np.isin(live, valid)
    bad_mass, good_mass = p[live[~is_valid]].sum(), p[valid].sum()
    p[valid] *= share / (1 - share) * bad_mass / good_mass
    p = p.astype(np.float32).astype(np.float64)
    buf.set_leaf_priorities(live, p[live].astype(np.float32))
    assert np.isclose(p[valid].sum() / p.sum(), share, rtol=1e-3)
    calls = spy_exact(monkeypatch)
    counts = draw_starts(buf, 20, 4000, slice_len, strict, torch.Generator().manual_seed(5))
    assert_frequencies(counts, p, valid)
    fallback = sum(calls)
    if regime == "rejection":
        assert fallback == 0
    elif regime == "mixed":
        assert 0 < fallback < 0.2 * counts.sum()  # rejection rounds first, exact for the rest
    else:
        assert fallback > 0.5 * counts.sum()


@pytest.mark.parametrize("regime", ["rejection", "exact"])
def test_prioritized_weights_match_a_float64_reference(tmp_path, regime):
    rng = np.random.default_rng(11)
    buf, layout = write_episodes(tmp_path / "w", rng, with_next=False)
    L = 10
    valid = naive_starts(buf, layout, L)
    live = naive_starts(buf, layout, 1)
    p = np.zeros(buf.capacity)
    p[live] = rng.uniform(0.1, 5.0, len(live))
    if regime == "exact":
        p[np.setdiff1d(live, valid)] *= 1e4
    p = p.astype(np.float32).astype(np.float64)
    buf.set_leaf_priorities(live, p[live].astype(np.float32))
    beta = 0.7
    live = np.sort(live)
    g = torch.Generator().manual_seed(2)
    rows, weights, _, _ = buf.slice_indices(3000, L, generator=g, prioritized=True, beta=beta)
    starts = rows[:, 0]
    assert np.isin(starts, valid).all()
    prob = p[live] / p[valid].sum()  # P(i) of a valid start; the max runs over every live row
    w = (len(live) * prob) ** -beta
    want = w[np.searchsorted(live, starts)] / w.max()
    np.testing.assert_allclose(weights, want, rtol=1e-6)


@pytest.mark.parametrize("slice_len,strict", [(None, True), (1, True), (7, True), (40, True), (7, False)])
@pytest.mark.parametrize("mode", ["a", "r"])
def test_valid_ranges_hold_exactly_the_sampleable_rows(tmp_path, slice_len, strict, mode):
    from mmbuffer.samplers import _draw as sampling

    rng = np.random.default_rng(12)
    buf, layout = write_episodes(tmp_path / "v", rng)
    buf.commit()
    committed = sampling.sampleable(buf.view(), np.arange(buf.capacity), slice_len, strict)
    if mode == "r":  # a reader keeps away from the rows the writer may rewrite
        buf.extend({"x": np.arange(150), "truncated": np.arange(150) % 50 == 49}, stream=1,
                   final_obs={"x": np.zeros(3, np.int64)})
        buf = mb.open(tmp_path / "v", mode="r")
    view = buf.view()
    lo, hi = sampling.valid_ranges(view, slice_len, strict)
    got = np.zeros(buf.capacity, bool)
    for a, b in zip(lo, hi):
        assert not got[a:b].any()  # disjoint
        got[a:b] = True
    want = sampling.sampleable(view, np.arange(buf.capacity), slice_len, strict)
    np.testing.assert_array_equal(got, want)
    if mode == "r":  # the reservation hides committed rows of lane 1 from the reader
        assert not (got & ~committed).any() and (committed & ~got).any()
    else:
        np.testing.assert_array_equal(np.flatnonzero(got), np.sort(naive_starts(buf, layout, slice_len or 1, strict)))
