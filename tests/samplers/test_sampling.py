"""Uniform, slice and epoch sampling: distributions, boundaries, determinism, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import warm

import mmbuffer as mb
from conftest import tree_hash
from layouts import write_layout


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Upper-tail p-value of Pearson's statistic (Wilson-Hilferty approximation)."""
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    k = int(keep.sum()) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def valid_starts(buf, layout, slice_len):
    """Global rows of every valid strict window start, in rank order (lane, age, offset)."""
    out = []
    for s, eps in enumerate(layout):
        for start, n, _ in eps:
            a = start + np.arange(max(0, n - slice_len + 1))
            out.append(s * buf.lane_size + a % buf.lane_size)
    return np.concatenate(out)


@pytest.mark.parametrize("slice_len", [1, 16, 700])
def test_strict_windows_are_uniform_and_never_cross_boundaries(tmp_path, rng, slice_len):
    buf, layout = write_layout(tmp_path / "s", rng)
    starts = valid_starts(buf, layout, slice_len)
    rank = {int(r): i for i, r in enumerate(starts)}
    g = torch.Generator().manual_seed(7)
    counts = np.zeros(len(starts), dtype=np.int64)
    draws = 0
    per_call = 40_000 if slice_len < 100 else 10_000  # keeps the gather small
    for _ in range(4):
        b = buf.sample_slices(per_call, slice_len, generator=g, keys=["truncated", "obs"])
        idx = b.indices.numpy()
        # consecutive rows of one lane (ring order), no end flag before the last position
        lane = idx // buf.lane_size
        assert (lane == lane[:, :1]).all()
        assert ((np.diff(idx % buf.lane_size, axis=1) % buf.lane_size) == 1).all()
        assert not b.data["truncated"][:, :-1].any()
        assert (np.diff(b.data["obs"].numpy(), axis=1) == 1).all()  # obs holds the absolute row
        assert b.mask.all()
        counts += np.bincount([rank[int(r)] for r in idx[:, 0]], minlength=len(starts))
        draws += len(idx)
    # chi-square over equal-size groups of consecutive ranks
    bins = min(200, len(starts))
    edges = np.linspace(0, len(starts), bins + 1).astype(np.int64)
    observed = np.add.reduceat(counts, edges[:-1])
    expected = np.diff(edges) * draws / len(starts)
    assert chi2_pvalue(observed, expected) > 0.001


def test_episode_weighting_picks_episodes_uniformly(tmp_path, rng):
    buf, layout = write_layout(tmp_path / "s", rng)
    L = 16
    eligible = [(s, st, n) for s, eps in enumerate(layout) for st, n, _ in eps if n >= L]
    which = {}
    for i, (s, st, n) in enumerate(eligible):
        for a in range(st, st + n - L + 1):
            which[s * buf.lane_size + a % buf.lane_size] = i
    counts = np.zeros(len(eligible))
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        idx = buf.sample_slices(40_000, L, weighting="episodes", generator=g, keys=["obs"]).indices[:, 0].numpy()
        counts += np.bincount([which[int(r)] for r in idx], minlength=len(eligible))
    assert chi2_pvalue(counts, np.full(len(eligible), counts.sum() / len(eligible))) > 0.001


def test_non_strict_masks_exactly_past_the_episode_end(tmp_path, rng):
    buf, layout = write_layout(tmp_path / "s", rng)
    L = 64
    end_of = {}
    for s, eps in enumerate(layout):
        for st, n, _ in eps:
            for a in range(st, st + n):
                end_of[s * buf.lane_size + a % buf.lane_size] = st + n - a  # rows left in the episode
    b = buf.sample_slices(20_000, L, strict=False, generator=torch.Generator().manual_seed(1), keys=["obs"])
    left = np.array([end_of[int(r)] for r in b.indices[:, 0].numpy()])
    want = np.arange(L)[None, :] < left[:, None]
    np.testing.assert_array_equal(b.mask.numpy(), want)
    assert (b.data["obs"].numpy()[~want] == 0).all()
    assert (~want).any() and want.all(axis=1).any()
    # every row of a live episode may start a window: starts are uniform over rows
    rows = np.array(sorted(end_of))
    counts = np.bincount(np.searchsorted(rows, b.indices[:, 0].numpy()), minlength=len(rows))
    bins = 200
    edges = np.linspace(0, len(rows), bins + 1).astype(np.int64)
    assert chi2_pvalue(np.add.reduceat(counts, edges[:-1]), np.diff(edges) * 20_000 / len(rows)) > 0.001


