"""Tests of mmbuffer.losses against plain, obviously-correct references."""

from __future__ import annotations

import collections
import tracemalloc

import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer import losses

InvalidArgumentError = mb.errors.InvalidArgumentError


# ----------------------------------------------------------------------------------
# minibatched
# ----------------------------------------------------------------------------------


@pytest.fixture
def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


@pytest.mark.parametrize("size", [1, 3, 7, 37, 38, 1000])
def test_minibatched_tensor_matches_full_pass(net: torch.nn.Module, size: int) -> None:
    x = torch.randn(37, 5, generator=torch.Generator().manual_seed(1))
    out = losses.minibatched(net, x, size)
    with torch.no_grad():
        full = net(x)
    assert out.shape == full.shape and out.dtype == full.dtype
    assert not out.requires_grad
    torch.testing.assert_close(out, full, atol=1e-6, rtol=0)


Out = collections.namedtuple("Out", ["logits", "value"])


@pytest.mark.parametrize("size", [1, 4, 11, 50])
def test_minibatched_nested_dict_in_tuple_dict_namedtuple_out(
    net: torch.nn.Module, size: int
) -> None:
    g = torch.Generator().manual_seed(2)
    batch = {"obs": {"a": torch.randn(23, 5, generator=g)}, "act": torch.randn(23, 2, generator=g)}

    def fn_tuple(b):  # type: ignore[no-untyped-def]
        y = net(b["obs"]["a"])
        return y, (y[:, :2] * b["act"]).sum(-1)

    def fn_dict(b):  # type: ignore[no-untyped-def]
        y = net(b["obs"]["a"])
        return {"y": y, "inner": {"s": y.sum(-1).double()}, "none": None}

    def fn_named(b):  # type: ignore[no-untyped-def]
        y = net(b["obs"]["a"])
        return Out(y, y[:, 0])

    with torch.no_grad():
        full_t, full_d, full_n = fn_tuple(batch), fn_dict(batch), fn_named(batch)
    out_t = losses.minibatched(fn_tuple, batch, size)
    out_d = losses.minibatched(fn_dict, batch, size)
    out_n = losses.minibatched(fn_named, batch, size)
    assert isinstance(out_t, tuple) and len(out_t) == 2
    for a, b in zip(out_t, full_t):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert set(out_d) == {"y", "inner", "none"} and out_d["none"] is None
    torch.testing.assert_close(out_d["y"], full_d["y"], atol=1e-6, rtol=0)
    assert out_d["inner"]["s"].dtype == torch.float64
    torch.testing.assert_close(out_d["inner"]["s"], full_d["inner"]["s"], atol=1e-6, rtol=0)
    assert isinstance(out_n, Out)
    torch.testing.assert_close(out_n.value, full_n.value, atol=1e-6, rtol=0)


def test_minibatched_tuple_batch_and_row_changing_output() -> None:
    x = torch.arange(30.0).reshape(10, 3)
    y = torch.arange(10.0)
    # fn sees the same structure; its output has 3 rows per input row (flattened)
    out = losses.minibatched(lambda b: (b[0] + b[1][:, None]).reshape(-1), (x, y), 4)
    torch.testing.assert_close(out, (x + y[:, None]).reshape(-1))


def test_minibatched_read_only_numpy_memmap(tmp_path) -> None:  # type: ignore[no-untyped-def]
    arr = np.lib.format.open_memmap(tmp_path / "a.npy", mode="w+", dtype=np.float32, shape=(9, 2))
    arr[:] = np.arange(18, dtype=np.float32).reshape(9, 2)
    arr.flush()
    ro = np.load(tmp_path / "a.npy", mmap_mode="r")
    seen = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        seen.append(len(t))
        return t * 2

    out = losses.minibatched(fn, ro, 4)  # no "non-writable" warning (filterwarnings=error)
    assert seen == [4, 4, 1]
    torch.testing.assert_close(out, torch.from_numpy(np.array(ro)) * 2)


