"""mmbuffer.sb3's ``codec`` keyword: the observation column is stored with that codec
and samples stay SB3's, bit for bit; a codec that is not a known name is refused by
name, and nothing is created.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

pytest.importorskip("stable_baselines3")
gym = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402
from stable_baselines3.common import buffers as sb3_buffers  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack  # noqa: E402

import mmbuffer as mb  # noqa: E402
import mmbuffer.sb3  # noqa: E402
from mmbuffer import errors  # noqa: E402


class Bars(gym.Env):  # type: ignore[misc]
    """10x14 frames with a bar that moves a pixel a step (compressible, as game frames
    are); episodes of 5 to 9 steps ending terminated or truncated."""

    observation_space = spaces.Box(0, 255, (10, 14, 1), np.uint8)
    action_space = spaces.Discrete(3)

    def __init__(self) -> None:
        self.rng, self.t, self.left = np.random.default_rng(0), 0, 0

    def frame(self) -> np.ndarray:
        f = np.zeros((10, 14, 1), np.uint8)
        f[:, self.t % 14] = 200
        return f

    def reset(self, *, seed=None, options=None):
        self.left = int(self.rng.integers(5, 10))
        self.t += 3
        return self.frame(), {}

    def step(self, action):
        self.t += 1
        self.left -= 1
        end = self.left == 0
        term = bool(end and self.t % 2)
        return self.frame(), float(action), term, bool(end and not term), {}


def transitions(steps: int):
    """SB3's ``add`` arguments from ``VecFrameStack(4)``, as ``_store_transition`` gives them."""
    venv = VecFrameStack(DummyVecEnv([Bars]), 4)
    rng = np.random.default_rng(1)
    obs, out = venv.reset(), []
    for _ in range(steps):
        actions = rng.integers(0, 3, size=1)
        new_obs, rewards, dones, infos = venv.step(actions)
        next_obs = new_obs.copy()
        if dones[0]:
            next_obs[0] = infos[0]["terminal_observation"]
        out.append((obs.copy(), next_obs, actions.reshape(-1, 1), rewards.astype(np.float32), dones.copy(), infos))
        obs = new_obs.copy()
    return venv.observation_space, venv.action_space, out


def test_unknown_codec_refused_by_name_before_anything_is_created(tmp_path):
    obs_space, act_space, steps = transitions(3)
    for cls, space, kw in ((mmbuffer.sb3.ReplayBuffer, obs_space, {"frame_stack": 4}),
                           (mmbuffer.sb3.ReplayBuffer, obs_space, {}),
                           (mmbuffer.sb3.DictReplayBuffer, spaces.Dict({"x": spaces.Box(-1, 1, (3,))}), {})):
        column = "obs.x" if cls is mmbuffer.sb3.DictReplayBuffer else "obs"
        for codec in ("brotli", "zstd:99"):
            rb = cls(100, space, act_space, device="cpu", path=tmp_path / "r", codec=codec, **kw)
            # the store is created at the first add: the core refuses the name there
            with pytest.raises(errors.SchemaError, match=f"column '{column}': codec: expected .* got '{codec}'$"):
                if cls is mmbuffer.sb3.DictReplayBuffer:
                    x = {"x": np.zeros((1, 3), np.float32)}
                    rb.add(x, x, np.zeros((1, 1)), np.zeros(1, np.float32), np.zeros(1), [{}])
                else:
                    rb.add(*steps[0])
        with pytest.raises(errors.InvalidArgumentError, match="^codec: expected a codec name .* got 5$"):
            cls(100, space, act_space, device="cpu", path=tmp_path / "r", codec=5, **kw)
    assert not (tmp_path / "r").exists()  # refused before anything was created
    rb = mmbuffer.sb3.ReplayBuffer(100, obs_space, act_space, device="cpu", path=tmp_path / "r", frame_stack=4, codec=None)
    for args in steps:
        rb.add(*args)
    rb.close()
    with mb.open(tmp_path / "r", mode="r") as store:  # codec=None: the raw store, as without the keyword
        assert "codec" not in store.attrs["sb3"] and store.view().written.tolist() == [3]
        assert "zstd" not in (tmp_path / "r" / "columns" / "obs" / "zarr.json").read_text()


def test_codec_stores_the_observation_column(tmp_path):
    obs_space, act_space, steps = transitions(1100)
    theirs = sb3_buffers.ReplayBuffer(1000, obs_space, act_space, device="cpu")  # the ring wraps
    kw = {"device": "cpu", "frame_stack": 4}
    raw = mmbuffer.sb3.ReplayBuffer(1000, obs_space, act_space, path=tmp_path / "raw", **kw)
    mine = mmbuffer.sb3.ReplayBuffer(1000, obs_space, act_space, path=tmp_path / "z", codec="zstd", **kw)
    for args in steps:
        theirs.add(*args)
        raw.add(*args)
        mine.add(*args)
    inds = np.arange(1000)

    def same(a, b):
        np.random.seed(0)
        x = a._get_samples(inds)
        np.random.seed(0)
        y = b._get_samples(inds)
        for field, u, v in zip(x._fields, x, y):
            if u is None:  # discounts: n-step buffers only
                assert v is None, field
                continue
            assert u.dtype == v.dtype and torch.equal(u, v), field

    same(theirs, mine)
    mine.close()
    raw.close()
    same(theirs, mine)  # read back from the closed store
    meta = json.loads((tmp_path / "z" / "columns" / "obs" / "zarr.json").read_text())
    assert "zstd" in json.dumps(meta["codecs"])
    assert "zstd" not in (tmp_path / "z" / "columns" / "action" / "zarr.json").read_text()
    assert "zstd" not in (tmp_path / "raw" / "columns" / "obs" / "zarr.json").read_text()
    with mb.open(tmp_path / "z", mode="r") as store:
        assert store.attrs["sb3"]["codec"] == "zstd"
        # the lane, 1000 + 3 rows, rounded up to 1024: the codec's chunks are not one row each
        assert store.attrs["sb3"]["lane"] == 1024 and store.capacity == 1024
    shards = [f for f in (tmp_path / "z" / "columns" / "obs").rglob("*") if f.is_file() and f.name != "zarr.json"]
    assert 1 <= len(shards) <= 4  # complete shards encoded (the rest staged raw until complete)
    with pytest.raises(errors.SchemaError, match="codec"):  # the codec is part of the layout
        mmbuffer.sb3.ReplayBuffer(1000, obs_space, act_space, path=tmp_path / "z", **kw)
    with pytest.raises(errors.InvalidArgumentError, match="codec"):
        mmbuffer.sb3.ReplayBuffer(1000, obs_space, act_space, path=tmp_path / "n", codec=5, **kw)
    again = pickle.loads(pickle.dumps(mine))  # the pickle keeps the codec: reopens the same store
    same(theirs, again)
    again.close()
