"""``mmbuffer.torchrl.ReplayBuffer`` against TorchRL itself: a real ``Collector`` on
Gymnasium environments feeds it, TorchRL's ``DQNLoss`` and ``SACLoss`` train on
what it samples, and its layout is compared with TorchRL's own buffers on the
same data."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import mmbuffer as mb

pytest.importorskip("torchrl")
pytest.importorskip("gymnasium")
tensordict = pytest.importorskip("tensordict")
from mmbuffer.torchrl import ReplayBuffer

# torchrl 0.14 warns about its own deprecated internals on import and on use
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


def _collect(env_name, num_envs, frames_per_batch, batches, seed=0):
    """The batches a real TorchRL Collector returns on ``num_envs`` Gymnasium envs
    (``[E, T]``; random actions)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchrl.collectors import Collector
        from torchrl.envs import GymEnv, SerialEnv

    torch.manual_seed(seed)
    env = SerialEnv(num_envs, lambda: GymEnv(env_name))
    env.set_seed(seed)
    collector = Collector(env, policy=None, frames_per_batch=frames_per_batch, total_frames=frames_per_batch * batches)
    out = [td.clone() for td in collector]
    collector.shutdown()
    return out, env


@pytest.fixture(scope="module")
def cartpole():
    """3 batches of [2 envs, 48 steps] from CartPole (episodes of ~10-50 steps)."""
    batches, env = _collect("CartPole-v1", 2, 96, 3)
    return batches, env


def _leaves(td):
    """Every leaf key of a TensorDict with its shape and dtype."""
    return {k: (v.shape, v.dtype) for k, v in td.items(include_nested=True, leaves_only=True)}


def _stream_rows(buf, stream):
    """Every row of one stream, in write order (no wrap in these tests)."""
    written = int(buf.view().written[stream])
    rows = buf.layout.rows(stream, np.arange(written))
    return buf.get(rows)


def test_collector_batches_go_one_env_per_stream(tmp_path, cartpole):
    batches, _ = cartpole
    rb = ReplayBuffer(tmp_path / "rb", capacity=1000, batch_size=16)
    frames = 0
    for td in batches:
        index = rb.extend(td)
        assert index.shape == td.batch_size and len(rb) == frames + td.numel()
        # every row is stored at once: stream e's rows follow one another
        lane = rb.buffer.capacity // 2
        assert torch.equal(index, torch.arange(2)[:, None] * lane + frames // 2 + torch.arange(td.shape[1]))
        frames += td.numel()
    assert rb.buffer.num_streams == 2 and rb.buffer.capacity == 1000
    rb.commit()
    assert len(rb) == frames == len(rb.buffer)
    whole = torch.cat(list(batches), dim=1)  # [2, 144]: each env's steps in order
    for env in range(2):
        got = _stream_rows(rb.buffer, env)
        want = whole[env]
        torch.testing.assert_close(got["obs"], want["observation"])
        torch.testing.assert_close(got["next_obs"], want["next", "observation"])
        torch.testing.assert_close(got["action"], want["action"])
        torch.testing.assert_close(got["reward"], want["next", "reward"])
        torch.testing.assert_close(got["collector/traj_ids"], want["collector", "traj_ids"])
        assert torch.equal(got["terminated"], want["next", "terminated"][:, 0])
        # the commit ended each stream's unfinished episode as truncated
        trunc = want["next", "truncated"][:, 0].clone()
        trunc[-1] = trunc[-1] | ~want["next", "done"][-1, 0]
        assert torch.equal(got["truncated"], trunc)


def test_sampled_rows_are_the_collectors_rows_in_torchrl_layout(tmp_path, cartpole):
    batches, _ = cartpole
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    rb = ReplayBuffer(tmp_path / "rb", capacity=1000, batch_size=64, generator=torch.Generator().manual_seed(1))
    ref = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=64)
    for td in batches:
        rb.extend(td)
        ref.extend(td.reshape(-1))
    s, r = rb.sample(), ref.sample()
    assert _leaves(s) == _leaves(r)
    # every sampled row is the collector's row at its stream and position
    whole = torch.cat(list(batches), dim=1)
    lane = rb.buffer.capacity // 2
    env, pos = s["index"] // lane, s["index"] % lane
    want = whole[env, pos]
    for key in ["observation", ("next", "observation"), "action", ("next", "reward"), ("next", "terminated"), ("collector", "traj_ids")]:
        torch.testing.assert_close(s[key], want[key])
    # an episode's end, and only there, is done
    assert torch.equal(s["next", "done"], want["next", "done"])
    assert not s["done"].any()


