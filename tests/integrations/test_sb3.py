"""mmbuffer.sb3: SB3's replay buffers on disk, checked against SB3's own buffers."""

from __future__ import annotations

import pickle
import time
from copy import deepcopy
from pathlib import Path

import numpy as np
import pytest
import torch
import warm

sb3 = pytest.importorskip("stable_baselines3")
gym = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402
from stable_baselines3 import DQN, SAC  # noqa: E402
from stable_baselines3.common import buffers as sb3_buffers  # noqa: E402
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize  # noqa: E402

import mmbuffer as mb  # noqa: E402
import mmbuffer.sb3  # noqa: E402
from mmbuffer import errors  # noqa: E402


# -- transitions as SB3's off-policy loop produces them --------------------------------
def vec_steps(obs_space, action_space, n_envs, steps, seed=0, broken_every=0, max_len=12):
    """``steps`` calls' worth of ``add`` arguments for ``n_envs`` envs: random episode
    lengths, terminations and timeouts (``TimeLimit.truncated``), ``next_obs`` the true
    final observation at an episode end, the next ``obs`` a reset observation there
    (the following one otherwise); with ``broken_every``, an env's ``obs`` now and
    then is not the previous ``next_obs`` though nothing ended (a user's own add)."""
    rng = np.random.default_rng(seed)
    obs_space.seed(seed)
    action_space.seed(seed)

    def one_obs():
        return obs_space.sample()

    def stack(items):
        if isinstance(obs_space, spaces.Dict):
            return {k: np.stack([o[k] for o in items]) for k in obs_space.spaces}
        return np.stack(items)

    current = [one_obs() for _ in range(n_envs)]
    left = rng.integers(1, max_len, size=n_envs)
    out = []
    for t in range(steps):
        nxt, done, infos = [], np.zeros(n_envs, bool), []
        new_current = []
        for e in range(n_envs):
            following = one_obs()
            left[e] -= 1
            info = {}
            if left[e] == 0:
                done[e] = True
                if rng.random() < 0.4:
                    info["TimeLimit.truncated"] = True
                left[e] = rng.integers(1, max_len)
                new_current.append(one_obs())  # the reset observation
            elif broken_every and rng.random() < 1 / broken_every:
                new_current.append(one_obs())  # not the next_obs given: a chain break
            else:
                new_current.append(following)
            nxt.append(following)
            infos.append(info)
        actions = np.stack([action_space.sample() for _ in range(n_envs)])
        rewards = rng.standard_normal(n_envs).astype(np.float32)
        out.append((deepcopy(stack(current)), stack(nxt), actions, rewards, done, infos))
        current = new_current
    return out


def same_samples(a, b):
    assert type(a) is type(b)
    for field, x, y in zip(a._fields, a, b):
        if x is None:  # discounts (n-step buffers only)
            assert y is None, field
            continue
        if isinstance(x, dict):
            assert x.keys() == y.keys(), field
            pairs = [(f"{field}.{k}", x[k], y[k]) for k in x]
        else:
            pairs = [(field, x, y)]
        for name, u, v in pairs:
            assert u.dtype == v.dtype, (name, u.dtype, v.dtype)
            assert u.shape == v.shape, (name, u.shape, v.shape)
            assert u.device == v.device, name
            assert torch.equal(u, v), name


def compare_all(theirs, mine, seed, env=None):
    """Every slot below size(), several times over, with the same env draws."""
    assert mine.size() == theirs.size() and mine.pos == theirs.pos and mine.full == theirs.full
    inds = np.tile(np.arange(theirs.size()), 4)
    np.random.seed(seed)
    a = theirs._get_samples(inds, env=env)
    np.random.seed(seed)
    b = mine._get_samples(inds, env=env)
    same_samples(a, b)
    for name in ("observations", "next_observations", "actions", "rewards", "dones", "timeouts"):
        x, y = getattr(theirs, name), getattr(mine, name)  # SB3's arrays; the drop-in's views of the store
        pairs = [(x[k], y[k]) for k in x] if isinstance(x, dict) else [(x, y)]
        for u, v in pairs:
            assert v.shape == u.shape and v.dtype == u.dtype, name
            assert np.array_equal(np.asarray(v), u), name
    np.random.seed(seed)
    a = theirs.sample(64, env=env)
    np.random.seed(seed)
    b = mine.sample(64, env=env)
    same_samples(a, b)


SPACES = {
    "box-discrete": (spaces.Box(-5, 5, (3,), np.float32), spaces.Discrete(4)),
    "pixels-box64": (spaces.Box(0, 255, (2, 4, 4), np.uint8), spaces.Box(-1, 1, (2,), np.float64)),
    "discrete-obs": (spaces.Discrete(7), spaces.MultiDiscrete([3, 2])),
}


@pytest.mark.parametrize("name", sorted(SPACES))
@pytest.mark.parametrize("n_envs", [1, 2])
@pytest.mark.parametrize("timeouts", [True, False])
@pytest.mark.parametrize("hold,commit_every", [(64, 7), (5, 1000), (2, 11)])
def test_samples_equal_sb3(tmp_path, name, n_envs, timeouts, hold, commit_every):
    obs_space, action_space = SPACES[name]
    size = 17 * n_envs  # 17 slots per env: the ring wraps; episodes up to 29 steps are cut at the lane
    theirs = sb3_buffers.ReplayBuffer(size, obs_space, action_space, device="cpu", n_envs=n_envs,
                                      handle_timeout_termination=timeouts)
    cls = type("Hold", (mmbuffer.sb3.ReplayBuffer,), {"_hold_steps": hold})
    mine = cls(size, obs_space, action_space, device="cpu", n_envs=n_envs,
               handle_timeout_termination=timeouts, path=tmp_path / "r", commit_every=commit_every)
    assert isinstance(mine, sb3_buffers.ReplayBuffer)
    steps = vec_steps(obs_space, action_space, n_envs, 90, seed=n_envs, broken_every=25, max_len=30)
    for t, args in enumerate(steps):
        theirs.add(*deepcopy(args))
        mine.add(*args)
        compare_all(theirs, mine, seed=t)
    mine.close()  # held rows written as episode ends: the same samples after reopening
    compare_all(theirs, mine, seed=99)
    again = cls(size, obs_space, action_space, device="cpu", n_envs=n_envs,
                handle_timeout_termination=timeouts, path=tmp_path / "r")
    compare_all(theirs, again, seed=100)
    again.close()