def test_uniform_transitions_cover_live_rows_uniformly(tmp_path, rng):
    buf, layout = write_layout(tmp_path / "s", rng, streams=3, lane=4000)
    rows = valid_starts(buf, layout, 1)
    assert len(buf) >= len(rows) and buf.num_episodes == sum(len(e) - 1 for e in layout)
    idx = buf.sample(60_000, generator=torch.Generator().manual_seed(5), keys=["obs"]).indices.numpy()
    pos = np.searchsorted(np.sort(rows), idx)
    assert (np.sort(rows)[pos] == idx).all()  # only sampleable rows
    counts = np.bincount(pos, minlength=len(rows))
    edges = np.linspace(0, len(rows), 101).astype(np.int64)
    assert chi2_pvalue(np.add.reduceat(counts, edges[:-1]), np.diff(edges) * 60_000 / len(rows)) > 0.001


def test_online_writes_keep_the_cached_counts_exact(tmp_path, rng):
    """Sampling between extends (the online loop) sees every new episode and no evicted one."""
    buf = mb.create(tmp_path / "s", {"obs": ((), "float32")}, capacity=2 * 500, num_streams=2)
    L = 8
    g = torch.Generator().manual_seed(0)
    for step in range(300):
        n = int(rng.integers(1, 40))
        done = np.arange(n) == n - 1
        buf.extend({"obs": np.full(n, step, np.float32), "terminated": done}, stream=step % 2,
                   final_obs={"obs": np.zeros((1,), np.float32)})
        starts, lengths = buf.episodes()
        if not (lengths >= L).any():
            continue
        b = buf.sample_slices(64, L, generator=g, keys=["obs", "terminated"])
        obs = b.data["obs"]
        assert (obs == obs[:, :1]).all()  # one extend = one episode here: never crosses
        live = set(obs[:, 0].tolist())
        assert live <= {float(x) for x in range(max(0, step - 60), step + 1)}


def test_same_generator_same_batch_in_another_process(tmp_path, rng):
    buf, _ = write_layout(tmp_path / "s", rng, streams=2, lane=3000)
    buf.close()
    code = (
        "import sys, torch, mmbuffer as mb\n"
        "b = mb.open(sys.argv[1], mode='r').sample_slices(32, 8, generator=torch.Generator().manual_seed(11))\n"
        "print(b.indices.flatten().tolist())"
    )
    out = warm.run(code, [str(tmp_path / "s")], check=True)
    ro = mb.open(tmp_path / "s", mode="r")
    here = ro.sample_slices(32, 8, generator=torch.Generator().manual_seed(11)).indices.flatten().tolist()
    assert out.stdout.strip() == str(here)
    again = ro.sample(16, generator=torch.Generator().manual_seed(2)).indices
    assert torch.equal(again, ro.sample(16, generator=torch.Generator().manual_seed(2)).indices)


