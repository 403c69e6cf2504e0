"""The compiled PER steps (``mmbuffer.kernels.priority``) against the numpy code they
replace, bit for bit: a prioritized draw (the tree's stratified descent, the
sampleable check, the weights) and an update's checks, liveness and transform."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer import tree as T
from mmbuffer.kernels import priority as P
from mmbuffer.samplers import _draw as D


def _store(tmp_path, rng):
    """Two lanes, one wrapped; the open episodes' last rows (no next observation yet:
    not sampleable) hold a large share of the priority."""
    buf = mb.create(tmp_path / "s", {"x": ((), "int64")}, capacity=400, num_streams=2, next_keys=("x",),
                    priorities=mb.PriorityConfig(alpha=0.7, eps=0.01))
    for lane, start, n in ((0, 0, 150), (0, 150, 180), (1, 0, 57)):
        rows = np.arange(start, start + n)
        done = rows % 25 == 24
        buf.extend({"x": rows, "terminated": done}, stream=lane, final_obs={"x": rows[done] + 1})
    b = buf.sample(300, prioritized=True, generator=torch.Generator().manual_seed(3))
    buf.update_priorities(b.indices, torch.from_numpy(rng.uniform(0, 5, 300)))
    buf.update_priorities(torch.tensor([329 % 200, 200 + 56]), torch.tensor([300.0, 300.0]))  # the open tails
    return buf


def test_draw_equals_the_numpy_steps(tmp_path, rng):
    buf = _store(tmp_path, rng)
    view = buf.view()
    tr, v = view.tree, view.tree.views
    for seed in range(20):
        rows, probs = T.sample(tr, 64, torch.Generator().manual_seed(seed))  # the steps before the kernel
        ok = D.sampleable(view, rows, None, True)
        weights = ((probs * T.total(tr) / T.min_live(tr)) ** -0.4).astype(np.float32)
        u = torch.rand(64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).numpy()
        status, bad, r, values, k, w = P.draw(v.leaf, v.nodes, v.offs, u, view.lane_size, view.written,
                                              view.first_starts, view.transitions, 0.4)
        assert status == 0 and bad == int((~ok).sum())
        assert r.tolist() == rows.tolist() and k.tolist() == ok.tolist()
        assert values.tobytes() == (probs * T.total(tr)).tobytes() and w.tobytes() == weights.tobytes()
    assert 0 < bad < 64  # the store has rows that are not sampleable (evicted, open tails)


def test_draw_over_a_torn_block_as_the_descent_before_and_refuses_an_empty_tree():
    tr = T.init(1000)
    T.update(tr, np.arange(1000), np.ones(1000))
    v = tr.views
    v.leaf[64:128] = 0.0  # leaves zeroed behind the sums' back: a read torn by a writer
    u = (np.arange(16) + 0.5) / 16
    one = np.array([1], np.int64)
    status, _, rows, values, _, _ = P.draw(v.leaf, v.nodes, v.offs, u, 1000, one * 1000, one * 0, one * 1000, 0.4)
    want = T.find_prefix(tr, (u + np.arange(16)) * (1000.0 / 16))  # the descent before the kernel
    assert status == 0 and rows.tolist() == want.tolist() and values.tolist() == v.leaf[want].tolist()
    assert (want // 64 == 1).any()  # a draw met the torn block (the kernel descended again)
    empty = T.init(100)
    assert P.draw(empty.views.leaf, empty.views.nodes, empty.views.offs, u, 100, one, one * 0, one, 0.4)[0] == P.EMPTY


def test_prepare_equals_the_numpy_steps(rng):
    lane_size, now, first = 100, np.array([250, 60]), np.array([170, 5])
    snap = np.array([230, 60])
    idx = rng.integers(0, 200, 500)
    pri = rng.uniform(0, 9, 500)
    status, rows, leaves = P.prepare(idx, pri, 200, lane_size, now, first, snap, 0.01, 0.6, True)
    lane = idx // lane_size
    a = snap[lane] - 1 - (snap[lane] - 1 - idx % lane_size) % lane_size  # Layout.absolute_at
    live = (snap[lane] > 0) & (a >= first[lane]) & (a < now[lane])
    assert status == 0 and 0 < live.sum() < 500
    assert rows.tolist() == idx[live].tolist()
    assert leaves.tobytes() == ((pri[live] + 0.01) ** 0.6).astype(np.float32).tobytes()
    _, _, raw = P.prepare(idx, pri, 200, lane_size, now, first, snap, 0.01, 0.6, False)
    assert raw.tobytes() == pri[live].astype(np.float32).tobytes()
    for bad_pri, bad_idx, want in ((np.nan, 0, P.BAD_VALUE), (-1.0, 0, P.BAD_VALUE), (1.0, 200, P.BAD_INDEX),
                                   (1.0, -1, P.BAD_INDEX), (np.inf, 200, P.BAD_VALUE)):
        p, i = pri.copy(), idx.copy()
        p[7], i[9] = bad_pri, bad_idx
        status, rows, leaves = P.prepare(i, p, 200, lane_size, now, first, snap, 0.01, 0.6, True)
        assert (status, rows.size, leaves.size) == (want, 0, 0)


def test_update_refuses_cursors_of_another_store(tmp_path, rng):
    buf = _store(tmp_path, rng)
    b = buf.sample(4, prioritized=True)
    before = buf.view().tree.leaves.copy()
    other = dataclasses.replace(b, written_at=np.array([5, 5, 5]))  # a batch of a store of 3 lanes
    with pytest.raises(mb.errors.InvalidArgumentError, match=r"written_at: expected 2 lane cursors, got shape \(3,\)"):
        buf.update_priorities(other, torch.ones(4))
    assert buf.view().tree.leaves.tobytes() == before.tobytes()
    buf.update_priorities(b, torch.full((4,), 9.0))
    assert buf.view().tree.leaves[b.indices.numpy()].tolist() == [np.float32(9.01 ** 0.7)] * 4