@pytest.mark.parametrize("n_envs", [1, 3])
def test_one_slot_per_env_equal_sb3(tmp_path, n_envs):
    obs_space, action_space = SPACES["box-discrete"]
    theirs = sb3_buffers.ReplayBuffer(n_envs, obs_space, action_space, device="cpu", n_envs=n_envs)
    mine = mmbuffer.sb3.ReplayBuffer(n_envs, obs_space, action_space, device="cpu", n_envs=n_envs, path=tmp_path / "o")
    for t, args in enumerate(vec_steps(obs_space, action_space, n_envs, 12, seed=4, broken_every=3)):
        theirs.add(*deepcopy(args))
        mine.add(*args)
        compare_all(theirs, mine, seed=t)
    mine.close()
    compare_all(theirs, mine, seed=50)


def test_dict_samples_equal_sb3(tmp_path):
    obs_space = spaces.Dict({"image": spaces.Box(0, 255, (3, 3), np.uint8), "vec": spaces.Box(-1, 1, (2,), np.float32)})
    action_space = spaces.Box(-1, 1, (2,), np.float32)
    theirs = sb3_buffers.DictReplayBuffer(26, obs_space, action_space, device="cpu", n_envs=2)
    mine = mmbuffer.sb3.DictReplayBuffer(26, obs_space, action_space, device="cpu", n_envs=2, path=tmp_path / "d")
    assert isinstance(mine, sb3_buffers.DictReplayBuffer)
    for t, args in enumerate(vec_steps(obs_space, action_space, 2, 40, seed=3, broken_every=7)):
        theirs.add(*deepcopy(args))
        mine.add(*args)
        compare_all(theirs, mine, seed=t)
    assert isinstance(mine.sample(8), DictReplayBufferSamples)
    mine.close()


def test_vecnormalize_at_sampling(tmp_path):
    venv = VecNormalize(DummyVecEnv([lambda: gym.make("Pendulum-v1")]), gamma=0.9)
    venv.obs_rms.mean, venv.obs_rms.var = np.array([0.5, -0.5, 1.0]), np.array([2.0, 3.0, 0.5])
    venv.ret_rms.var = np.array(4.0)
    obs_space, action_space = venv.observation_space, venv.action_space
    theirs = sb3_buffers.ReplayBuffer(40, obs_space, action_space, device="cpu")
    mine = mmbuffer.sb3.ReplayBuffer(40, obs_space, action_space, device="cpu", path=tmp_path / "n")
    for args in vec_steps(obs_space, action_space, 1, 30):
        theirs.add(*deepcopy(args))
        mine.add(*args)
    compare_all(theirs, mine, seed=1, env=venv)
    mine.close()


def test_timeouts_and_dones_values(tmp_path):
    """Hand-made: next obs across an episode end and a timeout, dones = done * (1 - timeout)."""
    box = spaces.Box(-100, 100, (1,), np.float32)
    rb = mmbuffer.sb3.ReplayBuffer(20, box, spaces.Discrete(2), device="cpu", path=tmp_path / "t")
    o = lambda v: np.array([[v]], np.float32)  # noqa: E731
    rb.add(o(0), o(1), np.array([0]), np.array([1.0]), np.array([False]), [{}])
    rb.add(o(1), o(2), np.array([1]), np.array([2.0]), np.array([True]), [{}])  # terminated, final obs 2
    rb.add(o(10), o(11), np.array([0]), np.array([3.0]), np.array([True]), [{"TimeLimit.truncated": True}])
    rb.add(o(20), o(21), np.array([1]), np.array([4.0]), np.array([False]), [{}])
    s = rb._get_samples(np.arange(4), env_indices=np.zeros(4, np.int64))
    assert s.observations[:, 0].tolist() == [0, 1, 10, 20]
    assert s.next_observations[:, 0].tolist() == [1, 2, 11, 21]
    assert s.dones[:, 0].tolist() == [0, 1, 0, 0]
    assert s.rewards.shape == (4, 1) and s.rewards.dtype == torch.float32 and s.dones.dtype == torch.float32
    rb.close()
    store = mb.open(tmp_path / "t", mode="r")  # the episode structure on disk
    assert store.read("terminated", np.arange(4)).tolist() == [False, True, False, False]
    assert store.read("truncated", np.arange(4)).tolist() == [False, False, True, True]  # the held row: closed
    store.close()


# -- frame stacks (VecFrameStack): one frame stored a step ---------------------------------
class RandomFrames(gym.Env):
    """Random frames, episodes of random lengths ending terminated or truncated (DummyVecEnv
    sets TimeLimit.truncated and terminal_observation, VecFrameStack stacks both)."""

    def __init__(self, shape, dtype, seed, max_len):
        self.observation_space = (spaces.Box(0, 255, shape, np.uint8) if dtype == np.uint8
                                  else spaces.Box(-5, 5, shape, np.float32))
        self.action_space = spaces.Discrete(3)
        self.rng, self.max_len, self.left = np.random.default_rng(seed), max_len, 0

    def frame(self):
        if self.observation_space.dtype == np.uint8:
            return self.rng.integers(0, 256, self.observation_space.shape, dtype=np.uint8)
        return self.rng.standard_normal(self.observation_space.shape).astype(np.float32)

    def reset(self, *, seed=None, options=None):
        self.left = int(self.rng.integers(1, self.max_len))
        return self.frame(), {}

    def step(self, action):
        self.left -= 1
        end = self.left == 0
        term = bool(end and self.rng.random() < 0.5)
        return self.frame(), float(self.rng.standard_normal()), term, bool(end and not term), {}


def stacked_env(shape, dtype, n_envs, k, seed=0, max_len=24):
    from stable_baselines3.common.vec_env import VecFrameStack

    return VecFrameStack(DummyVecEnv([lambda e=e: RandomFrames(shape, dtype, seed * 10 + e, max_len) for e in range(n_envs)]), k)


def collect(venv, steps, seed=0):
    """``add`` arguments as SB3's ``collect_rollouts`` / ``_store_transition`` give them."""
    rng = np.random.default_rng(seed)
    obs, out = venv.reset(), []
    for _ in range(steps):
        actions = rng.integers(0, 3, size=venv.num_envs)
        new_obs, rewards, dones, infos = venv.step(actions)
        next_obs = new_obs.copy()
        for i, done in enumerate(dones):
            if done and infos[i].get("terminal_observation") is not None:
                next_obs[i] = infos[i]["terminal_observation"]
        out.append((obs.copy(), next_obs, actions.reshape(-1, 1), rewards.astype(np.float32), dones.copy(), deepcopy(infos)))
        obs = new_obs.copy()
    return out