def test_bad_sampling_arguments(tmp_path):
    buf = mb.create(tmp_path / "s", {"obs": ((), "float32")}, capacity=100)
    with pytest.raises(mb.errors.EmptyBufferError):
        buf.sample(4)
    with pytest.raises(mb.errors.EmptyBufferError):
        buf.sample_slices(4, 2)
    buf.extend({"obs": np.zeros(5), "terminated": np.arange(5) == 4}, final_obs={"obs": [0.0]})
    before = tree_hash(tmp_path / "s")
    for call, words in [
        (lambda: buf.sample_slices(4, 0), "slice_len"),
        (lambda: buf.sample_slices(0, 4), "num_slices"),
        (lambda: buf.sample(-1), "batch_size"),
        (lambda: buf.sample(4, keys=["nope"]), "nope"),
        (lambda: buf.sample_slices(4, 3, weighting="rows"), "weighting"),
        (lambda: buf.sample(4, prioritized=True), "priorities"),
    ]:
        with pytest.raises(mb.errors.InvalidArgumentError, match=words):
            call()
    with pytest.raises(mb.errors.NoValidSliceError, match="6"):
        buf.sample_slices(4, 6)
    padded = buf.sample_slices(64, 6, strict=False, generator=torch.Generator().manual_seed(0)).mask.sum(1)
    assert set(padded.tolist()) == {1, 2, 3, 4, 5}  # every row starts a window, cut at the end
    assert tree_hash(tmp_path / "s") == before


# -- epochs without replacement -----------------------------------------------------------
def test_epoch_visits_every_item_once_and_resumes_after_reopen(tmp_path, rng):
    buf, layout = write_layout(tmp_path / "s", rng, streams=3, lane=3000)
    rows = np.sort(valid_starts(buf, layout, 1))
    buf.close()
    ro = mb.open(tmp_path / "s", mode="r")
    sampler = mb.EpochSampler(ro, batch_size=1000, seed=5, name="run")
    seen = []
    for i, b in enumerate(sampler):
        seen.append(b.indices.numpy())
        if i == 2:
            break  # the run stops mid-epoch
    resumed = mb.EpochSampler(mb.open(tmp_path / "s", mode="r"), batch_size=777, seed=5, name="run")
    assert resumed.position == 3000 and resumed.epoch == 0
    seen += [b.indices.numpy() for b in resumed]
    got = np.sort(np.concatenate(seen))
    np.testing.assert_array_equal(got, rows)
    assert resumed.epoch == 1
    second = np.concatenate([b.indices.numpy() for b in resumed])
    np.testing.assert_array_equal(np.sort(second), rows)
    assert not np.array_equal(second, np.concatenate(seen))  # a new order each epoch
    with pytest.raises(mb.errors.InvalidArgumentError, match="seed"):
        mb.EpochSampler(ro, batch_size=10, seed=6, name="run")


def test_epoch_shards_split_slices_without_overlap(tmp_path, rng):
    buf, layout = write_layout(tmp_path / "s", rng, streams=2, lane=3000)
    L = 10
    starts = np.sort(valid_starts(buf, layout, L))
    parts = []
    for i in range(3):
        sampler = mb.EpochSampler(buf, batch_size=500, slice_len=L, seed=1, name=f"w{i}", shard=(i, 3))
        parts.append(np.concatenate([b.indices[:, 0].numpy() for b in sampler]))
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), starts)
    for i in range(3):
        for j in range(i + 1, 3):
            assert not set(parts[i].tolist()) & set(parts[j].tolist())


def test_cached_counts_survive_growth_and_trimming(tmp_path, rng):
    """Thousands of short episodes: the per-lane count buffers grow and drop their
    evicted front, and their totals always equal a recount from episodes()."""
    from mmbuffer.samplers import _draw as sampling
    from mmbuffer.samplers.slices import slice_counts

    buf = mb.create(tmp_path / "s", {"obs": ((), "float32")}, capacity=2 * 600, num_streams=2, next_keys=())
    L = 2
    g = torch.Generator().manual_seed(0)
    spec, cache = mb.samplers.Slices(L), mb.samplers.SamplerState()
    for step in range(3000):
        n = int(rng.integers(1, 4))
        buf.extend({"obs": np.zeros(n, np.float32), "terminated": np.arange(n) == n - 1}, stream=step % 2)
        if step % 3:
            continue
        spec.indices(buf.view(), 8, g, cache)
        counts = slice_counts(cache, L, True, "windows")
        closed, opened = counts.totals(buf.view())
        _, lengths = buf.episodes()
        assert int(closed.sum()) == int(np.maximum(lengths.numpy() - L + 1, 0).sum())
        assert int(opened.sum()) == 0
    assert max(lc.base for lc in counts.lanes.values()) > 1024  # the front was trimmed
    assert isinstance(counts, sampling.SliceCounts)


