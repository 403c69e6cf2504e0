"""mmbuffer.sb3 with mode="r": a learner reading the store an actor process writes."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import warm

sb3 = pytest.importorskip("stable_baselines3")
gym = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402

import mmbuffer as mb  # noqa: E402
import mmbuffer.sb3  # noqa: E402
from mmbuffer import errors  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]  # the repository: the package for child processes
BOX = spaces.Box(-1e9, 1e9, (2,))


def _add(rb, t, n_envs=1, done=False):
    """Step ``t`` of every env: obs ``t * 10 + env``, next_obs the next one, reward ``t``."""
    obs = np.stack([np.full(2, t * 10 + e, np.float32) for e in range(n_envs)])
    rb.add(obs, obs + 10, np.full(n_envs, t % 2), np.full(n_envs, float(t)), np.full(n_envs, done), [{}] * n_envs)


def _stacked_add(rb, t, n_envs, k):
    """Step ``t`` of every env stacked ``k`` frames (``k`` None: a single frame): frame ``u``
    of env ``e`` is ``1000 + 10 u + e`` (zeros before step 0, as VecFrameStack pads)."""
    frames = [np.stack([np.full(2, 1000 + u * 10 + e, np.float32) * (u >= 0) for e in range(n_envs)])
              for u in range(t - (k or 1) + 1, t + 2)]
    obs, nxt = np.concatenate(frames[:-1], axis=1), np.concatenate(frames[1:], axis=1)
    rb.add(obs, nxt, np.full(n_envs, t % 2), np.full(n_envs, float(t)), np.zeros(n_envs, bool), [{}] * n_envs)


def _check_stacks(got, k):
    """Every sampled item is the step its reward names, all frames and next frames."""
    steps = got.rewards[:, 0].numpy()
    obs, nxt = got.observations.numpy(), got.next_observations.numpy()
    env = obs[:, -2] - (steps * 10 + 1000)
    assert set(np.unique(env).tolist()) <= {0.0, 1.0}
    def frame(u):
        return np.where(u >= 0, 1000 + u * 10 + env, 0)

    for j in range(k or 1):  # frame j of the stack is step t - (k - 1) + j, of next_obs one step later
        u = steps - (k or 1) + 1 + j
        assert (obs[:, 2 * j] == frame(u)).all() and (nxt[:, 2 * j] == frame(u + 1)).all()
    return steps, env


def _files(path):
    """Every file of the store with its bytes (the writer lock file's too)."""
    return {p: p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("cls", [mmbuffer.sb3.ReplayBuffer, mmbuffer.sb3.PrioritizedReplayBuffer])
def test_a_reader_follows_the_writers_commits_and_refuses_every_write(tmp_path, cls):
    path = tmp_path / "replay"
    actor = cls(100, BOX, spaces.Discrete(2), device="cpu", path=path, commit_every=4)
    for t in range(6):
        _add(actor, t)
    learner = cls(100, BOX, spaces.Discrete(2), device="cpu", path=path, mode="r")  # no LockedError
    assert learner.mode == "r" and actor.mode == "a"
    assert (learner.size(), learner.pos, learner.full) == (4, 4, False)  # the commit at 4 steps, not 6
    assert set(learner.sample(64).rewards[:, 0].tolist()) == {0.0, 1.0, 2.0, 3.0}
    for t in range(6, 9):
        _add(actor, t)
    assert learner.size() == 8  # the actor's commit at 8 steps
    assert set(learner.sample(256).rewards[:, 0].tolist()) == set(map(float, range(8)))
    before = _files(path)
    with pytest.raises(errors.ReadOnlyError, match="add: expected a buffer opened with mode='a'"):
        _add(learner, 99)
    with pytest.raises(errors.ReadOnlyError, match="dones"):
        learner.dones[learner.pos - 1] = True
    if cls is mmbuffer.sb3.PrioritizedReplayBuffer:
        s = learner.sample(4)
        with pytest.raises(errors.ReadOnlyError, match="update_priorities"):
            learner.update_priorities(s.indices, torch.ones(4))
    assert learner.commit() == actor._lanes.reader().generation  # nothing to commit: the generation read
    assert _files(path) == before and learner.size() == 8
    # a pickled reader (save_replay_buffer) is a reader again
    again = pickle.loads(pickle.dumps(learner))
    assert again.mode == "r" and again.size() == 8
    again.close()
    learner.close()
    actor.close()
    with pytest.raises(errors.StoreNotFoundError):
        cls(100, BOX, spaces.Discrete(2), device="cpu", path=tmp_path / "nothing", mode="r")
    with pytest.raises(errors.InvalidArgumentError, match="mode: expected 'a'"):
        cls(100, BOX, spaces.Discrete(2), device="cpu", path=path, mode="w")
    with pytest.raises(errors.SchemaError):
        cls(100, spaces.Box(-1, 1, (3,)), spaces.Discrete(2), device="cpu", path=path, mode="r")


@pytest.mark.parametrize("frame_stack", [None, 3])
def test_a_reader_never_draws_the_steps_the_writer_has_reserved_to_rewrite(tmp_path, frame_stack):
    """After the ring wraps, the writer reserves rows ahead of its cursor before its next
    commit: the reader's sample never draws a step below ``reserved - lane`` (its oldest
    frame with stacks), and ``_get_samples`` refuses such a slot by name."""
    path, n_envs, bs = tmp_path / "replay", 2, 40  # 40 slots per env
    space = BOX if frame_stack is None else spaces.Box(-1e9, 1e9, (2 * frame_stack,))
    kw = {"device": "cpu", "n_envs": n_envs, "path": path}
    if frame_stack:
        kw["frame_stack"] = frame_stack
    actor = mmbuffer.sb3.ReplayBuffer(bs * n_envs, space, spaces.Discrete(2), commit_every=bs, **kw)

    def add(t):
        _stacked_add(actor, t, n_envs, frame_stack)

    for t in range(3 * bs):  # committed at 120 steps per env: the ring wrapped twice
        add(t)
    for t in range(3 * bs, 3 * bs + 30):  # 30 more steps, not committed (the next commit is at 160)
        add(t)
    learner = mmbuffer.sb3.ReplayBuffer(bs * n_envs, space, spaces.Discrete(2), mode="r", **kw)
    assert learner.size() == bs and learner.full and learner.pos == 0
    with mb.open(path, mode="r") as ro:
        reserved, lane = ro.reservation(), ro.capacity // n_envs
    low = reserved.max() - lane + (frame_stack or 1) - 1  # the oldest intact step, every env
    assert 3 * bs - bs < low < 3 * bs  # some committed slots are reserved: the case this test is about
    got = learner.sample(2000)
    steps, env = _check_stacks(got, frame_stack)  # every row its own step's, all frames
    assert steps.min() >= low and steps.max() == 3 * bs - 1 and len(set(steps.tolist())) == 3 * bs - low
    assert set(env.tolist()) == {0.0, 1.0}  # both envs drawn
    oldest_slot = (3 * bs) % bs  # slot 0 holds step 80 now, reserved
    with pytest.raises(errors.RowNotLiveError, match="batch_inds"):
        learner._get_samples(np.array([oldest_slot]), env_indices=np.array([0]))
    ok = learner._get_samples(np.array([bs - 1]), env_indices=np.array([1]))
    assert ok.rewards.item() == 3 * bs - 1
    learner.close()
    actor.close()


def test_a_reader_whose_committed_steps_are_all_being_rewritten_says_so_until_the_next_commit(tmp_path):
    """``commit_every`` = ``buffer_size``: just before a commit the writer has reserved past
    every committed step, so nothing can be sampled: ``EmptyBufferError``, never a torn row."""
    path = tmp_path / "replay"
    actor = mmbuffer.sb3.ReplayBuffer(200, BOX, spaces.Discrete(2), device="cpu", path=path, commit_every=200)
    for t in range(595):  # commits at 200 and 400; 195 more steps, three blocks of 63 written since
        _add(actor, t)
    learner = mmbuffer.sb3.ReplayBuffer(200, BOX, spaces.Discrete(2), device="cpu", path=path, mode="r")
    with mb.open(path, mode="r") as ro:
        assert ro.reservation()[0] - 200 >= 400  # every committed step is reserved
    assert learner.size() == 200
    with pytest.raises(errors.EmptyBufferError, match="commit_every below buffer_size"):
        learner.sample(8)
    for t in range(595, 600):  # the commit at 600
        _add(actor, t)
    assert set(learner.sample(256).rewards[:, 0].tolist()) <= set(map(float, range(400, 600)))
    learner.close()
    actor.close()


@pytest.mark.parametrize("cls", [mmbuffer.sb3.ReplayBuffer, mmbuffer.sb3.PrioritizedReplayBuffer])
def test_a_reader_of_a_zstd_frame_stacked_store_follows_it_around_the_ring(tmp_path, cls):
    """A codec store's lane is 512 rows (``buffer_size`` 100): 1,300 steps lap it twice;
    after every commit the reader samples whole stacks of committed steps only."""
    path, k = tmp_path / "replay", 3
    space = spaces.Box(-1e9, 1e9, (2 * k,))
    kw = {"device": "cpu", "n_envs": 2, "path": path, "frame_stack": k, "codec": "zstd"}
    actor = cls(200, space, spaces.Discrete(2), commit_every=50, **kw)
    _stacked_add(actor, 0, 2, k)
    actor.commit()
    learner = cls(200, space, spaces.Discrete(2), mode="r", **kw)
    drawn = set()
    for t in range(1, 1300):
        _stacked_add(actor, t, 2, k)
        if t % 50 == 0:  # the actor just committed t + 1 steps (50 since its first commit)
            steps, _ = _check_stacks(learner.sample(128), k)
            assert learner.size() == min(t + 1, 100) and steps.max() <= t and steps.min() >= 0
            drawn.update(steps.tolist())
    assert max(drawn) > 2 * 512  # sampled after the lane wrapped twice
    learner.close()
    actor.close()


ACTOR = r"""
import os, sys, time, numpy as np, gymnasium as gym
from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack
import mmbuffer.sb3
path, out, steps, k = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
venv = DummyVecEnv([lambda: gym.make("CartPole-v1") for _ in range(2)])
if k > 1:
    venv = VecFrameStack(venv, k)
venv.seed(0)
kw = {"frame_stack": k} if k > 1 else {}
rb = mmbuffer.sb3.ReplayBuffer(400, venv.observation_space, venv.action_space, device="cpu", n_envs=2,
                               path=path, commit_every=16, **kw)
obs = venv.reset()
rec = {"obs": [], "next_obs": [], "action": [], "done": []}
for t in range(steps):
    action = np.array([(t // 3) % 2, (t // 5) % 2])
    new_obs, _, dones, infos = venv.step(action)
    nxt = new_obs.copy()
    for e, d in enumerate(dones):
        if d:
            nxt[e] = infos[e]["terminal_observation"]
    ids = np.array([2 * t, 2 * t + 1], np.float32)  # the reward is the transition's id
    rb.add(obs, nxt, action, ids, dones, infos)
    for key, v in (("obs", obs), ("next_obs", nxt), ("action", action), ("done", dones)):
        rec[key].append(np.array(v))
    obs = new_obs
    if t == 15:  # committed at 16 steps: wait until the learner has sampled that commit
        deadline = time.monotonic() + 300
        while not os.path.exists(path + ".ready") and time.monotonic() < deadline:
            time.sleep(0.01)
rb.close()
np.savez(out, **{key: np.stack(v) for key, v in rec.items()})
"""


def _learner_run(tmp_path, frame_stack, steps):
    """An actor process adds ``steps`` CartPole steps of 2 envs (reward = the transition's
    id) with ``commit_every=16`` to a 200-slot-per-env ring; this process samples all along."""
    path, out = tmp_path / "replay", tmp_path / "actor.npz"
    actor = subprocess.Popen([sys.executable, "-c", ACTOR, str(path), str(out), str(steps), str(frame_stack)],
                             env=warm.repo_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    shape = (4 * frame_stack,)
    kw = {"frame_stack": frame_stack} if frame_stack > 1 else {}
    learner = None
    seen, sizes, fulls = [], [], []
    try:
        while actor.poll() is None:
            if learner is None:
                try:
                    learner = mmbuffer.sb3.ReplayBuffer(400, spaces.Box(-np.inf, np.inf, shape, np.float32),
                                                        spaces.Discrete(2), device="cpu", n_envs=2, path=path,
                                                        mode="r", **kw)
                except errors.StoreNotFoundError:
                    time.sleep(0.01)
                    continue
            if learner.size() == 0:
                time.sleep(0.005)
                continue
            s = learner.sample(64)
            (tmp_path / "replay.ready").touch()
            committed = learner._lanes.adds  # the commit this batch came from (or a later one)
            sizes.append(learner.size())
            fulls.append(learner.full)
            seen.append((committed, s.rewards[:, 0].numpy().astype(np.int64), s.observations.numpy(),
                         s.next_observations.numpy(), s.actions[:, 0].numpy(), s.dones[:, 0].numpy()))
    finally:
        _, err = actor.communicate(timeout=600)
    assert actor.returncode == 0, err
    assert learner is not None
    learner.close()
    rec = np.load(out)
    return seen, sizes, fulls, rec


def _check_run(seen, sizes, fulls, rec, steps):
    obs = rec["obs"].reshape(2 * steps, -1)  # row id = 2 * t + env
    nxt = rec["next_obs"].reshape(2 * steps, -1)
    action, done = rec["action"].reshape(-1), rec["done"].reshape(-1).astype(np.float32)
    assert len(seen) >= 20, f"the learner sampled {len(seen)} times while the actor ran"
    n = 0
    for committed, ids, o, no, a, d in seen:
        assert (ids // 2 < committed).all()  # only committed steps
        # each field is the one the actor added with that id: no torn or half-overwritten row
        np.testing.assert_array_equal(o.reshape(len(ids), -1), obs[ids])
        np.testing.assert_array_equal(no.reshape(len(ids), -1), nxt[ids])
        np.testing.assert_array_equal(a, action[ids])
        np.testing.assert_array_equal(d, done[ids])  # CartPole-v1 timeouts come at 500 steps: none here
        n += len(ids)
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] == 200  # size() grows as commits land
    assert all(s % 16 == 0 or s == 200 for s in sizes)  # at commits (every 16 steps) only
    assert any(fulls)  # the learner sampled while the actor's ring wrapped
    assert max(int(ids.max()) for _, ids, *_ in seen) // 2 > 2 * 200  # ... more than once
    return n


@pytest.mark.slow
def test_a_learner_process_samples_only_committed_whole_transitions_of_a_cartpole_actor(tmp_path):
    steps = 1500
    seen, sizes, fulls, rec = _learner_run(tmp_path, 1, steps)
    assert _check_run(seen, sizes, fulls, rec, steps) > 0


@pytest.mark.slow
def test_a_learner_process_samples_whole_frame_stacks_of_a_frame_stacked_cartpole_actor(tmp_path):
    steps = 1500
    seen, sizes, fulls, rec = _learner_run(tmp_path, 4, steps)
    assert _check_run(seen, sizes, fulls, rec, steps) > 0


def test_a_read_only_dqn_trains_on_what_an_actor_committed(tmp_path):
    """SB3's own ``DQN.train`` on a reader: the learner half of an actor/learner split."""
    from stable_baselines3 import DQN
    from stable_baselines3.common.logger import configure

    path = tmp_path / "replay"
    actor = DQN("MlpPolicy", gym.make("CartPole-v1"), learning_starts=10_000, buffer_size=1000, seed=0,
                replay_buffer_class=mmbuffer.sb3.ReplayBuffer, replay_buffer_kwargs={"path": path, "commit_every": 50})
    actor.learn(120)  # collects only (learning_starts): commits at 50 and 100 steps
    learner = DQN("MlpPolicy", gym.make("CartPole-v1"), buffer_size=1000, seed=1,
                  replay_buffer_class=mmbuffer.sb3.ReplayBuffer, replay_buffer_kwargs={"path": path, "mode": "r"})
    learner.set_logger(configure(str(tmp_path / "log"), []))  # no output files
    assert learner.replay_buffer.size() == 100
    before = [p.detach().clone() for p in learner.policy.parameters()]
    learner.train(gradient_steps=5, batch_size=32)
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.policy.parameters()))
    with pytest.raises(errors.ReadOnlyError):
        learner.learn(10)  # collecting adds: the learner does not
    assert learner.replay_buffer.size() == 100
    actor.replay_buffer.close()
    learner.replay_buffer.close()


def test_a_dict_reader_samples_the_committed_steps_of_each_key(tmp_path):
    space = spaces.Dict({"a": spaces.Box(-1e9, 1e9, (2,)), "b": spaces.Box(-1e9, 1e9, (1,))})
    kw = {"device": "cpu", "path": tmp_path / "replay"}
    actor = mmbuffer.sb3.DictReplayBuffer(30, space, spaces.Discrete(2), commit_every=10, **kw)
    learner = None
    for t in range(95):
        obs = {"a": np.full((1, 2), t, np.float32), "b": np.full((1, 1), -t, np.float32)}
        nxt = {"a": obs["a"] + 1, "b": obs["b"] - 1}
        actor.add(obs, nxt, np.array([t % 2]), np.array([float(t)]), np.array([False]), [{}])
        if t == 9:
            learner = mmbuffer.sb3.DictReplayBuffer(30, space, spaces.Discrete(2), mode="r", **kw)
        if learner is not None and t % 10 == 9:
            s = learner.sample(64)
            steps = s.rewards[:, 0]
            assert learner.size() == min(t + 1, 30) and steps.max() <= t
            assert torch.equal(s.observations["a"][:, 0], steps) and torch.equal(s.observations["b"][:, 0], -steps)
            assert torch.equal(s.next_observations["a"][:, 1], steps + 1) and torch.equal(s.next_observations["b"][:, 0], -steps - 1)
    assert learner is not None and learner.full
    learner.close()
    actor.close()


def test_a_reader_reloads_the_commit_only_when_the_writer_committed(tmp_path, monkeypatch):
    """``sample`` stats ``manifest.json``; ``Buffer.refresh`` (a manifest read) runs only
    after a commit replaced it (the once-a-second fallback set out of reach here)."""
    import mmbuffer.sb3.follow as follow

    monkeypatch.setattr(follow, "RECHECK_SECONDS", 1e9)
    refreshes = []
    real = mb.Buffer.refresh

    def counted(self):
        refreshes.append(self.path)
        return real(self)

    monkeypatch.setattr(mb.Buffer, "refresh", counted)
    path = tmp_path / "replay"
    actor = mmbuffer.sb3.ReplayBuffer(100, BOX, spaces.Discrete(2), device="cpu", path=path, commit_every=5)
    for t in range(5):
        _add(actor, t)
    learner = mmbuffer.sb3.ReplayBuffer(100, BOX, spaces.Discrete(2), device="cpu", path=path, mode="r")
    for _ in range(50):
        learner.sample(4)
    assert refreshes == [] and learner.size() == 5
    for t in range(5, 10):
        _add(actor, t)  # commits at 10
    for _ in range(50):
        learner.sample(4)
    assert refreshes == [path] and learner.size() == 10
    learner.close()
    actor.close()