FRAMES = {  # single frame, dtype, k, the stack axis VecFrameStack picks
    "gray-last": ((6, 5, 1), np.uint8, 4, "last"),
    "rgb-last": ((6, 5, 3), np.uint8, 4, "last"),
    "first": ((2, 6, 5), np.uint8, 3, "first"),
    "vector": ((3,), np.float32, 4, "last"),
}


@pytest.mark.parametrize("name", sorted(FRAMES))
@pytest.mark.parametrize("n_envs", [1, 2])
@pytest.mark.parametrize("hold,commit_every", [(64, 7), (5, 1000), (2, 11)])
def test_frame_stack_samples_equal_sb3(tmp_path, name, n_envs, hold, commit_every):
    """VecFrameStack's stacked transitions into SB3's buffer and into the drop-in with
    frame_stack=k (single frames stored): the same samples, observations and next
    observations across episode ends, timeouts, commits, lane cuts and the wrapped ring."""
    frame, dtype, k, order = FRAMES[name]
    venv = stacked_env(frame, dtype, n_envs, k, seed=n_envs)
    assert venv.stacked_obs.channels_first == (order == "first")
    obs_space, action_space = venv.observation_space, venv.action_space
    size = 17 * n_envs  # the ring wraps; episodes up to 23 steps are cut at the lane
    theirs = sb3_buffers.ReplayBuffer(size, obs_space, action_space, device="cpu", n_envs=n_envs)
    cls = type("Hold", (mmbuffer.sb3.ReplayBuffer,), {"_hold_steps": hold})
    kw = dict(device="cpu", n_envs=n_envs, path=tmp_path / "r", frame_stack=k)
    mine = cls(size, obs_space, action_space, commit_every=commit_every, **kw)
    steps = collect(venv, 110, seed=n_envs)
    assert sum(int(d.sum()) for *_, d, _ in steps) > 4 and any(i.get("TimeLimit.truncated") for *_, i in steps for i in i)
    for t, args in enumerate(steps[:90]):
        theirs.add(*deepcopy(args))
        mine.add(*args)
        compare_all(theirs, mine, seed=t)
    mine.close()
    compare_all(theirs, mine, seed=99)
    again = cls(size, obs_space, action_space, **kw)  # reopened: the next adds are checked against the store
    compare_all(theirs, again, seed=100)
    for t, args in enumerate(steps[90:]):
        theirs.add(*deepcopy(args))
        again.add(*args)
        compare_all(theirs, again, seed=200 + t)
    again.close()
    store = mb.open(tmp_path / "r", mode="r")
    assert tuple(store.columns["obs"].shape) == frame  # one frame a step
    assert store.capacity == (17 + k - 1) * n_envs  # k - 1 rows more per lane: the oldest slot's older frames
    store.close()


@pytest.mark.parametrize("n_envs", [1, 3])
def test_frame_stack_one_slot_per_env_equal_sb3(tmp_path, n_envs):
    """buffer_size 1 per env, shorter than the stack: the lane keeps the k - 1 older frames."""
    venv = stacked_env((6, 5, 1), np.uint8, n_envs, 4, seed=3, max_len=6)
    theirs = sb3_buffers.ReplayBuffer(n_envs, venv.observation_space, venv.action_space, device="cpu", n_envs=n_envs)
    mine = mmbuffer.sb3.ReplayBuffer(n_envs, venv.observation_space, venv.action_space, device="cpu", n_envs=n_envs,
                                     path=tmp_path / "o", frame_stack=4)
    for t, args in enumerate(collect(venv, 30, seed=3)):
        theirs.add(*deepcopy(args))
        mine.add(*args)
        compare_all(theirs, mine, seed=t)
    mine.close()
    compare_all(theirs, mine, seed=50)


def test_frame_stack_mismatch_is_refused(tmp_path):
    frame, dtype, k, _ = FRAMES["gray-last"]
    venv = stacked_env(frame, dtype, 1, k, seed=5, max_len=8)
    steps = collect(venv, 30, seed=5)
    rb = mmbuffer.sb3.ReplayBuffer(50, venv.observation_space, venv.action_space, device="cpu",
                                   path=tmp_path / "m", frame_stack=k)
    for args in steps[:3]:
        rb.add(*args)
    obs, nxt, *rest = steps[3]
    bad = obs.copy()
    bad[0, 0, 0, 1] ^= 1  # an older frame that is not the previous step's
    with pytest.raises(errors.InvalidArgumentError, match=r"frame_stack: env 0 at step 3: expected obs's older 3 frames"):
        rb.add(bad, nxt, *rest)
    bad_next = nxt.copy()
    bad_next[0, 0, 0, 0] ^= 1  # next_obs does not shift the stack
    with pytest.raises(errors.InvalidArgumentError, match="frame_stack.*next_obs"):
        rb.add(obs, bad_next, *rest)
    assert rb.size() == 3  # refused before anything was written
    for args in steps[3:]:
        rb.add(*args)  # the true steps still go on
    first = next(t for t, (*_, d, _) in enumerate(steps) if d[0])  # a step after an episode end: zeros before
    obs, nxt, *rest = steps[first + 1]
    assert not obs[0, ..., :-1].any()
    rb.close()
    rb2 = mmbuffer.sb3.ReplayBuffer(50, venv.observation_space, venv.action_space, device="cpu",
                                    path=tmp_path / "m2", frame_stack=k)
    fresh = obs.copy()
    fresh[0, ..., 0] = 7  # a first step whose older frames are not zeros
    with pytest.raises(errors.InvalidArgumentError, match="zeros before the episode's first step"):
        rb2.add(fresh, nxt, *rest)
    assert not steps[0][4][0]  # the first step does not end its episode
    rb2.add(*steps[0])
    frames = rb2._stack.split(steps[0][1])  # next_obs: its newest frame starts a new episode, no done between
    restart = np.zeros_like(steps[0][1])
    restart[0, ..., -1:] = frames[0, -1]
    nxt = restart.copy()
    nxt[0, ..., 2:3] = frames[0, -1]
    rb2.add(restart, nxt, *steps[1][2:])  # accepted: zeros are what the store rebuilds (depth 0)
    s = rb2._get_samples(np.arange(2), env_indices=np.zeros(2, np.int64))
    assert np.array_equal(s.observations[1].numpy(), restart[0]) and np.array_equal(s.next_observations[1].numpy(), nxt[0])
    rb2.close()
    with pytest.raises(errors.SchemaError):  # a stacked store is not a plain one
        mmbuffer.sb3.ReplayBuffer(50, venv.observation_space, venv.action_space, device="cpu", path=tmp_path / "m")