def test_slice_counts_follow_an_end_undone_and_set_again(tmp_path):
    """``SliceCounts.sync`` counts the newest episode anew when the writer undid its end and
    ended it at another row: whether the next draw comes right after (its end is then
    where the view's open episode starts) or after more episodes (read from the ring)."""
    from mmbuffer._ledger.appending import reopen_last_episode
    from mmbuffer.samplers.slices import slice_counts

    buf = mb.create(tmp_path / "s", {"obs": ((), "float32")}, capacity=400, next_keys=())
    spec, state, g = mb.samplers.Slices(2), mb.samplers.SamplerState(), torch.Generator().manual_seed(0)

    def counted_right() -> bool:
        spec.indices(buf.view(), 8, g, state)
        closed, _ = slice_counts(state, 2, True, "windows").totals(buf.view())
        _, lengths = buf.episodes()
        return int(closed.sum()) == int(np.maximum(lengths.numpy() - 1, 0).sum())

    buf.extend({"obs": np.zeros(5, np.float32), "truncated": np.arange(5) == 4})
    assert counted_right()
    for more, lengths in ((0, [8]), (2, [11, 4, 4])):
        assert reopen_last_episode(buf.store, 0)  # the newest end undone: the episode goes on
        buf.extend({"obs": np.zeros(3, np.float32), "truncated": np.arange(3) == 2})
        for _ in range(more):
            buf.extend({"obs": np.zeros(4, np.float32), "terminated": np.arange(4) == 3})
        assert buf.episodes()[1].tolist() == lengths
        assert counted_right()
    buf.close()


@pytest.mark.parametrize("strict, per_episode", [(True, False), (False, False), (True, True), (False, True)])
def test_open_episode_weight_is_the_weight_of_its_visible_rows(strict, per_episode):
    from mmbuffer._ledger.snapshot import LaneView
    from mmbuffer.samplers import _draw as sampling

    counts = sampling.SliceCounts(3, strict, per_episode)
    for n in range(8):
        lv = LaneView(first_start=100, ep_head=0, ep_tail=0, open_start=100, visible_end=100 + n)
        assert counts.open_weight(lv) == int(counts.weight(np.array([n]))[0])


# -- samplers as objects ----------------------------------------------------------------
def _episodes_store(tmp_path, priorities=False):
    buf = mb.create(tmp_path / "s", {"x": ((), "int64")}, capacity=200, num_streams=2, next_keys=(),
                    priorities=mb.PriorityConfig() if priorities else None)
    for lane in range(2):
        n = 60
        buf.extend({"x": lane * 1000 + np.arange(n), "truncated": np.arange(n) % 7 == 6}, stream=lane)
    return buf


