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
    leaves = lambda: buf._tree.leaves[:10].astype(float)  # noqa: E731
    buf.extend({"x": np.arange(2)})
    np.testing.assert_allclose(leaves()[:2], 100.0**alpha)  # empty buffer: max_priority ** alpha
    buf.update_priorities(torch.tensor([0, 1]), torch.tensor([4.0, 9.0]))
    buf.extend({"x": np.arange(2)})
    np.testing.assert_allclose(leaves()[2:4], 3.0)  # the live max (sqrt 9), not the historical 10
    buf.update_priorities(torch.tensor([1, 2, 3]), torch.tensor([1.0, 1.0, 1.0]))
    buf.extend({"x": np.arange(1)})
    np.testing.assert_allclose(leaves()[4], 2.0)  # the max was lowered: the next default follows (sqrt 4)
    buf.update_priorities(torch.tensor([0, 1, 2, 3, 4]), torch.zeros(5))
    buf.extend({"x": np.arange(1)})
    np.testing.assert_allclose(leaves()[5], 10.0)  # all zero: max_priority ** alpha
    buf.update_priorities(torch.tensor([5]), torch.tensor([10_000.0]))
    buf.extend({"x": np.arange(1)})
    np.testing.assert_allclose(leaves()[6], 10.0)  # capped by max_priority ** alpha
    # eviction of the row holding the max: the ring overwrites rows 0.. (an open episode
    # of 10 rows fills the lane; end it so the next write evicts)
    buf.extend({"x": np.arange(3), "terminated": [False, False, True]})
    buf.update_priorities(torch.arange(10), torch.tensor([1.0, 1, 1, 1, 1, 1, 1, 1, 1, 81.0]))
    buf.extend({"x": np.arange(1)})  # overwrites row 0, evicting the episode 0..9 (max at 9)
    assert leaves()[9] == 0 and buf.num_episodes == 0
    np.testing.assert_allclose(leaves()[0], 10.0)  # nothing live holds a priority: the cap


def test_stale_updates_are_ignored(tmp_path):
    buf = make(tmp_path, capacity=20)
    fill(buf, 20)
    b = buf.sample(8, prioritized=True, generator=torch.Generator().manual_seed(0))
    fill(buf, 10)  # overwrites rows 0..9 (and evicts their episodes)
    before = buf._tree.leaves[:20].copy()
    buf.update_priorities(b.indices, torch.full((8,), 50.0))
    after = buf._tree.leaves[:20]
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
    leaves = buf._tree.leaves
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


def test_tree_survives_many_updates_and_reopen(tmp_path, rng):
    buf = make(tmp_path, capacity=5000, streams=5)
    for s in range(5):
        fill(buf, 1000, ep_len=50, stream=s)
    for _ in range(200):
        idx = rng.integers(0, 5000, 5000)
        buf.update_priorities(torch.from_numpy(idx), torch.from_numpy(rng.exponential(size=5000)))
    total = T.total(buf._tree)
    buf.close()
    ro = mb.open(tmp_path / "p", mode="r")
    ref = np.sum(ro._tree.leaves[:5000].astype(np.float64))
    assert T.total(ro._tree) == total
    assert abs(total - ref) <= 1e-9 * ref
    from mmbuffer.verify import verify

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