def test_flattened_batches_are_split_into_streams_by_trajectory_ids(tmp_path, cartpole):
    batches, _ = cartpole
    whole = torch.cat(list(batches), dim=1)
    two = ReplayBuffer(tmp_path / "two", capacity=1000, num_streams=2)
    one = ReplayBuffer(tmp_path / "one", capacity=1000)
    for td in batches:  # what TorchRL users pass: data.reshape(-1)
        two.extend(td.reshape(-1))
        one.extend(td.reshape(-1))
    two.commit()
    one.commit()
    for env in range(2):  # each env's trajectories follow one another in a stream of their own
        got = _stream_rows(two.buffer, env)
        torch.testing.assert_close(got["obs"], whole[env]["observation"])
        torch.testing.assert_close(got["next_obs"], whole[env]["next", "observation"])
    # one stream: rows in the order given, a trajectory cut at each batch's env boundary
    # ends as truncated there, and every transition keeps its own next observation
    got = _stream_rows(one.buffer, 0)
    flat = torch.cat([td.reshape(-1) for td in batches])
    torch.testing.assert_close(got["obs"], flat["observation"])
    torch.testing.assert_close(got["next_obs"], flat["next", "observation"])
    ids = flat["collector", "traj_ids"]
    cut = torch.cat([(ids[1:] != ids[:-1]) & ~flat["next", "done"][:-1, 0], torch.tensor([True])])
    assert torch.equal(got["truncated"], flat["next", "truncated"][:, 0] | cut)
    assert int(cut.sum()) > len(batches)  # cuts happened


def test_dqn_loss_with_prioritized_sampling_and_td_error_priorities(tmp_path, cartpole):
    batches, env = cartpole
    from torchrl.modules import MLP, QValueActor
    from torchrl.objectives import DQNLoss, SoftUpdate

    rb = ReplayBuffer(
        tmp_path / "rb", capacity=1000, batch_size=32, sampler=mb.samplers.Prioritized(beta=0.4),
        priorities=mb.PriorityConfig(alpha=0.7, eps=1e-6), generator=torch.Generator().manual_seed(0),
    )
    for td in batches:
        rb.extend(td)
    torch.manual_seed(0)
    actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[32]), in_keys=["observation"], spec=env.action_spec)
    loss_fn = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
    loss_fn.make_value_estimator(gamma=0.99)
    target = SoftUpdate(loss_fn, eps=0.95)
    opt = torch.optim.Adam(loss_fn.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        s = rb.sample()
        assert s["priority_weight"].shape == (32,) and s["index"].shape == (32,)
        loss = loss_fn(s)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        target.step()
        losses.append(loss.item())
        assert s["td_error"].shape == (32, 1)  # what DQNLoss writes
        rb.update_tensordict_priority(s)
        # the tree holds (td_error + eps) ** alpha for every sampled row (last write wins)
        stored = rb.buffer.leaf_priorities(s["index"])
        err = s["td_error"][:, 0].double()
        last = {int(i): float(e) for i, e in zip(s["index"], err, strict=True)}
        want = np.array([(last[int(i)] + 1e-6) ** 0.7 for i in s["index"]], dtype=np.float32)
        np.testing.assert_allclose(stored, want, rtol=1e-5)
    assert all(np.isfinite(losses))


def test_sac_loss_trains_on_sampled_batches(tmp_path):
    batches, env = _collect("Pendulum-v1", 2, 64, 2, seed=1)
    from tensordict.nn import TensorDictModule
    from torch import nn
    from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.modules.distributions import NormalParamExtractor
    from torchrl.objectives import SACLoss, SoftUpdate

    rb = ReplayBuffer(tmp_path / "rb", capacity=500, batch_size=32, generator=torch.Generator().manual_seed(0))
    for td in batches:
        rb.extend(td)
    torch.manual_seed(0)
    net = nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[32]), NormalParamExtractor())
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], spec=env.action_spec, distribution_class=TanhNormal,
        distribution_kwargs={"low": -2.0, "high": 2.0},
    )

    class Q(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = MLP(in_features=4, out_features=1, num_cells=[32])

        def forward(self, obs, act):
            return self.net(torch.cat([obs, act], -1))

    loss_fn = SACLoss(actor, ValueOperator(Q(), in_keys=["observation", "action"]))
    loss_fn.make_value_estimator(gamma=0.99)
    target = SoftUpdate(loss_fn, eps=0.95)
    opt = torch.optim.Adam(loss_fn.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in loss_fn.parameters()]
    for _ in range(3):
        out = loss_fn(rb.sample())
        total = out["loss_actor"] + out["loss_qvalue"] + out["loss_alpha"]
        assert torch.isfinite(total)
        opt.zero_grad()
        total.backward()
        opt.step()
        target.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, loss_fn.parameters(), strict=True))