# -- pickling, resuming -------------------------------------------------------------------
def small_dqn(path, **kw):
    return DQN("MlpPolicy", gym.make("CartPole-v1"), buffer_size=500, learning_starts=50, batch_size=16,
               policy_kwargs={"net_arch": [16]}, seed=0, replay_buffer_class=mmbuffer.sb3.ReplayBuffer,
               replay_buffer_kwargs={"path": str(path), **kw})


def test_save_load_replay_buffer(tmp_path):
    """SB3's test_save_load_replay_buffer pattern, in one process."""
    pkl = tmp_path / "logs" / "replay_buffer.pkl"
    pkl.parent.mkdir(parents=True)
    model = small_dqn(tmp_path / "replay")
    model.learn(150)
    model.save_replay_buffer(pkl)
    assert pkl.stat().st_size < 20_000  # the path and the cursor, not the data
    old = deepcopy(model.replay_buffer)
    del model.replay_buffer
    with pytest.raises(AttributeError):
        model.replay_buffer  # noqa: B018
    model.load_replay_buffer(pkl)
    rb = model.replay_buffer
    steps = model.num_timesteps  # 152: DQN collects 4 steps between trainings
    assert isinstance(rb, mmbuffer.sb3.ReplayBuffer) and rb.size() == old.size() == steps
    for name in ("observations", "next_observations", "actions", "rewards", "dones", "timeouts"):
        assert np.allclose(getattr(old, name), getattr(rb, name)), name  # SB3's own check, on the views
    np.random.seed(0)
    a = old.sample(100)
    np.random.seed(0)
    same_samples(a, rb.sample(100))
    old.close()
    # SB3's test extends the loaded buffer with the old arrays (BaseBuffer.extend: add per slot)
    n = rb.buffer_size
    rb.extend(old.observations, old.next_observations, old.actions, old.rewards, old.dones, [[{}]] * n)
    assert rb.size() == n and rb.full
    model.train(gradient_steps=1, batch_size=16)
    model.learn(60, reset_num_timesteps=False)  # the loaded buffer writes on
    adds = n + model.num_timesteps  # steps added: the extend's and both learns'
    assert rb.size() == n and rb.pos == adds % n
    # into a new model, as after a restart
    rb.close()
    model2 = small_dqn(tmp_path / "other")
    model2.load_replay_buffer(pkl)
    assert model2.replay_buffer.pos == adds % n and model2.replay_buffer.path == rb.path
    model2.learn(20)
    assert model2.replay_buffer.pos == (adds + 20) % n
    model2.replay_buffer.close()


def test_pickled_buffer_keeps_working_and_lock(tmp_path):
    """After save_replay_buffer the saving model trains on (it reopens the store);
    a second writer of the same store is refused with LockedError."""
    model = small_dqn(tmp_path / "replay")
    model.learn(80)
    blob = pickle.dumps(model.replay_buffer)
    model.learn(20, reset_num_timesteps=False)
    assert model.replay_buffer.size() == model.num_timesteps > 80
    copy = pickle.loads(blob)
    with pytest.raises(errors.LockedError):
        copy.add(*vec_steps(copy.observation_space, copy.action_space, 1, 1)[0])
    model.replay_buffer.close()
    with pytest.raises(errors.CorruptStoreError):  # the store moved on: the copy's cursor is stale
        copy.add(*vec_steps(copy.observation_space, copy.action_space, 1, 1)[0])


SAVER = """
import sys, numpy as np, gymnasium as gym
from stable_baselines3 import DQN
import mmbuffer.sb3
model = DQN("MlpPolicy", gym.make("CartPole-v1"), buffer_size=500, learning_starts=50, batch_size=16,
            policy_kwargs={"net_arch": [16]}, seed=0, replay_buffer_class=mmbuffer.sb3.ReplayBuffer,
            replay_buffer_kwargs={"path": sys.argv[1]})
model.learn(150)
model.save_replay_buffer(sys.argv[2])
np.random.seed(7)
np.save(sys.argv[3], model.replay_buffer.sample(64).next_observations.numpy())
print(model.num_timesteps)
"""


def test_load_replay_buffer_in_a_new_process(tmp_path):
    out = warm.run(SAVER, [str(tmp_path / "replay"), str(tmp_path / "rb.pkl"), str(tmp_path / "s.npy")], check=True,
                   timeout=300)
    steps = int(out.stdout.split()[-1])
    model = small_dqn(tmp_path / "fresh")
    model.load_replay_buffer(tmp_path / "rb.pkl")
    rb = model.replay_buffer
    assert rb.size() == steps and rb.pos == steps
    np.random.seed(7)
    assert np.array_equal(rb.sample(64).next_observations.numpy(), np.load(tmp_path / "s.npy"))
    model.learn(40, reset_num_timesteps=False)  # the new model's own count starts at 0
    assert rb.size() == steps + model.num_timesteps
    rb.close()


def test_pickle_of_a_missing_store(tmp_path):
    model = small_dqn(tmp_path / "replay")
    model.learn(60)
    blob = pickle.dumps(model.replay_buffer)
    (tmp_path / "replay").rename(tmp_path / "moved")
    with pytest.raises(errors.StoreNotFoundError):
        pickle.loads(blob)


def test_resume_from_path(tmp_path):
    model = small_dqn(tmp_path / "replay")
    model.learn(120)
    steps = model.num_timesteps
    np.random.seed(5)
    before = model.replay_buffer.sample(50)
    model.replay_buffer.close()
    again = small_dqn(tmp_path / "replay")  # a new process passes the same path
    assert again.replay_buffer.size() == steps and again.replay_buffer.pos == steps
    np.random.seed(5)
    same_samples(before, again.replay_buffer.sample(50))
    again.replay_buffer.close()
    with pytest.raises(errors.SchemaError):  # another env's store
        SAC("MlpPolicy", gym.make("Pendulum-v1"), buffer_size=500, replay_buffer_class=mmbuffer.sb3.ReplayBuffer,
            replay_buffer_kwargs={"path": str(tmp_path / "replay")})
    with pytest.raises(errors.SchemaError):  # another buffer size
        DQN("MlpPolicy", gym.make("CartPole-v1"), buffer_size=400, replay_buffer_class=mmbuffer.sb3.ReplayBuffer,
            replay_buffer_kwargs={"path": str(tmp_path / "replay")})