def test_minibatched_runs_without_grad(net: torch.nn.Module) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        assert not torch.is_grad_enabled()
        return net(x)

    assert not losses.minibatched(fn, torch.randn(5, 5), 2).requires_grad


def test_minibatched_empty_batch(net: torch.nn.Module) -> None:
    assert losses.minibatched(net, torch.zeros(0, 5), 3).shape == (0, 3)


@pytest.mark.parametrize("size", [0, -1, 2.0, True, "4", None])
def test_minibatched_bad_size(size: object) -> None:
    with pytest.raises(InvalidArgumentError, match="size"):
        losses.minibatched(lambda x: x, torch.zeros(3), size)  # type: ignore[arg-type]


def test_minibatched_bad_inputs_and_outputs() -> None:
    with pytest.raises(InvalidArgumentError, match="leading dim 3"):
        losses.minibatched(lambda b: b["a"], {"a": torch.zeros(3), "b": torch.zeros(4)}, 2)
    with pytest.raises(InvalidArgumentError, match="0-d"):
        losses.minibatched(lambda x: x.sum(), torch.zeros(3), 2)
    with pytest.raises(InvalidArgumentError, match="fn output"):
        losses.minibatched(lambda x: 1.0, torch.zeros(3), 2)
    with pytest.raises(InvalidArgumentError, match="torch.Tensor"):
        losses.minibatched(lambda x: x.numpy(), torch.zeros(3), 2)
    with pytest.raises(InvalidArgumentError):
        losses.minibatched(lambda x: x, {"a": 3}, 2)


WIDTH = 256


def _numpy_heavy(x: torch.Tensor) -> torch.Tensor:
    """Allocates numpy temporaries of WIDTH float64 per input row (traced by tracemalloc)."""
    wide = np.repeat(x.numpy().astype(np.float64)[:, None], WIDTH, axis=1)
    wide = np.tanh(wide * np.linspace(0.0, 1.0, WIDTH))
    return torch.from_numpy(wide.sum(axis=1))


def _peak(fn, *args) -> int:  # type: ignore[no-untyped-def]
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn(*args)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_minibatched_peak_memory_bounded_by_chunk() -> None:
    n, chunk = 8192, 256
    x = torch.randn(n)
    full_out = _numpy_heavy(x)
    out = losses.minibatched(_numpy_heavy, x, chunk)
    torch.testing.assert_close(out, full_out, atol=1e-6, rtol=0)
    full_peak = _peak(losses.minibatched, _numpy_heavy, x, n)
    chunk_peak = _peak(losses.minibatched, _numpy_heavy, x, chunk)
    row_temp = WIDTH * 8
    assert full_peak >= n * row_temp  # the single pass holds the whole wide temporary
    # chunked: a few chunk-sized temporaries, nothing proportional to n * WIDTH
    assert chunk_peak < 4 * chunk * row_temp + 64 * 1024
    assert chunk_peak * 10 < full_peak


# ----------------------------------------------------------------------------------
# GAE
# ----------------------------------------------------------------------------------


def ref_gae(r, v, nv, term, trunc, gamma, lam):  # type: ignore[no-untyped-def]
    """Textbook GAE, one row at a time, 1-D python lists."""
    t_len = len(r)
    adv = [0.0] * t_len
    for t in reversed(range(t_len)):
        bootstrap = 0.0 if term[t] else nv[t]
        delta = r[t] + gamma * bootstrap - v[t]
        episode_ends = term[t] or trunc[t] or t == t_len - 1
        carry = 0.0 if episode_ends else adv[t + 1]
        adv[t] = delta + gamma * lam * carry
    return adv, [a + b for a, b in zip(adv, v)]