def test_slices_flat_like_slicesampler_and_batched(tmp_path, cartpole):
    batches, _ = cartpole
    from torchrl.data import LazyTensorStorage, SliceSampler, TensorDictReplayBuffer

    flat = ReplayBuffer(tmp_path / "rb", capacity=1000, batch_size=32, sampler=mb.samplers.Slices(4),
                        generator=torch.Generator().manual_seed(0))
    ref = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=32,
                                 sampler=SliceSampler(slice_len=4, traj_key=("collector", "traj_ids")))
    for td in batches:
        flat.extend(td)
        ref.extend(td.reshape(-1))
    s, r = flat.sample(), ref.sample()
    assert _leaves(s) == _leaves(r)
    w = s.reshape(8, 4)
    # consecutive steps of one episode; the window's last step is marked truncated and done
    torch.testing.assert_close(w["next", "observation"][:, :-1], w["observation"][:, 1:])
    assert (w["collector", "traj_ids"] == w["collector", "traj_ids"][:, :1]).all()
    assert w["next", "truncated"][:, -1].all() and not w["next", "truncated"][:, :-1].any()
    assert torch.equal(w["next", "done"], w["next", "truncated"] | w["next", "terminated"])
    assert torch.equal(w["index"][..., 0].diff(dim=1), torch.ones(8, 3, dtype=torch.int64))
    flat.close()
    batched = ReplayBuffer(tmp_path / "rb", batch_size=32, sampler=mb.samplers.Slices(4), flatten_slices=False)
    assert batched.sample().batch_size == (8, 4)
    with pytest.raises(mb.errors.InvalidArgumentError, match="multiple of slice_len=4"):
        batched.sample(30)


def test_non_strict_slices_carry_the_mask(tmp_path, cartpole):
    batches, _ = cartpole
    rb = ReplayBuffer(tmp_path / "rb", capacity=1000, sampler=mb.samplers.Slices(40, strict=False),
                      flatten_slices=False, generator=torch.Generator().manual_seed(0))
    for td in batches:
        rb.extend(td)
    s = rb.sample(400)
    mask = s["collector", "mask"]
    assert s.batch_size == (10, 40) and not mask.all()  # CartPole episodes are often shorter
    last = mask.sum(1) - 1
    trunc = s["next", "truncated"][..., 0]
    assert trunc[torch.arange(10), last].all() and int(trunc.sum()) == 10


def test_update_priority_accepts_a_trailing_singleton_dim(tmp_path, cartpole):
    batches, _ = cartpole
    rb = ReplayBuffer(tmp_path / "rb", capacity=1000, batch_size=8, sampler=mb.samplers.Prioritized(beta=0.5),
                      priorities=mb.PriorityConfig(alpha=1.0, eps=0.0))
    rb.extend(batches[0])
    s = rb.sample()
    rb.update_priority(s["index"], torch.full((8, 1), 3.0))
    np.testing.assert_allclose(rb.buffer.leaf_priorities(s["index"]), 3.0)
    rb.update_priority(s["index"], torch.full((8,), 5.0))
    np.testing.assert_allclose(rb.buffer.leaf_priorities(s["index"]), 5.0)
    with pytest.raises(mb.errors.InvalidPriorityError):
        rb.update_priority(s["index"], torch.full((8, 1), -1.0))
    np.testing.assert_allclose(rb.buffer.leaf_priorities(s["index"]), 5.0)
    td, info = rb.sample(return_info=True)  # TorchRL's (data, info) form
    assert info["index"] is td["index"] and torch.equal(info["priority_weight"], td["priority_weight"])
    rb.set_sampler(mb.samplers.PrioritizedSlices(4))  # windows, flat, priorities per row
    w = rb.sample(8)
    assert w["index"].shape == (8, 1) and w["priority_weight"].shape == (8,)
    rb.update_priority(w["index"], torch.full((8, 1), 7.0))
    np.testing.assert_allclose(rb.buffer.leaf_priorities(w["index"][:, 0]), 7.0)