CRASH = """
import os, sys, numpy as np
from gymnasium import spaces
import mmbuffer.sb3
rb = mmbuffer.sb3.ReplayBuffer(10000, spaces.Box(-1e6, 1e6, (2,), np.float32), spaces.Discrete(2), device="cpu",
                               path=sys.argv[1], commit_every=100, commit_seconds=1e6)
for t in range(250):
    o = np.full((1, 2), t, np.float32)
    rb.add(o, o + 1, np.array([0]), np.array([1.0]), np.array([t % 40 == 39]), [{}])
os._exit(0)  # no close: a crash
"""


def test_crash_loses_at_most_commit_every(tmp_path):
    warm.run(CRASH, [str(tmp_path / "c")], check=True, timeout=120)
    rb = mmbuffer.sb3.ReplayBuffer(10000, spaces.Box(-1e6, 1e6, (2,), np.float32), spaces.Discrete(2), device="cpu",
                                   path=tmp_path / "c")
    assert rb.size() == 200  # the commits at 100 and 200 steps
    s = rb._get_samples(np.arange(200), env_indices=np.zeros(200, np.int64))
    assert torch.equal(s.next_observations, s.observations + 1)
    assert s.dones[:, 0].tolist() == [float(t % 40 == 39) for t in range(200)]
    rb.close()


# -- refusals ---------------------------------------------------------------------------
def test_typed_refusals(tmp_path):
    box, act = spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(2)
    with pytest.raises(errors.InvalidArgumentError, match="frame_stack.*VecFrameStack"):
        mmbuffer.sb3.ReplayBuffer(10, box, act, path=tmp_path / "a", frame_stack=4)  # (2,) does not stack 4 frames
    with pytest.raises(errors.InvalidArgumentError, match="frame_stack.*both"):  # (4, 8, 4): (1, 8, 4) or (4, 8, 1)
        mmbuffer.sb3.ReplayBuffer(10, spaces.Box(0, 255, (4, 8, 4), np.uint8), act, path=tmp_path / "a", frame_stack=4)
    with pytest.raises(errors.InvalidArgumentError, match="frame_stack.*Dict"):
        mmbuffer.sb3.DictReplayBuffer(10, spaces.Dict({"x": box}), act, path=tmp_path / "a", frame_stack=1)
    with pytest.raises(errors.InvalidArgumentError, match="channels_order"):
        mmbuffer.sb3.ReplayBuffer(10, box, act, path=tmp_path / "a", channels_order="last")
    with pytest.raises(errors.InvalidArgumentError, match="path"):
        mmbuffer.sb3.ReplayBuffer(10, box, act)
    with pytest.raises(errors.InvalidArgumentError, match="commit_every"):
        mmbuffer.sb3.ReplayBuffer(10, box, act, path=tmp_path / "a", commit_every=0)
    with pytest.raises(errors.InvalidArgumentError, match="observation_space"):
        mmbuffer.sb3.DictReplayBuffer(10, box, act, path=tmp_path / "a")
    rb = mmbuffer.sb3.ReplayBuffer(10, box, act, device="cpu", path=tmp_path / "a")
    with pytest.raises(errors.InvalidArgumentError, match="reset"):
        rb.reset()
    assert not (tmp_path / "a").exists()  # nothing added, nothing created


# -- real trainings -----------------------------------------------------------------------
def params(policy):
    return [p.detach().clone() for p in policy.parameters()]


def test_dqn_cartpole_trains(tmp_path):
    t0 = time.perf_counter()
    model = DQN("MlpPolicy", gym.make("CartPole-v1"), buffer_size=1000, learning_starts=100, batch_size=32,
                train_freq=4, target_update_interval=50, policy_kwargs={"net_arch": [32]}, seed=1,
                replay_buffer_class=mmbuffer.sb3.ReplayBuffer, replay_buffer_kwargs={"path": str(tmp_path / "dqn")})
    before = params(model.policy.q_net)
    model.learn(400)
    rb = model.replay_buffer
    assert rb.size() == model.num_timesteps == 400 and model._n_updates > 0
    assert "train/loss" in model.logger.name_to_value or model._n_updates >= 70
    assert any(not torch.equal(a, b) for a, b in zip(before, params(model.policy.q_net)))
    rb.close()
    store = mb.open(tmp_path / "dqn", mode="r")
    assert int(store.view().written[0]) == 400
    store.close()
    assert time.perf_counter() - t0 < 60


def test_sac_pendulum_two_envs_trains(tmp_path):
    from stable_baselines3.common.env_util import make_vec_env

    env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
    model = SAC("MlpPolicy", env, buffer_size=1000, learning_starts=100, batch_size=32,
                policy_kwargs={"net_arch": [32]}, seed=0,
                replay_buffer_class=mmbuffer.sb3.ReplayBuffer, replay_buffer_kwargs={"path": str(tmp_path / "sac")})
    before = params(model.policy.actor)
    model.learn(300)  # 150 steps of 2 envs
    rb = model.replay_buffer
    assert rb.n_envs == 2 and rb.size() == 150 and model._n_updates > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, params(model.policy.actor)))
    s = rb.sample(32)
    assert isinstance(s, ReplayBufferSamples) and s.observations.shape == (32, 3) and s.actions.dtype == torch.float32
    rb.close()


class QuarterFrames(gym.ObservationWrapper):
    """Grayscale ALE frames subsampled 4x in numpy (SB3's AtariWrapper needs OpenCV)."""

    def __init__(self, env):
        super().__init__(env)
        h, w = env.observation_space.shape
        self.observation_space = spaces.Box(0, 255, ((h + 3) // 4, (w + 3) // 4, 1), np.uint8)

    def observation(self, obs):
        return obs[::4, ::4, None]


def test_dqn_cnn_on_ale_pong_trains(tmp_path):
    ale_py = pytest.importorskip("ale_py")
    from stable_baselines3.common.vec_env import VecFrameStack

    gym.register_envs(ale_py)
    env = VecFrameStack(DummyVecEnv([lambda: QuarterFrames(gym.make("ALE/Pong-v5", obs_type="grayscale",
                                                                     max_episode_steps=120))]), 4)
    model = DQN("CnnPolicy", env, buffer_size=2000, learning_starts=150, batch_size=16, train_freq=8, seed=0,
                policy_kwargs={"features_extractor_kwargs": {"features_dim": 64}},
                replay_buffer_class=mmbuffer.sb3.ReplayBuffer, replay_buffer_kwargs={"path": str(tmp_path / "pong")})
    before = params(model.policy.q_net)
    model.learn(304)  # two episodes end (timeouts): final observations stored, not the reset ones
    rb = model.replay_buffer
    assert rb.size() == 304 and model._n_updates > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, params(model.policy.q_net)))
    s = rb._get_samples(np.arange(304), env_indices=np.zeros(304, np.int64))
    assert s.observations.dtype == torch.uint8 and s.observations.shape == (304, 4, 53, 40)
    # inside an episode, next obs is the following obs (the newest of its 4 frames is new)
    ends = np.flatnonzero(rb._lanes.reader().read("truncated", np.arange(304)))
    inside = np.setdiff1d(np.arange(303), ends)
    assert torch.equal(s.next_observations[inside], s.observations[inside + 1])
    assert torch.equal(s.next_observations[inside, :3], s.observations[inside, 1:])  # the frame stack shifts
    rb.close()