def make_episodes(t_len: int, seed: int, ncols: int | None = None):  # type: ignore[no-untyped-def]
    g = np.random.default_rng(seed)
    shape = (t_len,) if ncols is None else (t_len, ncols)
    r = g.normal(size=shape)
    v = g.normal(size=shape)
    nv = g.normal(size=shape)
    u = g.random(size=shape)
    term = u < 0.08
    trunc = (u >= 0.08) & (u < 0.14)
    term[-1] = False  # last episode unfinished in every column
    trunc[-1] = False
    term[3] = True  # at least one of each kind
    trunc[7] = True
    term[7] = False
    nv[term] = np.nan  # V of a terminal observation may be garbage: must be ignored
    return r, v, nv, term, trunc


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.9, 0.0), (1.0, 1.0), (0.0, 0.5)])
def test_gae_1d_matches_reference(gamma: float, lam: float) -> None:
    r, v, nv, term, trunc = make_episodes(101, seed=3)
    adv, ret = losses.gae(
        torch.from_numpy(r), torch.from_numpy(v), torch.from_numpy(nv),
        torch.from_numpy(term), torch.from_numpy(trunc), gamma, lam,
    )
    ref_a, ref_r = ref_gae(r.tolist(), v.tolist(), nv.tolist(), term.tolist(), trunc.tolist(),
                           gamma, lam)
    assert adv.shape == (101,) and adv.dtype == torch.float64
    assert torch.isfinite(adv).all()
    np.testing.assert_allclose(adv.numpy(), ref_a, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(ret.numpy(), ref_r, rtol=1e-10, atol=1e-10)


def test_gae_2d_parallel_envs_matches_reference_per_column() -> None:
    r, v, nv, term, trunc = make_episodes(64, seed=4, ncols=6)
    adv, ret = losses.gae(r, v, nv, term, trunc, 0.97, 0.9)  # numpy in, torch out
    assert adv.shape == (64, 6)
    for j in range(6):
        ref_a, ref_r = ref_gae(r[:, j].tolist(), v[:, j].tolist(), nv[:, j].tolist(),
                               term[:, j].tolist(), trunc[:, j].tolist(), 0.97, 0.9)
        np.testing.assert_allclose(adv[:, j].numpy(), ref_a, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(ret[:, j].numpy(), ref_r, rtol=1e-10, atol=1e-10)


def test_gae_float32_long_episode() -> None:
    r, v, nv, term, trunc = make_episodes(3000, seed=5)
    term[:] = False
    trunc[:] = False
    nv = np.nan_to_num(nv)
    trunc[1500] = True  # two long episodes, the second unfinished
    adv, _ = losses.gae(*(torch.from_numpy(a.astype(np.float32)) if a.dtype != bool
                          else torch.from_numpy(a) for a in (r, v, nv, term, trunc)), 0.999, 0.99)
    assert adv.dtype == torch.float32
    ref_a, _ = ref_gae(r.tolist(), v.tolist(), nv.tolist(), term.tolist(), trunc.tolist(),
                       0.999, 0.99)
    np.testing.assert_allclose(adv.numpy(), ref_a, rtol=1e-4, atol=1e-3)


def test_gae_aligns_on_leading_dims_not_outer_product() -> None:
    r, v, nv, term, trunc = make_episodes(20, seed=6)
    ref_a, _ = ref_gae(r.tolist(), v.tolist(), nv.tolist(), term.tolist(), trunc.tolist(),
                       0.9, 0.8)
    adv, ret = losses.gae(r, v[:, None], nv[:, None], term, trunc, 0.9, 0.8)  # values [T, 1]
    assert adv.shape == (20, 1) and ret.shape == (20, 1)
    np.testing.assert_allclose(adv[:, 0].numpy(), ref_a, rtol=1e-10)
    # shared flags [T] over per-agent rewards [T, 3]
    r3 = np.stack([r, 2 * r, -r], axis=1)
    adv3, _ = losses.gae(r3, v, nv, term, trunc, 0.9, 0.8)
    assert adv3.shape == (20, 3)
    ref_2, _ = ref_gae((2 * r).tolist(), v.tolist(), nv.tolist(), term.tolist(),
                       trunc.tolist(), 0.9, 0.8)
    np.testing.assert_allclose(adv3[:, 1].numpy(), ref_2, rtol=1e-10)


def test_gae_edge_cases_and_errors() -> None:
    z = torch.zeros(0)
    adv, ret = losses.gae(z, z, z, z.bool(), z.bool(), 0.9, 0.9)
    assert adv.shape == (0,) and ret.shape == (0,)
    adv, _ = losses.gae([2.0], [0.5], [1.0], [False], [False], 0.5, 0.5)
    torch.testing.assert_close(adv, torch.tensor([2.0]))
    one = torch.ones(4)
    with pytest.raises(InvalidArgumentError, match="gamma"):
        losses.gae(one, one, one, one.bool(), one.bool(), 1.5, 0.9)
    with pytest.raises(InvalidArgumentError, match="lam"):
        losses.gae(one, one, one, one.bool(), one.bool(), 0.9, -0.1)
    with pytest.raises(InvalidArgumentError, match="time dim"):
        losses.gae(one, torch.ones(5), one, one.bool(), one.bool(), 0.9, 0.9)
    with pytest.raises(InvalidArgumentError):
        losses.gae(torch.ones(4, 2), torch.ones(4, 3), one, one.bool(), one.bool(), 0.9, 0.9)


# ----------------------------------------------------------------------------------
# gae_from_buffer, against a fake store with wrapped episodes
# ----------------------------------------------------------------------------------


class FakeBuffer:
    """Two lanes of 12 rows; episodes wrap inside their lane. Only the public API."""

    capacity = 24
    num_streams = 2

    def __init__(self, flag_last: bool = True) -> None:
        g = np.random.default_rng(7)
        self.obs = g.normal(size=(24, 3))
        self.next_obs = np.full((24, 3), np.nan)
        self.reward = g.normal(size=24)
        self.terminated = np.zeros(24, dtype=bool)
        self.truncated = np.zeros(24, dtype=bool)
        # (start, length, how it ends); episodes() returns them in this order
        self.eps = [(9, 5, "term"), (20, 6, "trunc"), (2, 4, "trunc"), (14, 3, "term"),
                    (6, 2, "none")]
        self.rows = []
        for start, length, end in self.eps:
            base = (start // 12) * 12
            rows = [base + (start - base + i) % 12 for i in range(length)]
            self.rows.append(rows)
            for a, b in zip(rows[:-1], rows[1:]):
                self.next_obs[a] = self.obs[b]
            last = rows[-1]
            if end == "term":
                self.terminated[last] = True  # next_obs stays NaN: must never be evaluated
            else:
                self.next_obs[last] = g.normal(size=3)  # final observation
                self.truncated[last] = end == "trunc" or flag_last
        self.reads: dict[str, int] = collections.Counter()

    def episodes(self):  # type: ignore[no-untyped-def]
        return (torch.tensor([s for s, _, _ in self.eps]),
                torch.tensor([n for _, n, _ in self.eps]))

    def get(self, index, keys=None):  # type: ignore[no-untyped-def]
        index = torch.as_tensor(index)
        out = {}
        for k in keys:
            self.reads[k] += len(index)
            out[k] = torch.from_numpy(getattr(self, k)[index.numpy()].copy())
        return out


def value_fn(obs: torch.Tensor) -> torch.Tensor:
    if torch.isnan(obs).any():
        raise RuntimeError("value network called on a NaN observation")
    return (obs @ torch.tensor([0.5, -1.0, 2.0], dtype=obs.dtype))[:, None]  # [b, 1]


@pytest.mark.parametrize("minibatch", [1, 4, 100])
@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("flag_last", [True, False])
def test_gae_from_buffer_matches_reference(minibatch: int, reuse: bool, flag_last: bool) -> None:
    buf = FakeBuffer(flag_last=flag_last)
    idx, adv, ret = losses.gae_from_buffer(buf, value_fn, 0.95, 0.9, minibatch,
                                           reuse_next_values=reuse)
    expected_rows = [r for rows in buf.rows for r in rows]
    assert idx.dtype == torch.int64 and idx.tolist() == expected_rows
    assert adv.shape == ret.shape == (len(expected_rows),)
    w = np.array([0.5, -1.0, 2.0])
    ref_a: list[float] = []
    ref_r: list[float] = []
    for rows in buf.rows:
        rows_a = np.array(rows)
        term = buf.terminated[rows_a].tolist()
        trunc = buf.truncated[rows_a].tolist()
        nv = [0.0 if t else float(buf.next_obs[i] @ w) for i, t in zip(rows, term)]
        a, r = ref_gae(buf.reward[rows_a].tolist(), (buf.obs[rows_a] @ w).tolist(), nv,
                       term, trunc, 0.95, 0.9)
        ref_a += a
        ref_r += r
    np.testing.assert_allclose(adv.numpy(), ref_a, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ret.numpy(), ref_r, rtol=1e-10, atol=1e-12)
    if reuse:  # next_obs read only where an episode ends without terminating
        assert buf.reads["next_obs"] == 3
    assert buf.reads["obs"] == len(expected_rows)


def test_gae_from_buffer_empty_and_bad_args() -> None:
    class Empty(FakeBuffer):
        def episodes(self):  # type: ignore[no-untyped-def]
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)

    idx, adv, ret = losses.gae_from_buffer(Empty(), value_fn, 0.9, 0.9, 8)
    assert idx.shape == adv.shape == ret.shape == (0,) and idx.dtype == torch.int64
    with pytest.raises(InvalidArgumentError, match="minibatch"):
        losses.gae_from_buffer(FakeBuffer(), value_fn, 0.9, 0.9, 0)
    with pytest.raises(InvalidArgumentError, match="values_fn"):
        losses.gae_from_buffer(FakeBuffer(), lambda o: torch.zeros(len(o), 2), 0.9, 0.9, 4)


# ----------------------------------------------------------------------------------
# SAC targets
# ----------------------------------------------------------------------------------


class Nets:
    """Policy and twin critics that act per agent, reject NaN input and odd ranks."""

    def __init__(self, obs_ndim: int, logp_keepdim: bool) -> None:
        g = torch.Generator().manual_seed(8)
        self.wp = torch.randn(4, 2, generator=g)
        self.w1 = torch.randn(6, 1, generator=g)
        self.w2 = torch.randn(6, 1, generator=g)
        self.obs_ndim = obs_ndim
        self.logp_keepdim = logp_keepdim
        self.calls = 0

    def _check(self, obs: torch.Tensor) -> None:
        self.calls += 1
        if torch.isnan(obs).any():
            raise RuntimeError("network called on a NaN observation")
        if obs.dim() != self.obs_ndim or obs.shape[0] == 0:
            raise RuntimeError(f"network rejects input shape {list(obs.shape)}")

    def policy(self, obs: torch.Tensor):  # type: ignore[no-untyped-def]
        self._check(obs)
        a = torch.tanh(obs @ self.wp)
        logp = -(obs**2).sum(-1, keepdim=self.logp_keepdim)
        return a, logp

    def q1(self, obs: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        self._check(obs)
        return torch.cat([obs, a], -1) @ self.w1

    def q2(self, obs: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        self._check(obs)
        return torch.cat([obs, a], -1) @ self.w2

    def manual(self, reward, next_obs, terminated, gamma, alpha):  # type: ignore[no-untyped-def]
        """Target by hand, row by row, on a NaN-free copy."""
        obs = torch.nan_to_num(next_obs)
        a = torch.tanh(obs @ self.wp)
        x = torch.cat([obs, a], -1)
        q = torch.minimum(x @ self.w1, x @ self.w2)[..., 0]
        v = q + alpha * (obs**2).sum(-1)
        return v


def _sac_batch(b: int = 12):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(9)
    reward = torch.randn(b, generator=g)
    obs = torch.randn(b, 4, generator=g)
    done = torch.zeros(b, 1, dtype=torch.bool)
    done[[1, 4, 5, 11], 0] = True
    return reward, obs, done


def test_sac_targets_skip_and_no_skip_agree_and_match_manual() -> None:
    reward, obs, done = _sac_batch()
    nets = Nets(obs_ndim=2, logp_keepdim=False)
    y0 = losses.sac_targets(reward, obs, done, nets.policy, [nets.q1, nets.q2], 0.9, 0.2)
    y1 = losses.sac_targets(reward, obs, done, nets.policy, [nets.q1, nets.q2], 0.9, 0.2,
                            skip_done_states=True)
    assert y0.shape == y1.shape == (12,)  # reward's shape, though done is [B, 1]
    live = ~done[:, 0]
    torch.testing.assert_close(y0[live], y1[live], atol=1e-6, rtol=0)
    torch.testing.assert_close(y1[~live], reward[~live])
    torch.testing.assert_close(y0[~live], reward[~live])
    v = nets.manual(reward, obs, done, 0.9, 0.2)
    torch.testing.assert_close(y0, torch.where(live, reward + 0.9 * v, reward), atol=1e-6, rtol=0)
    assert not y1.requires_grad


def test_sac_targets_never_feeds_nan_terminal_obs_when_skipping() -> None:
    reward, obs, done = _sac_batch()
    obs[done[:, 0]] = float("nan")
    nets = Nets(obs_ndim=2, logp_keepdim=True)  # logp [K, 1], q [K, 1], reward [B]
    y = losses.sac_targets(reward, obs, done, nets.policy, [nets.q1, nets.q2], 0.9,
                           torch.tensor([0.2]), skip_done_states=True)
    assert torch.isfinite(y).all()
    v = nets.manual(reward, obs, done, 0.9, 0.2)
    torch.testing.assert_close(y, torch.where(done[:, 0], reward, reward + 0.9 * v),
                               atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="NaN"):  # the nets do detect it when not skipping
        losses.sac_targets(reward, obs, done, nets.policy, [nets.q1, nets.q2], 0.9, 0.2)


def test_sac_targets_all_done_calls_nothing() -> None:
    reward, obs, _ = _sac_batch()
    nets = Nets(obs_ndim=2, logp_keepdim=False)
    done = torch.ones(12, dtype=torch.bool)
    y = losses.sac_targets(reward, obs * np.nan, done, nets.policy, nets.q1, 0.9, 0.2,
                           skip_done_states=True)
    assert nets.calls == 0
    torch.testing.assert_close(y, reward)


@pytest.mark.parametrize("logp_keepdim", [True, False])
def test_sac_targets_multi_agent_done(logp_keepdim: bool) -> None:
    b, n = 10, 3
    g = torch.Generator().manual_seed(10)
    reward = torch.randn(b, n, 1, generator=g)
    obs = torch.randn(b, n, 4, generator=g)
    done = torch.zeros(b, n, 1, dtype=torch.bool)
    done[2] = True  # whole row done
    done[7] = True
    done[4, 1] = True  # partially done rows
    done[5, 0] = True
    done[5, 2] = True
    obs[done[..., 0]] = float("nan")
    nets = Nets(obs_ndim=3, logp_keepdim=logp_keepdim)  # rejects flattened [K*n, 4] input
    qs = lambda o, a: (nets.q1(o, a), nets.q2(o, a))  # noqa: E731  one callable, a tuple out
    y = losses.sac_targets(reward, obs, done, nets.policy, qs, 0.99, 0.1,
                           skip_done_states=True)
    assert y.shape == (b, n, 1)
    v = nets.manual(reward, obs, done, 0.99, 0.1)[..., None]
    expected = torch.where(done, reward, reward + 0.99 * v)
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=0)
    # without skipping (finite obs) the live entries agree
    obs_ok = torch.nan_to_num(obs)
    y0 = losses.sac_targets(reward, obs_ok, done, nets.policy, qs, 0.99, 0.1)
    torch.testing.assert_close(y0[~done], y[~done], atol=1e-6, rtol=0)
    # shared per-row done [B] broadcasts over the agents
    row_done = done.reshape(b, -1).all(1)
    y2 = losses.sac_targets(reward, obs_ok, row_done, nets.policy, qs, 0.99, 0.1,
                            skip_done_states=True)
    torch.testing.assert_close(y2[row_done], reward[row_done])
    torch.testing.assert_close(y2[~row_done], y0[~row_done], atol=1e-6, rtol=0)


def test_sac_targets_dict_obs_and_separate_terminated() -> None:
    reward, obs, done = _sac_batch()
    nets = Nets(obs_ndim=2, logp_keepdim=False)
    truncated = torch.zeros(12, dtype=torch.bool)
    truncated[[2, 3]] = True
    term = done[:, 0]

    def policy(o):  # type: ignore[no-untyped-def]
        return nets.policy(o["x"]["y"])

    qd = [lambda o, a: nets.q1(o["x"]["y"], a), lambda o, a: nets.q2(o["x"]["y"], a)]
    nested = {"x": {"y": obs}}
    v = nets.manual(reward, obs, done, 0.9, 0.2)
    # final observation stored: done=terminated, truncated rows bootstrap
    y = losses.sac_targets(reward, nested, term, policy, qd, 0.9, 0.2, skip_done_states=True)
    torch.testing.assert_close(y, torch.where(term, reward, reward + 0.9 * v), atol=1e-6, rtol=0)
    # no usable final observation: skip done = term | trunc, bootstrap only on ~term
    y = losses.sac_targets(reward, nested, term | truncated, policy, qd, 0.9, 0.2,
                           skip_done_states=True, terminated=term)
    torch.testing.assert_close(y, torch.where(term | truncated, reward, reward + 0.9 * v),
                               atol=1e-6, rtol=0)
    y = losses.sac_targets(reward, nested, term | truncated, policy, qd, 0.9, 0.2,
                           terminated=term)  # not skipping: truncated rows bootstrap
    torch.testing.assert_close(y, torch.where(term, reward, reward + 0.9 * v), atol=1e-6, rtol=0)


def test_sac_targets_shape_errors() -> None:
    reward, obs, done = _sac_batch()
    nets = Nets(obs_ndim=2, logp_keepdim=False)
    with pytest.raises(InvalidArgumentError, match="done"):
        losses.sac_targets(reward, obs, torch.zeros(12, 2, dtype=torch.bool), nets.policy,
                           nets.q1, 0.9, 0.2)
    with pytest.raises(InvalidArgumentError, match="next_obs"):
        losses.sac_targets(reward, obs[:5], done, nets.policy, nets.q1, 0.9, 0.2)
    with pytest.raises(InvalidArgumentError, match="q_fns"):
        losses.sac_targets(reward, obs, done, nets.policy,
                           lambda o, a: torch.zeros(len(o), 2), 0.9, 0.2)
    with pytest.raises(InvalidArgumentError, match="policy"):
        losses.sac_targets(reward, obs, done, lambda o: o, nets.q1, 0.9, 0.2)
    with pytest.raises(InvalidArgumentError, match="gamma"):
        losses.sac_targets(reward, obs, done, nets.policy, nets.q1, 2.0, 0.2)


# ----------------------------------------------------------------------------------
# PER-weighted loss
# ----------------------------------------------------------------------------------


def _huber(x: torch.Tensor, d: float) -> torch.Tensor:
    ax = x.abs()
    return torch.where(ax <= d, 0.5 * x * x, d * (ax - 0.5 * d))


@pytest.mark.parametrize("kind", ["mse", "huber"])
def test_per_weighted_loss_matches_manual(kind: str) -> None:
    g = torch.Generator().manual_seed(11)
    pred = (3 * torch.randn(16, generator=g)).requires_grad_()
    target = torch.randn(16, 1, generator=g)  # [B, 1] target aligns with [B] pred
    w = torch.rand(16, generator=g)
    loss, prio = losses.per_weighted_loss(pred, target, w, kind=kind, delta=0.7)
    x = pred.detach() - target[:, 0]
    elem = x**2 if kind == "mse" else _huber(x, 0.7)
    torch.testing.assert_close(loss.detach(), (w * elem).mean())
    torch.testing.assert_close(prio, x.abs())
    assert prio.shape == w.shape and not prio.requires_grad
    loss.backward()
    assert pred.grad is not None and pred.grad.shape == (16,)


@pytest.mark.parametrize("kind", ["mse", "huber"])
def test_per_weighted_loss_trailing_dims(kind: str) -> None:
    g = torch.Generator().manual_seed(12)
    pred = torch.randn(4, 5, 1, generator=g)  # slices [B, L, 1]
    target = torch.randn(4, 5, 1, generator=g)
    w = torch.rand(4, generator=g)
    loss, prio = losses.per_weighted_loss(pred, target, w, kind=kind)
    x = pred - target
    elem = x**2 if kind == "mse" else _huber(x, 1.0)
    torch.testing.assert_close(loss, (w[:, None, None] * elem).mean())
    assert prio.shape == (4,)
    torch.testing.assert_close(prio, x.abs().mean(dim=(1, 2)))
    # per-step weights give per-step priorities
    w2 = torch.rand(4, 5, generator=g)
    loss2, prio2 = losses.per_weighted_loss(pred, target, w2, kind=kind)
    torch.testing.assert_close(loss2, (w2[..., None] * elem).mean())
    torch.testing.assert_close(prio2, x.abs()[..., 0])
    # [B, 1] weights over [B, 5] predictions: one priority per row, shaped like weights
    loss3, prio3 = losses.per_weighted_loss(pred[..., 0], target[..., 0], w[:, None], kind=kind)
    assert prio3.shape == (4, 1)
    torch.testing.assert_close(prio3[:, 0], x.abs().mean(dim=(1, 2)))


def test_per_weighted_loss_errors() -> None:
    p = torch.zeros(3)
    with pytest.raises(InvalidArgumentError, match="kind"):
        losses.per_weighted_loss(p, p, p, kind="l1")
    with pytest.raises(InvalidArgumentError, match="delta"):
        losses.per_weighted_loss(p, p, p, kind="huber", delta=0.0)
    with pytest.raises(InvalidArgumentError, match="weights"):
        losses.per_weighted_loss(p, p, torch.ones(4))
    with pytest.raises(InvalidArgumentError, match="target"):
        losses.per_weighted_loss(p, torch.zeros(3, 2), p)


def test_gae_from_buffer_on_a_real_store(tmp_path):
    """The same advantages as gae() over the gathered rows, with wrapped lanes."""
    from mmbuffer.losses import gae, gae_from_buffer

    buf = mb.create(tmp_path / "s", {"obs": ((2,), "float32"), "reward": ((), "float32")}, capacity=60, num_streams=2)
    rng = np.random.default_rng(0)
    for i in range(9):  # 9 episodes into two lanes of 30 rows: the rings wrap
        n = int(rng.integers(5, 14))
        end = np.arange(n) == n - 1
        buf.extend({"obs": rng.normal(size=(n, 2)), "reward": rng.normal(size=n),
                    "terminated": end & (i % 2 == 0), "truncated": end & (i % 2 == 1)},
                   stream=i % 2, final_obs={"obs": rng.normal(size=(1, 2))})
    value = lambda o: o.sum(-1)  # noqa: E731
    idx, adv, ret = gae_from_buffer(buf, value, 0.99, 0.95, minibatch=7)
    starts, lengths = buf.episodes()
    assert len(idx) == int(lengths.sum()) and (starts % 30 + lengths > 30).any()
    rows = buf.get(idx)
    want_adv, want_ret = gae(rows["reward"], value(rows["obs"]), value(rows["next_obs"]),
                             rows["terminated"], rows["truncated"], 0.99, 0.95)
    torch.testing.assert_close(adv, want_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, want_ret, atol=1e-5, rtol=1e-5)