def test_uniform_buffer_ignores_priority_updates_like_torchrl(tmp_path, cartpole):
    batches, _ = cartpole
    rb = ReplayBuffer(tmp_path / "rb", capacity=1000, batch_size=8)
    rb.extend(batches[0])
    s = rb.sample()
    s["td_error"] = torch.rand(8, 1)
    rb.update_tensordict_priority(s)  # a no-op, as with TorchRL's RandomSampler
    assert "priority_weight" not in s.keys()
    with pytest.raises(mb.errors.InvalidArgumentError, match="needs priorities"):
        rb.set_sampler(mb.samplers.Prioritized())
    assert rb.sampler == mb.samplers.Uniform()


def test_checkpoint_and_reopen_give_the_same_rows(tmp_path, cartpole):
    batches, _ = cartpole
    rb = ReplayBuffer(tmp_path / "rb", capacity=1000, batch_size=16, sampler=mb.samplers.Prioritized(beta=0.4),
                      generator=torch.Generator().manual_seed(3))
    for td in batches[:2]:
        rb.extend(td)
    s = rb.sample()
    s["td_error"] = torch.rand(16, 1)
    rb.update_tensordict_priority(s)
    state = rb.state_dict()
    torch.save(state, tmp_path / "state.pt")
    rows = np.arange(rb.buffer.capacity)
    before = rb.buffer.get(rows)
    leaves = rb.buffer.leaf_priorities(rows)
    expected = rb.sample()
    n, episodes = len(rb), rb.buffer.num_episodes
    rb.dumps(tmp_path / "copy")
    rb.close()

    again = ReplayBuffer(tmp_path / "rb", sampler=mb.samplers.Prioritized(beta=0.4))
    again.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    after = again.buffer.get(rows)
    for k in before:
        assert torch.equal(before[k], after[k])
    np.testing.assert_array_equal(again.buffer.leaf_priorities(rows), leaves)
    assert len(again) == n and again.batch_size == 16
    got = again.sample()  # the generator state came back with the state dict
    assert (got == expected).all()
    buf = again.buffer
    live = np.concatenate([buf.layout.rows(e, np.arange(int(w))) for e, w in enumerate(buf.view().written)])
    old = buf.get(live)
    again.extend(batches[2])  # and the streams go on, in new episodes: nothing is glued on
    assert len(again) == sum(td.numel() for td in batches)
    for k, v in buf.get(live).items():
        assert torch.equal(v, old[k]), k

    other = ReplayBuffer(tmp_path / "other", sampler=mb.samplers.Prioritized(beta=0.4), batch_size=16)
    other.loads(tmp_path / "copy")
    assert len(other) == n and other.buffer.num_episodes == episodes
    s = other.sample()
    torch.testing.assert_close(s["observation"], other.buffer.get(s["index"])["obs"])
    with pytest.raises(mb.errors.StoreNotFoundError):
        other.loads(tmp_path / "nothing")


def test_refusals_change_nothing(tmp_path, cartpole):
    batches, _ = cartpole
    rb = ReplayBuffer(tmp_path / "rb", capacity=1000, batch_size=8)
    with pytest.raises(mb.errors.EmptyBufferError):
        rb.sample()
    rb.extend(batches[0])
    rb.commit()
    n, gen = len(rb), rb.buffer.generation
    bad = batches[1].clone()
    bad["extra"] = torch.zeros(bad.batch_size)
    with pytest.raises(mb.errors.SchemaError, match="unknown \\[\\('extra',\\)\\]"):
        rb.extend(bad)
    wrong = batches[1].clone()
    wrong["observation"] = torch.zeros(*wrong.batch_size, 5)
    with pytest.raises(mb.errors.SchemaError, match="'obs'.*shape \\(4,\\).*got shape \\(5,\\)"):
        rb.extend(wrong)
    wrong["observation"] = batches[1]["observation"].double()
    with pytest.raises(mb.errors.SchemaError, match="dtype float32.*got .* float64"):
        rb.extend(wrong)
    started = batches[1].clone()
    started["done"][0, 0] = True
    with pytest.raises(mb.errors.InvalidArgumentError, match="'done'"):
        rb.extend(started)
    assert len(rb) == n and rb.commit() == gen + 1 and len(rb) == n
    with pytest.raises(mb.errors.InvalidArgumentError, match="batch_size"):
        ReplayBuffer(tmp_path / "x", capacity=10).sample()
    with pytest.raises(mb.errors.InvalidArgumentError, match="capacity"):
        ReplayBuffer(tmp_path / "y").extend(batches[0])
    rb.close()
    with pytest.raises(mb.errors.SchemaError, match="capacity"):
        ReplayBuffer(tmp_path / "rb", capacity=10)
    with pytest.raises(mb.errors.InvalidArgumentError, match="priorities"):
        ReplayBuffer(tmp_path / "rb", sampler=mb.samplers.Prioritized())