@pytest.mark.parametrize("n_envs", [1, 2])
def test_prioritized_frame_stack_samples(tmp_path, n_envs):
    """PrioritizedReplayBuffer with frame_stack: the rows the priority tree draws come
    back with the stacks VecFrameStack gave for them (ring wrapped)."""
    frame, dtype, k, _ = FRAMES["gray-last"]
    venv = stacked_env(frame, dtype, n_envs, k, seed=7)
    steps = collect(venv, 60, seed=7)
    rb = mmbuffer.sb3.PrioritizedReplayBuffer(17 * n_envs, venv.observation_space, venv.action_space, device="cpu",
                                              n_envs=n_envs, path=tmp_path / "p", frame_stack=k, commit_every=9)
    torch.manual_seed(0)
    for args in steps:
        rb.add(*args)
    seen = set()
    for _ in range(20):
        s = rb.sample(64)
        envs, at = rb._lanes.rows_steps(s.indices.numpy())
        assert (at >= 60 - 17 - (k - 1)).all() and (at < 59).all()  # the store's rows, k - 1 older than SB3's ring
        for i, (e, a) in enumerate(zip(envs, at)):
            obs, nxt, action, reward, done, infos = steps[a]
            assert np.array_equal(s.observations[i].numpy(), obs[e]) and np.array_equal(s.next_observations[i].numpy(), nxt[e])
            assert s.rewards[i, 0] == reward[e] and s.actions[i, 0] == action[e, 0]
            seen.add((int(e), int(a)))
        rb.update_priorities(s.indices, torch.rand(64))
    assert len(seen) > 17 * n_envs // 2
    rb.close()


def du_bytes(path):
    """Disk blocks allocated under ``path`` (``du``: sparse, never-written rows count nothing)."""
    return sum(f.stat().st_blocks * 512 for f in Path(path).rglob("*") if f.is_file())


def test_dqn_cnn_on_ale_pong_frame_stack_trains(tmp_path):
    """DQN CnnPolicy on ALE Pong with VecFrameStack(4) and frame_stack=4: the store holds
    single frames, SB3's VecTransposeImage'd stacks are rebuilt, the model trains."""
    ale_py = pytest.importorskip("ale_py")
    from stable_baselines3.common.vec_env import VecFrameStack

    gym.register_envs(ale_py)
    env = VecFrameStack(DummyVecEnv([lambda: QuarterFrames(gym.make("ALE/Pong-v5", obs_type="grayscale",
                                                                     max_episode_steps=120))]), 4)
    model = DQN("CnnPolicy", env, buffer_size=2000, learning_starts=150, batch_size=16, train_freq=8, seed=0,
                policy_kwargs={"features_extractor_kwargs": {"features_dim": 64}},
                replay_buffer_class=mmbuffer.sb3.ReplayBuffer,
                replay_buffer_kwargs={"path": str(tmp_path / "pong"), "frame_stack": 4})
    before = params(model.policy.q_net)
    model.learn(304)  # two episodes end (timeouts): their final frames stored, not the reset ones
    rb = model.replay_buffer
    assert rb.size() == 304 and model._n_updates > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, params(model.policy.q_net)))
    assert rb.observation_space.shape == (4, 53, 40)  # VecTransposeImage: stacked on the first axis
    s = rb._get_samples(np.arange(304), env_indices=np.zeros(304, np.int64))
    assert s.observations.dtype == torch.uint8 and s.observations.shape == (304, 4, 53, 40)
    truncated = rb._lanes.reader().read("truncated", np.arange(304))
    timeouts = rb._lanes.reader().read("timeout", np.arange(304))
    assert timeouts.sum() == 2 and set(np.flatnonzero(timeouts)) <= set(np.flatnonzero(truncated))
    inside = np.setdiff1d(np.arange(303), np.flatnonzero(timeouts))
    assert torch.equal(s.next_observations[inside], s.observations[inside + 1])
    assert torch.equal(s.next_observations[:, :3], s.observations[:, 1:])  # the stack shifts, episode ends too
    starts = np.flatnonzero(timeouts)[:2] + 1  # a reset: zeros before the first frame
    assert not s.observations[starts, :3].any() and s.observations[starts, 3].any()
    assert not s.observations[0, :3].any()
    copy = pickle.loads(pickle.dumps(rb))  # the path and the cursor; the copy rebuilds the same stacks
    np.random.seed(3)
    a = rb.sample(64)
    np.random.seed(3)
    same_samples(a, copy.sample(64))
    copy.close()
    rb.close()
    store = mb.open(tmp_path / "pong", mode="r")
    assert tuple(store.columns["obs"].shape) == (1, 53, 40)  # one frame a step, not 4
    store.close()
    stacked = 304 * 2 * int(np.prod(rb.observation_space.shape))  # SB3's observations + next_observations
    assert du_bytes(tmp_path / "pong") < stacked / 2


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_dqn_frame_stack_training_bit_identical_to_sb3_buffer(tmp_path, codec):
    """DQN CnnPolicy on Pong with VecFrameStack(4), same seed: SB3's buffer of stacked
    observations or the drop-in storing single frames (raw or zstd, as bench_sb3.py
    trains it) train the same weights, bit for bit (the ring wraps, episodes end by
    timeouts)."""
    ale_py = pytest.importorskip("ale_py")
    from stable_baselines3.common.vec_env import VecFrameStack

    gym.register_envs(ale_py)

    def train(**kw):
        env = VecFrameStack(DummyVecEnv([lambda: QuarterFrames(gym.make("ALE/Pong-v5", obs_type="grayscale",
                                                                         max_episode_steps=90))]), 4)
        model = DQN("CnnPolicy", env, buffer_size=150, learning_starts=60, batch_size=16, train_freq=4, seed=2,
                    policy_kwargs={"features_extractor_kwargs": {"features_dim": 32}}, **kw)
        model.learn(240)
        return params(model.policy), model

    theirs, _ = train()
    mine, model = train(replay_buffer_class=mmbuffer.sb3.ReplayBuffer,
                        replay_buffer_kwargs={"path": str(tmp_path / "r"), "frame_stack": 4, "commit_every": 50,
                                              **({} if codec is None else {"codec": codec})})
    assert model._n_updates > 30 and all(torch.equal(a, b) for a, b in zip(theirs, mine))
    with mb.open(tmp_path / "r", mode="r") as store:  # the store the run wrote has the codec asked for
        assert store.attrs["sb3"].get("codec") == codec
    model.replay_buffer.close()


