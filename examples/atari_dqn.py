"""DQN on a real Atari game with its replay buffer on disk: Stable-Baselines3 + mmbuffer.

SB3's Atari recipe (``make_atari_env``: 84x84 grayscale, frame skip 4; then
``VecFrameStack(4)``) with one change: ``replay_buffer_class=mmbuffer.sb3.ReplayBuffer``.
``frame_stack=4`` stores each 84x84 frame once (SB3 keeps two 4x84x84 stacks per
transition, 56 KB) and rebuilds the stacks at sampling; ``codec="zstd"``
(``--codec``, the default; ``none`` keeps the frames raw and memory-mapped)
compresses the frames.

Resuming: the run ends with ``model.save`` and ``model.save_replay_buffer`` (a
pickle of the store's path and cursor: kilobytes, not the buffer). Rerun with the
same ``--dir`` and it loads both, reopens the store and trains ``--steps`` more
on top of the transitions it holds.

    python examples/atari_dqn.py                       # 4,000 steps, a minute or two on CPU
    python examples/atari_dqn.py --steps 2000000 --buffer-size 1000000 --game ALE/MsPacman-v5
    python examples/atari_dqn.py                       # again: resumes from runs/atari_dqn
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import ale_py
import gymnasium as gym
import torch
from stable_baselines3 import DQN
from stable_baselines3.common.env_util import make_atari_env
from stable_baselines3.common.vec_env import VecFrameStack

import mmbuffer.sb3


def disk_bytes(path: Path) -> int:
    """Bytes the store takes on disk (allocated blocks of its files)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("runs/atari_dqn"), help="model, replay store and its pickle")
    ap.add_argument("--game", default="ALE/Breakout-v5")
    ap.add_argument("--steps", type=int, default=4_000, help="environment steps to train (more on a resumed run)")
    ap.add_argument("--buffer-size", type=int, default=100_000)
    ap.add_argument("--learning-starts", type=int, default=1_000)
    ap.add_argument("--codec", default="zstd", help="the frames' codec: 'zstd', 'zstd:<level>', 'lz4' or 'none' (raw)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (more than the free cores slows it down)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    gym.register_envs(ale_py)  # ale-py ships the ROMs: runs offline
    # frameskip=1 in the v5 env: AtariWrapper skips 4 frames itself, as with NoFrameskip-v4
    env = VecFrameStack(make_atari_env(args.game, n_envs=1, seed=args.seed, env_kwargs={"frameskip": 1}), n_stack=4)
    model_file, replay_file, store = args.dir / "model.zip", args.dir / "replay.pkl", args.dir / "replay"
    if model_file.exists():
        # DQN.load rebuilds the buffer from the saved replay_buffer_kwargs (the same path);
        # load_replay_buffer restores its cursor from the pickle
        model = DQN.load(model_file, env=env)
        model.load_replay_buffer(replay_file)
        held = model.replay_buffer.size()  # type: ignore[union-attr]
        print(f"resumed: {model.num_timesteps} steps trained, the store holds {held} transitions")
    else:
        codec = args.codec
        kwargs: dict[str, object] = {"path": store, "frame_stack": 4}
        if codec != "none":
            kwargs["codec"] = codec
        model = DQN(
            "CnnPolicy", env, buffer_size=args.buffer_size, learning_starts=args.learning_starts,
            batch_size=32, train_freq=4, target_update_interval=1_000, exploration_fraction=0.1,
            optimize_memory_usage=False, seed=args.seed, verbose=0,
            replay_buffer_class=mmbuffer.sb3.ReplayBuffer, replay_buffer_kwargs=kwargs,
        )
        held = 0
        print(f"new run: {args.game}, replay store {store} (codec {codec})")
    t0 = time.perf_counter()
    model.learn(args.steps, reset_num_timesteps=False)
    spent = time.perf_counter() - t0
    rb = model.replay_buffer
    assert isinstance(rb, mmbuffer.sb3.ReplayBuffer)
    size = rb.size()
    print(f"trained {args.steps} steps in {spent:.0f} s: {model.num_timesteps} steps in all, "
          f"{model._n_updates} gradient steps in all, learning_starts {model.learning_starts}")
    print(f"store holds {size} transitions ({size - held} added by this run)")
    args.dir.mkdir(parents=True, exist_ok=True)
    model.save(model_file)
    model.save_replay_buffer(replay_file)  # commits and closes the store; pickles its path and cursor
    used = disk_bytes(store)
    print(f"store on disk: {used / 2**20:.1f} MiB, {used / size:,.0f} B per transition "
          f"(SB3's own buffer: 56,448 B per transition in RAM); replay pickle {replay_file.stat().st_size:,} B")
    env.close()


if __name__ == "__main__":
    main()