def _episode_td(T, ends, flags=("done", "terminated", "truncated"), lead=(), traj=None):
    """A synthetic [*lead, T] batch: observation t, next observation t + 1; ``ends``
    marks ``("next", f)`` for the flags named."""
    shape = (*lead, T)
    obs = torch.arange(T + 1, dtype=torch.float32).expand(*lead, T + 1)[..., None].expand(*lead, T + 1, 3).contiguous()
    end = torch.zeros(shape, dtype=torch.bool)
    end[..., ends] = True
    nxt = {"observation": obs[..., 1:, :], "reward": torch.ones(*shape, 1)}
    for f in flags:
        nxt[f] = end[..., None].clone() if f != "truncated" else torch.zeros(*shape, 1, dtype=torch.bool)
    data = {"observation": obs[..., :-1, :], "action": torch.zeros(*shape, 1), "next": nxt}
    if traj is not None:
        data["collector"] = {"traj_ids": traj}
    return tensordict.TensorDict(data, list(shape))


def test_flag_rules_and_leading_dims(tmp_path):
    # done alone counts as terminated
    rb = ReplayBuffer(tmp_path / "a", capacity=100)
    rb.extend(_episode_td(10, [4, 9], flags=("done",)))
    got = rb.buffer.get(np.arange(10))
    assert got["terminated"].nonzero().flatten().tolist() == [4, 9] and not got["truncated"].any()
    assert rb.sample(4)["next", "done"].shape == (4, 1)
    # done with terminated False (and no truncated key) is a truncation
    td = _episode_td(10, [4, 9], flags=("done", "terminated"))
    td["next", "terminated"][9] = False
    rb = ReplayBuffer(tmp_path / "b", capacity=100)
    rb.extend(td)
    got = rb.buffer.get(np.arange(10))
    assert got["terminated"].nonzero().flatten().tolist() == [4] and got["truncated"].nonzero().flatten().tolist() == [9]
    # [2, 3, T]: six environments, six streams
    rb = ReplayBuffer(tmp_path / "c", capacity=600)
    index = rb.extend(_episode_td(10, [9], lead=(2, 3)))
    assert rb.buffer.num_streams == 6 and index.shape == (2, 3, 10) and len(rb) == 60
    assert rb.buffer.layout.lane(index.flatten().numpy()).tolist() == np.repeat(np.arange(6), 10).tolist()
    # a trajectory id that changes with no episode end (a collector reset) ends the episode as truncated
    traj = torch.tensor([[0] * 5 + [2] * 5, [1] * 10])
    rb = ReplayBuffer(tmp_path / "d", capacity=100)
    rb.extend(_episode_td(10, [], lead=(2,), traj=traj))
    rb.commit()
    got = rb.buffer.get(rb.buffer.layout.rows(0, np.arange(10)))
    assert got["truncated"].nonzero().flatten().tolist() == [4, 9]
    assert got["next_obs"][4].tolist() == [5.0] * 3  # its own next observation, kept as the final one


def test_add_one_step(tmp_path):
    rb = ReplayBuffer(tmp_path / "rb", capacity=100, batch_size=2)
    steps = _episode_td(3, [2])
    assert rb.add(steps[0]) == 0 and len(rb) == 1  # stored and sampleable at once
    assert rb.sample(2)["next", "observation"].tolist() == [[1.0] * 3] * 2
    assert rb.add(steps[1]) == 1 and rb.add(steps[2]) == 2  # one episode, continued twice
    assert len(rb) == 3 and rb.buffer.num_episodes == 1
    assert rb.buffer.get(np.arange(3))["next_obs"][:, 0].tolist() == [1.0, 2.0, 3.0]