# -- prioritized replay -------------------------------------------------------------------
def per_buffer(path, **kw):
    box = spaces.Box(-1e6, 1e6, (2,), np.float32)
    return mmbuffer.sb3.PrioritizedReplayBuffer(64, box, spaces.Discrete(2), device="cpu", path=path, **kw)


def fill(rb, steps):
    for t in range(steps):
        o = np.full((1, 2), t, np.float32)
        rb.add(o, o + 1, np.array([t % 2]), np.array([t], np.float32), np.array([t % 10 == 9]), [{}])


def test_prioritized_draws_and_weights(tmp_path):
    torch.manual_seed(0)
    rb = per_buffer(tmp_path / "p", alpha=0.6, beta=0.4)
    fill(rb, 60)
    seen = set()
    for _ in range(200):  # every stored row once: the newest step is held in memory, and the
        if len(seen) == 58:  # store's open last row (58) waits for its next observation
            break
        s = rb.sample(64)
        assert isinstance(s, mmbuffer.sb3.PrioritizedReplayBufferSamples)
        assert s.weights.shape == (64, 1) and s.weights.dtype == torch.float32 and s.indices.dtype == torch.int64
        # the samples are the rows' transitions: obs t, next obs t + 1, reward t
        assert torch.equal(s.next_observations, s.observations + 1)
        assert torch.equal(s.rewards[:, 0], s.observations[:, 0])
        rb.update_priorities(s.indices, (1 + s.indices % 4).reshape(-1, 1).float())
        seen |= set(s.indices.tolist())
    assert seen == set(range(58))
    counts = torch.zeros(4)
    for _ in range(100):
        s = rb.sample(512)
        counts += torch.bincount(s.indices % 4, minlength=4)
        w = {int(i % 4): float(x) for i, x in zip(s.indices, s.weights[:, 0])}
    ratio = float(counts[3] / counts[0])  # priority 4 against 1: (4 / 1) ** 0.6 = 2.30
    assert abs(ratio - 4**0.6) < 0.15 * 4**0.6, ratio
    assert abs(w[0] - 1.0) < 1e-4 and abs(w[3] - (4**0.6) ** -0.4) < 1e-3, w
    rb.close()


def test_prioritized_pickle_and_layout(tmp_path):
    rb = per_buffer(tmp_path / "p", alpha=0.5, beta=0.3)
    fill(rb, 30)
    rb.beta = 0.7  # annealed
    copy = pickle.loads(pickle.dumps(rb))
    assert copy.beta == 0.7 and copy.size() == 30
    rb.close()
    with pytest.raises(errors.SchemaError, match="priorities"):  # a store with priorities is not a plain buffer's
        mmbuffer.sb3.ReplayBuffer(64, spaces.Box(-1e6, 1e6, (2,), np.float32), spaces.Discrete(2), path=tmp_path / "p")
    with pytest.raises(errors.InvalidArgumentError, match="beta"):
        per_buffer(tmp_path / "q", beta=2.0)
    copy.close()


def test_prioritized_dqn_feeds_td_errors_back(tmp_path):
    model = mmbuffer.sb3.PrioritizedDQN(
        "MlpPolicy", gym.make("CartPole-v1"), buffer_size=1000, learning_starts=100, batch_size=32, train_freq=4,
        policy_kwargs={"net_arch": [32]}, seed=0, replay_buffer_class=mmbuffer.sb3.PrioritizedReplayBuffer,
        replay_buffer_kwargs={"path": str(tmp_path / "per")},
    )
    model.learn(400)
    rb = model.replay_buffer
    assert rb.size() == 400 and model._n_updates > 0
    leaves = rb._lanes.writer().leaf_priorities(np.arange(398))
    cap = 1e4**0.6
    assert (leaves < cap * 0.999).sum() > 100  # sampled rows now carry their TD errors
    assert leaves.max() < cap  # new rows took the live maximum, not the cap, once the first rows were drawn
    rb.close()
    plain = mmbuffer.sb3.PrioritizedDQN("MlpPolicy", gym.make("CartPole-v1"), buffer_size=1000, learning_starts=10,
                                        replay_buffer_class=mmbuffer.sb3.ReplayBuffer,
                                        replay_buffer_kwargs={"path": str(tmp_path / "plain")})
    with pytest.raises(errors.InvalidArgumentError, match="PrioritizedReplayBuffer"):
        plain.learn(20)
    plain.replay_buffer.close()


def test_optimize_memory_usage_accepted_and_truncation(tmp_path):
    """optimize_memory_usage with handle_timeout_termination (SB3 refuses the pair, SB3#934):
    accepted; SB3's _setup_learn then marks the newest step done, as SB3 does."""
    model = DQN("MlpPolicy", gym.make("CartPole-v1"), buffer_size=500, learning_starts=50, seed=0,
                optimize_memory_usage=True, policy_kwargs={"net_arch": [16]},
                replay_buffer_class=mmbuffer.sb3.ReplayBuffer, replay_buffer_kwargs={"path": str(tmp_path / "o")})
    model.learn(60)
    rb = model.replay_buffer
    assert rb.optimize_memory_usage and rb.handle_timeout_termination
    newest = rb.pos - 1
    with pytest.warns(UserWarning, match="truncated"):
        model.learn(8)  # reset_num_timesteps=True: SB3 sets replay_buffer.dones[pos - 1] = True
    s = rb._get_samples(np.array([newest]), env_indices=np.array([0]))
    assert s.dones.tolist() == [[1.0]]
    with pytest.raises(errors.InvalidArgumentError, match="done"):
        rb.dones[0] = True
    with pytest.raises(errors.InvalidArgumentError, match="reward"):
        rb.rewards[newest] = 1.0
    rb.close()