@pytest.mark.parametrize(
    "flags, spec",
    [
        (dict(), mb.samplers.Uniform()),
        (dict(slice_len=4), mb.samplers.Slices(4)),
        (dict(slice_len=4, strict=False, weighting="episodes"), mb.samplers.Slices(4, strict=False, weighting="episodes")),
        (dict(prioritized=True, beta=0.7), mb.samplers.Prioritized(0.7)),
        (dict(slice_len=3, prioritized=True, beta=0.5), mb.samplers.PrioritizedSlices(3, beta=0.5)),
    ],
)
def test_flags_are_shorthands_for_the_same_spec(tmp_path, flags, spec):
    """The same generator state gives the same batch through the flags and the spec."""
    buf = _episodes_store(tmp_path, priorities=True)
    assert mb.samplers.from_flags(flags.pop("slice_len", None), **flags) == spec
    slice_len = getattr(spec, "slice_len", None)
    kw = {k: v for k, v in dict(prioritized=isinstance(spec, (mb.samplers.Prioritized, mb.samplers.PrioritizedSlices)),
                                beta=getattr(spec, "beta", 0.4)).items()}
    if slice_len is None:
        a = buf.sample(16, torch.Generator().manual_seed(5), **kw)
    else:
        kw.update(strict=spec.strict)
        if isinstance(spec, mb.samplers.Slices):
            kw["weighting"] = spec.weighting
        a = buf.sample_slices(16, slice_len, generator=torch.Generator().manual_seed(5), **kw)
    b = buf.sample(16, torch.Generator().manual_seed(5), sampler=spec)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.weights, b.weights)
    assert torch.equal(a.data["x"], b.data["x"])


def test_sampler_specs_refuse_bad_settings_and_mixed_flags(tmp_path):
    buf = _episodes_store(tmp_path)
    with pytest.raises(mb.errors.InvalidArgumentError, match="slice_len"):
        mb.samplers.Slices(0)
    with pytest.raises(mb.errors.InvalidArgumentError, match="weighting"):
        mb.samplers.Slices(4, weighting="rows")
    with pytest.raises(mb.errors.InvalidArgumentError, match="beta"):
        mb.samplers.Prioritized(beta=-1)
    with pytest.raises(mb.errors.InvalidArgumentError, match="priorities"):
        buf.sample(4, sampler=mb.samplers.Prioritized())  # the store has no priorities
    with pytest.raises(mb.errors.InvalidArgumentError, match="both"):
        buf.sample(4, sampler=mb.samplers.Uniform(), prioritized=True)
    with pytest.raises(mb.errors.InvalidArgumentError, match="sampler"):
        buf.sample(4, sampler="uniform")
    with pytest.raises(mb.errors.InvalidArgumentError, match="sampler"):
        mb.stream(buf, 4, slice_len=3, sampler=mb.samplers.Slices(3))
    with pytest.raises(mb.errors.InvalidArgumentError, match="epoch"):
        mb.data.BufferDataset(tmp_path / "s", 4, sampler=mb.samplers.Slices(3, strict=False), epoch=True)


def test_stream_and_dataset_take_a_spec(tmp_path):
    buf = _episodes_store(tmp_path)
    buf.commit()
    spec = mb.samplers.Slices(5)
    with mb.stream(buf, 8, sampler=spec, num_batches=3, generator=torch.Generator().manual_seed(1)) as s:
        streamed = [b.indices for b in s]
    g = torch.Generator().manual_seed(1)
    direct = [buf.sample(8, g, sampler=spec).indices for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(streamed, direct))
    ds = mb.data.BufferDataset(tmp_path / "s", 8, sampler=spec, num_batches=2)
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert len(batches) == 2 and all(b.indices.shape == (8, 5) for b in batches)
    assert all(bool((b.data["x"].diff(dim=1) == 1).all()) for b in batches)


def test_recent_draws_only_from_the_newest_episodes(tmp_path):
    """Recent(episodes=N) over Uniform and Slices: every item inside one of each lane's
    N newest complete episodes or its open one, and every such row reachable."""
    buf = _episodes_store(tmp_path)
    starts, lengths = (t.numpy() for t in buf.episodes())
    lanes = starts // buf.lane_size
    allowed = set()
    for lane in range(2):
        s, n = starts[lanes == lane], lengths[lanes == lane]
        for a, k in zip(s[-2:], n[-2:]):
            allowed.update(range(a, a + k))
        open_start = s[-1] + n[-1]
        allowed.update(range(open_start, lane * buf.lane_size + 60))  # the open episode (no next keys)
    g = torch.Generator().manual_seed(0)
    got = buf.sample(4000, g, sampler=mb.samplers.Recent(episodes=2)).indices.numpy()
    assert set(got.tolist()) == allowed
    windows = buf.sample(500, g, sampler=mb.samplers.Recent(2, mb.samplers.Slices(3))).indices.numpy()
    assert set(windows.reshape(-1).tolist()) <= allowed and (np.diff(windows, axis=1) == 1).all()
    with pytest.raises(mb.errors.InvalidArgumentError, match="uniform"):
        mb.samplers.Recent(2, mb.samplers.Prioritized())


