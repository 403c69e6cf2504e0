"""SB3 drop-in with ``frame_stack=4`` against SB3's ``ReplayBuffer`` on real ALE frames.

Pong (grayscale, halved in numpy to 105x80: OpenCV is not installed) under
``DummyVecEnv`` + ``VecFrameStack(4)`` + ``VecTransposeImage`` (what DQN's
``CnnPolicy`` wraps), random actions, ``--steps`` transitions (``max_episode_steps``
``--episode`` so that episodes end and reset inside the run) fed, as SB3's
``_store_transition`` gives them, to SB3's ``ReplayBuffer`` (in RAM) and to
``mmbuffer.sb3.ReplayBuffer(frame_stack=4)`` with ``buffer_size == steps``.

Reported: bytes per transition of the store on disk (``du``: allocated blocks
of every file under the store, after ``close``) against SB3's arrays
(``observations`` + ``next_observations`` + actions, rewards, dones, timeouts:
``nbytes`` over ``buffer_size``), whether every sample is bit-identical, and
``sample(32)`` / ``sample(256)`` medians (interleaved calls, page cache warm).

    python benchmarks/bench_sb3_frame_stack.py --steps 5000
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import gymnasium as gym
from gymnasium import spaces
from stable_baselines3.common import buffers as sb3_buffers
from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack, VecTransposeImage

import mmbuffer.sb3


class HalfFrames(gym.ObservationWrapper):
    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        h, w = env.observation_space.shape  # type: ignore[misc]
        self.observation_space = spaces.Box(0, 255, ((h + 1) // 2, (w + 1) // 2, 1), np.uint8)

    def observation(self, obs: np.ndarray) -> np.ndarray:
        return obs[::2, ::2, None]


def du(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--episode", type=int, default=700)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    import ale_py

    gym.register_envs(ale_py)
    venv = VecTransposeImage(VecFrameStack(DummyVecEnv([lambda: HalfFrames(gym.make(
        "ALE/Pong-v5", obs_type="grayscale", max_episode_steps=args.episode))]), 4))
    n = args.steps
    theirs = sb3_buffers.ReplayBuffer(n, venv.observation_space, venv.action_space, device="cpu")
    root = Path(tempfile.mkdtemp(prefix="sb3fs-"))
    mine = mmbuffer.sb3.ReplayBuffer(n, venv.observation_space, venv.action_space, device="cpu",
                                     path=root / "replay", frame_stack=4)
    plain = mmbuffer.sb3.ReplayBuffer(n, venv.observation_space, venv.action_space, device="cpu", path=root / "plain")
    rng = np.random.default_rng(0)
    obs: Any = venv.reset()
    ends, spent = 0, [0.0, 0.0]
    for t in range(n):
        actions = rng.integers(0, venv.action_space.n, size=1)  # type: ignore[attr-defined]
        new_obs: Any
        new_obs, rewards, dones, infos = venv.step(actions)
        next_obs = new_obs.copy()
        if dones[0]:
            next_obs[0] = infos[0]["terminal_observation"]
            ends += 1
        theirs.add(obs, next_obs, actions.reshape(-1, 1), rewards, dones, infos)
        timed: list[tuple[Any, int]] = [(mine, 0), (plain, 1)]
        for buf, which in timed if t % 2 == 0 else timed[::-1]:  # alternated: neither always first
            t0 = time.perf_counter()
            buf.add(obs, next_obs, actions.reshape(-1, 1), rewards, dones, infos)
            spent[which] += time.perf_counter() - t0
        obs = new_obs
    t_add, t_plain = spent[0], spent[1]
    mine.close()
    plain.close()
    stored, stored_plain = du(root / "replay"), du(root / "plain")
    sb3 = sum(a.nbytes for a in (theirs.observations, theirs.next_observations, theirs.actions,
                                  theirs.rewards, theirs.dones, theirs.timeouts))
    inds = np.arange(n)
    np.random.seed(0)
    a = theirs._get_samples(inds)
    np.random.seed(0)
    b = mine._get_samples(inds)
    same = all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a, b) if x is not None)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.reps):
        for bs in (32, 256):
            pair: tuple[tuple[str, Any], ...] = (("sb3", theirs), ("mmbuffer", mine))
            for name, buf in pair:
                t0 = time.perf_counter()
                buf.sample(bs)
                times.setdefault((name, bs), []).append(time.perf_counter() - t0)
    frame = int(np.prod(mine._stack.frame_shape))  # type: ignore[union-attr]
    print(f"Pong 105x80 gray, VecFrameStack(4) + VecTransposeImage, {n} transitions, {ends} episode ends")
    print(f"obs {venv.observation_space.shape}, stored frame {mine._stack.frame_shape} ({frame} B)")  # type: ignore[union-attr]
    print(f"SB3 ReplayBuffer arrays: {sb3 / n:,.0f} B/transition ({sb3 / 2**20:.1f} MiB)")
    print(f"mmbuffer store on disk (du): {stored / n:,.0f} B/transition ({stored / 2**20:.1f} MiB), "
          f"{sb3 / stored:.1f}x less")
    print(f"mmbuffer store without frame_stack (stacks stored): {stored_plain / n:,.0f} B/transition")
    print(f"all {n} samples bit-identical (obs, next_obs, actions, dones, rewards): {same}")
    print(f"add: {t_add / n * 1e6:.1f} us/step with frame_stack (checks included), {t_plain / n * 1e6:.1f} without")
    for bs in (32, 256):
        s, m = (statistics.median(times[(k, bs)]) * 1e3 for k in ("sb3", "mmbuffer"))
        print(f"sample({bs}): sb3 {s:.3f} ms, mmbuffer {m:.3f} ms")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