def test_float64_observations_chain(tmp_path):
    """An env giving float64 for a float32 space: compared as stored, no spurious episode ends."""
    box = spaces.Box(-1, 1, (2,), np.float32)
    rb = mmbuffer.sb3.ReplayBuffer(50, box, spaces.Discrete(2), device="cpu", path=tmp_path / "f")
    obs = np.random.default_rng(0).random((11, 1, 2))  # float64
    for t in range(10):
        rb.add(obs[t], obs[t + 1], np.array([0]), np.array([0.0]), np.array([False]), [{}])
    rb.close()
    store = mb.open(tmp_path / "f", mode="r")
    assert store.read("truncated", np.arange(10)).tolist() == [False] * 9 + [True]  # only the held row, closed
    store.close()
    s = rb._get_samples(np.arange(10), env_indices=np.zeros(10, np.int64))
    assert s.observations.dtype == torch.float32
    assert torch.equal(s.next_observations, torch.from_numpy(obs[1:, 0].astype(np.float32)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_samples_on_cuda(tmp_path):
    box = spaces.Box(-1, 1, (2,), np.float32)
    rb = mmbuffer.sb3.ReplayBuffer(50, box, spaces.Discrete(2), device="cuda", path=tmp_path / "g")
    fill(rb, 20)
    s = rb.sample(8)
    assert all(t.device.type == "cuda" for t in s[:5])
    rb.close()


@pytest.mark.parametrize("algo", ["TD3", "DDPG"])
def test_td3_ddpg_pendulum_train(tmp_path, algo):
    cls = getattr(sb3, algo)
    model = cls("MlpPolicy", gym.make("Pendulum-v1"), buffer_size=1000, learning_starts=100, batch_size=32,
                policy_kwargs={"net_arch": [32]}, seed=0, train_freq=8, gradient_steps=2,
                replay_buffer_class=mmbuffer.sb3.ReplayBuffer, replay_buffer_kwargs={"path": str(tmp_path / algo)})
    before = params(model.policy.actor)
    model.learn(200)
    assert model.replay_buffer.size() == 200 and model._n_updates > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, params(model.policy.actor)))
    model.replay_buffer.close()


class DictObs(gym.ObservationWrapper):
    """Pendulum's observation as a Dict: angle part and velocity part."""

    def __init__(self, env):
        super().__init__(env)
        self.observation_space = spaces.Dict({
            "angle": spaces.Box(-1, 1, (2,), np.float32),
            "velocity": spaces.Box(-8, 8, (1,), np.float32),
        })

    def observation(self, obs):
        return {"angle": obs[:2].astype(np.float32), "velocity": obs[2:].astype(np.float32)}


def test_sac_dict_observations_trains(tmp_path):
    model = SAC("MultiInputPolicy", DictObs(gym.make("Pendulum-v1")), buffer_size=1000, learning_starts=100,
                batch_size=32, policy_kwargs={"net_arch": [32]}, seed=0, train_freq=8, gradient_steps=2,
                replay_buffer_class=mmbuffer.sb3.DictReplayBuffer, replay_buffer_kwargs={"path": str(tmp_path / "d")})
    model.learn(224)  # one episode of 200 ends (a timeout): its final observation is stored
    rb = model.replay_buffer
    assert rb.size() == 224 and model._n_updates > 0
    s = rb._get_samples(np.arange(224), env_indices=np.zeros(224, np.int64))
    assert isinstance(s, DictReplayBufferSamples) and s.observations["angle"].shape == (224, 2)
    assert s.dones.sum() == 0  # the timeout is no termination
    inside = np.setdiff1d(np.arange(223), [199])
    for k in ("angle", "velocity"):
        assert torch.equal(s.next_observations[k][inside], s.observations[k][inside + 1])
    assert not torch.equal(s.next_observations["angle"][199], s.observations["angle"][200])  # reset, not final
    rb.close()


@pytest.mark.parametrize("algo,env_id", [("DQN", "CartPole-v1"), ("SAC", "Pendulum-v1")])
def test_training_bit_identical_to_sb3_buffer(tmp_path, algo, env_id):
    """Same seed, SB3's buffer or the drop-in: the same draws (np.random), the same
    samples, so the same trained weights, bit for bit."""
    cls = getattr(sb3, algo)

    def train(**kw):
        model = cls("MlpPolicy", gym.make(env_id), buffer_size=300, learning_starts=100, batch_size=32,
                    policy_kwargs={"net_arch": [32]}, seed=3, train_freq=4, **kw)
        model.learn(500)  # the ring wraps
        return params(model.policy), model

    theirs, _ = train()
    mine, model = train(replay_buffer_class=mmbuffer.sb3.ReplayBuffer, replay_buffer_kwargs={"path": str(tmp_path / "r")})
    assert model._n_updates > 50 and all(torch.equal(a, b) for a, b in zip(theirs, mine))
    model.replay_buffer.close()


def test_commits_on_its_own(tmp_path):
    """add commits every commit_every steps or commit_seconds: a reader sees the steps.
    (The step count is checked with commit_seconds out of reach: on a loaded machine nine
    adds may take longer than a short commit_seconds.)"""
    box = spaces.Box(-1e6, 1e6, (2,), np.float32)
    rb = mmbuffer.sb3.ReplayBuffer(100, box, spaces.Discrete(2), device="cpu", path=tmp_path / "c",
                                   commit_every=10, commit_seconds=3600.0)
    fill(rb, 9)
    reader = mb.open(tmp_path / "c", mode="r")  # beside the writer
    assert int(reader.view().written[0]) == 0  # nothing committed yet (the store's first commit is empty)
    fill(rb, 1)  # the 10th step: a commit, held steps written
    reader.refresh()
    assert int(reader.view().written[0]) == 10 and rb._lanes.pending == 0
    reader.close()
    rb.close()
    rb = mmbuffer.sb3.ReplayBuffer(100, box, spaces.Discrete(2), device="cpu", path=tmp_path / "t",
                                   commit_every=1000, commit_seconds=0.3)
    fill(rb, 1)
    reader = mb.open(tmp_path / "t", mode="r")
    written = int(reader.view().written[0])  # 0, or 1 if that add already took longer than 0.3 s
    time.sleep(0.35)
    fill(rb, 1)  # commit_seconds passed since the last commit: this add commits
    reader.refresh()
    assert written < 2 and int(reader.view().written[0]) == 2
    reader.close()
    rb.close()