# -- the Epoch spec -------------------------------------------------------------------------
def test_epoch_spec_gives_every_item_once_per_epoch_across_batches_and_reopens(tmp_path, rng):
    """``buf.sample(n, sampler=Epoch(...))``: batches of exactly n run on from one epoch
    into the next, each epoch holds every item once, and the position survives a reopen
    (also for ``mb.EpochSampler`` under the same name)."""
    buf, layout = write_layout(tmp_path / "s", rng, streams=3, lane=3000)
    rows = np.sort(valid_starts(buf, layout, 1))
    n_items, B = len(rows), 1000
    spec = mb.samplers.Epoch(seed=5, name="spec")
    first = [buf.sample(B, sampler=spec).indices.numpy() for _ in range(3)]
    buf.close()
    ro = mb.open(tmp_path / "s", mode="r")
    assert mb.EpochSampler(ro, B, seed=5, name="spec").position == 3 * B  # the saved state, shared
    batches = first + [ro.sample(B, sampler=spec).indices.numpy() for _ in range(-(-2 * n_items // B) - 3)]
    assert all(len(b) == B for b in batches)
    flat = np.concatenate(batches)
    np.testing.assert_array_equal(np.sort(flat[:n_items]), rows)  # epoch 0: each item once
    np.testing.assert_array_equal(np.sort(flat[n_items : 2 * n_items]), rows)  # epoch 1 too
    assert not np.array_equal(flat[:n_items], flat[n_items : 2 * n_items])  # in a new order
    assert mb.EpochSampler(ro, B, seed=5, name="spec").epoch == 2
    with pytest.raises(mb.errors.InvalidArgumentError, match="seed"):
        ro.sample(4, sampler=mb.samplers.Epoch(seed=6, name="spec"))  # saved with seed 5


def test_epoch_spec_windows_match_the_epoch_sampler(tmp_path, rng):
    """The spec draws the same windows in the same order as ``mb.EpochSampler``."""
    buf, layout = write_layout(tmp_path / "s", rng, streams=2, lane=3000)
    L = 10
    starts = np.sort(valid_starts(buf, layout, L))
    by_class = np.concatenate([b.indices.numpy() for b in mb.EpochSampler(buf, 400, slice_len=L, seed=3, name="a")])
    spec = mb.samplers.Epoch(slice_len=L, seed=3, name="b")
    by_spec = np.concatenate([buf.sample(400, sampler=spec).indices.numpy() for _ in range(-(-len(starts) // 400))])
    np.testing.assert_array_equal(by_spec[: len(starts)], by_class)
    np.testing.assert_array_equal(np.sort(by_class[:, 0]), starts)
    rows, weights, mask, _ = buf.indices(mb.samplers.Epoch(slice_len=L, seed=3, name="c"), 7)
    assert rows.shape == (7, L) and mask.all() and (weights == 1).all()


def test_epoch_spec_in_stream_and_dataset(tmp_path):
    buf = _episodes_store(tmp_path)
    buf.commit()
    live = len(buf)
    with mb.stream(buf, 10, sampler=mb.samplers.Epoch(seed=2, name="st"), num_batches=live // 10) as s:
        got = np.concatenate([b.indices.numpy() for b in s])
    assert len(got) == live and len(set(got.tolist())) == live  # one epoch: every row once
    ds = mb.data.BufferDataset(tmp_path / "s", 7, sampler=mb.samplers.Epoch(seed=2, name="ds"))
    assert ds.epoch and ds.seed == 2 and ds.name == "ds"
    seen = np.concatenate([b.indices.numpy() for b in ds])
    np.testing.assert_array_equal(np.sort(seen), np.sort(got))
    with pytest.raises(mb.errors.InvalidArgumentError, match="sampler"):
        mb.data.BufferDataset(tmp_path / "s", 7, sampler=mb.samplers.Epoch(shard=(0, 2)))
    with pytest.raises(mb.errors.InvalidArgumentError, match="shard"):
        mb.samplers.Epoch(shard=(2, 2))
    with pytest.raises(mb.errors.InvalidArgumentError, match="seed"):
        mb.samplers.Epoch(seed=-1)
    with pytest.raises(mb.errors.InvalidArgumentError, match="sampler"):
        mb.samplers.Recent(2, sampler=mb.samplers.Epoch())
    with pytest.raises(mb.errors.SchemaError):
        mb.samplers.Epoch(name="../x")  # the state file stays inside the store


@pytest.mark.parametrize("strict, per_episode", [(True, False), (False, True)])
def test_slice_counts_kept_step_by_step_equal_counts_built_at_once(tmp_path, strict, per_episode):
    """An online learner adds one episode between draws (counted in plain integers,
    ``SliceCounts.sync``), sometimes several or none, while the ring evicts old ones and
    ends are undone and set again (twice a long episode evicts every older one, and its own
    rows go with the next ones): after every step the counts kept are those a new
    reader builds from the same view at once, and the guide's buckets those of its counts."""
    from mmbuffer._ledger.appending import reopen_last_episode
    from mmbuffer.samplers._counts import SliceCounts

    buf = mb.create(tmp_path / "s", {"obs": ((), "float32")}, capacity=3000, next_keys=())
    kept = SliceCounts(3, strict, per_episode)
    rng = np.random.default_rng(0)
    one_by_one = 0
    for step in range(400):
        k = int(rng.choice([0, 1, 1, 1, 2, 5]))
        lengths = rng.integers(1, 12, k)
        if step in (150, 300):  # no live complete episode left: the counts start again
            buf.extend({"obs": np.zeros(2900, np.float32), "truncated": np.arange(2900) == 2899})
            buf.extend({"obs": np.zeros(200, np.float32)})
        elif k:
            buf.extend({"obs": np.zeros(int(lengths.sum()), np.float32),
                        "truncated": np.isin(np.arange(lengths.sum()), np.cumsum(lengths) - 1)})
        if rng.random() < 0.1 and reopen_last_episode(buf.store, 0):
            buf.extend({"obs": np.zeros(2, np.float32), "terminated": np.arange(2) == 1})
        view = buf.view()
        before = kept.lanes[0].upto if 0 in kept.lanes else None
        lc = kept.sync(view, 0)
        one_by_one += before is not None and lc.upto == before + 1
        fresh = SliceCounts(3, strict, per_episode).sync(view, 0)
        assert lc.upto == fresh.upto
        live = lc.counts[lc.size - fresh.size :]  # the rows of the live episodes (a trim may be due)
        assert np.array_equal(np.diff(live[:, 0]), np.diff(fresh.cum))
        assert np.array_equal(live[1:, 1], fresh.counts[1:, 1])
        assert np.array_equal(lc.guide, fresh_guide(lc.cum, lc.shift))
    assert one_by_one > 100 and buf.view().lanes[0].ep_head > 0  # one at a time, most often; old ones evicted
    buf.close()


def fresh_guide(cum: np.ndarray, shift: int) -> np.ndarray:
    if cum[-1] <= cum[0]:
        return np.zeros(0, np.int64)
    return np.searchsorted(cum, cum[0] + (np.arange(((int(cum[-1] - cum[0]) - 1) >> shift) + 1) << shift), side="right")