def test_priority_key_in_extended_data_sets_priorities(tmp_path):
    rb = ReplayBuffer(tmp_path / "rb", capacity=100, sampler=mb.samplers.Prioritized(),
                      priorities=mb.PriorityConfig(alpha=1.0, eps=0.0))
    td = _episode_td(10, [9])
    td["td_error"] = torch.arange(10, dtype=torch.float32)[:, None]
    index = rb.extend(td)
    np.testing.assert_allclose(rb.buffer.leaf_priorities(index), np.arange(10))
    assert "td_error" not in rb.buffer.columns


def test_commits_leave_no_open_episode_and_the_ring_wraps(tmp_path, cartpole):
    batches, _ = cartpole
    rb = ReplayBuffer(tmp_path / "rb", capacity=2 * 60, batch_size=64, generator=torch.Generator().manual_seed(0))
    whole = torch.cat(list(batches), dim=1)
    for i, td in enumerate(batches):
        rb.extend(td)
        if i == 1:  # 47 + 48 uncommitted rows would pass a lane of 60: committed first
            assert rb.buffer.generation >= 1
            with mb.open(tmp_path / "rb", mode="r") as ro:  # what a crash would leave
                view = ro.view()
                assert all(lv.open_start == int(view.written[s]) for s, lv in enumerate(view.lanes))
    # 144 rows per env through a lane of 60: the sampled rows are still the collector's
    s = rb.sample()
    buf = rb.buffer
    rows = s["index"].numpy()
    env, pos = buf.layout.lane(rows), buf.layout.absolute(rows, buf.view().written)
    want = whole[torch.from_numpy(env), torch.from_numpy(pos)]
    torch.testing.assert_close(s["observation"], want["observation"])
    torch.testing.assert_close(s["next", "observation"], want["next", "observation"])
    assert pos.min() >= 144 - 60


def test_more_than_a_lane_per_extend_and_dangling_streams_are_refused(tmp_path):
    rb = ReplayBuffer(tmp_path / "rb", capacity=20)
    with pytest.raises(mb.errors.CapacityError, match="at most a lane of 20 rows"):
        rb.extend(_episode_td(30, [29]))
    rb.extend(_episode_td(10, [9]))
    rb.close()
    buf = mb.open(tmp_path / "rb")  # other code leaves an episode open
    buf.extend({"obs": np.zeros((3, 3)), "action": np.zeros((3, 1)), "reward": np.zeros((3, 1))})
    buf.close()
    rb = ReplayBuffer(tmp_path / "rb")
    n = len(rb)
    with pytest.raises(mb.errors.SchemaError, match="stream 0 .* ends in an open episode"):
        rb.extend(_episode_td(5, [4]))
    assert len(rb) == n


def test_load_state_dict_refuses_an_older_store(tmp_path):
    rb = ReplayBuffer(tmp_path / "rb", capacity=100, batch_size=4)
    rb.extend(_episode_td(10, [9]))
    state = rb.state_dict()
    state["generation"] += 5
    with pytest.raises(mb.errors.CorruptStoreError, match="commit"):
        rb.load_state_dict(state)
    with pytest.raises(mb.errors.InvalidArgumentError, match="state_dict"):
        rb.load_state_dict({})


def test_a_converted_torchrl_dump_opens_in_torchrl_layout(tmp_path, cartpole):
    batches, _ = cartpole
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

    ref = TensorDictReplayBuffer(storage=LazyMemmapStorage(1000), batch_size=32)
    flat = torch.cat([td.reshape(-1) for td in batches])
    ref.extend(flat)
    ref.dumps(tmp_path / "dump")
    with warnings.catch_warnings():  # the converter notes the env boundaries of the flattening
        warnings.simplefilter("ignore", mb.convert.ConversionWarning)
        summary = mb.convert.convert("torchrl", tmp_path / "dump", tmp_path / "store", progress=False)
    assert summary["forced_truncations"] > 0
    rb = ReplayBuffer(tmp_path / "store", batch_size=32)
    s, r = rb.sample(), ref.sample()
    assert _leaves(s) == _leaves(r)
    want = flat[s["index"]]  # one stream, rows in the dump's order
    for key in ["observation", ("next", "observation"), "action", ("next", "reward"), ("next", "terminated")]:
        torch.testing.assert_close(s[key], want[key])
    rb.extend(batches[0])  # and collector batches go on into it
