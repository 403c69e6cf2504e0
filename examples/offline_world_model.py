"""Offline world-model training on slices (TD-MPC2 style), from a converted D4RL file.

1. Roll out Gymnasium ``Pendulum-v1`` with a noisy energy-pumping controller and
   write the transitions as a D4RL-layout HDF5 file (``observations``,
   ``actions``, ``rewards``, ``terminals``, ``timeouts``, ``next_observations``).
2. Convert it into a store with ``mmbuffer.convert.convert_d4rl`` (streamed,
   verified; ``next_obs`` becomes derived, each episode's final observation kept).
3. Train a tiny latent dynamics model on ``[256, 4]`` slices streamed by
   ``mb.stream`` (a background thread samples and gathers the next batches while
   the model trains): an encoder ``z = h(obs)``, latent dynamics
   ``z' = d(z, a)`` and a reward head ``r = R(z, a)``, unrolled over the slice
   from its first observation and matched to the encoded later observations
   (stop-gradient targets) and the rewards, discounted by ``rho`` per step:
   TD-MPC2's latent consistency and reward losses, without the planner.

Prints the loss at the start and at the end; ``--quick`` runs in a few seconds.

    python examples/offline_world_model.py [--quick] [--dir DIR] [--episodes N] [--steps N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import torch
from torch import nn

import mmbuffer as mb
from mmbuffer.convert import convert_d4rl


def write_d4rl(path: Path, episodes: int, seed: int = 0) -> int:
    """Pendulum-v1 rollouts as a D4RL HDF5 file; returns the number of rows."""
    env = gym.make("Pendulum-v1")
    rng = np.random.default_rng(seed)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations")}
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        done = False
        while not done:
            cos, sin, vel = obs
            # pump energy when hanging, push towards upright near the top, plus noise
            act = np.clip(np.sign(vel) * 2.0 if cos < 0.5 else -2.0 * sin - 0.5 * vel, -2, 2)
            act = np.clip(act + rng.normal(0, 0.6), -2, 2).astype(np.float32).reshape(1)
            nxt, rew, term, trunc, _ = env.step(act)
            for k, v in zip(cols, (obs, act, rew, term, trunc, nxt)):
                cols[k].append(np.asarray(v))
            obs, done = nxt, term or trunc
    env.close()
    with h5py.File(path, "w") as f:
        f.create_dataset("observations", data=np.stack(cols["observations"]).astype(np.float32))
        f.create_dataset("actions", data=np.stack(cols["actions"]).astype(np.float32))
        f.create_dataset("rewards", data=np.array(cols["rewards"], dtype=np.float32))
        f.create_dataset("terminals", data=np.array(cols["terminals"], dtype=bool))
        f.create_dataset("timeouts", data=np.array(cols["timeouts"], dtype=bool))
        f.create_dataset("next_observations", data=np.stack(cols["next_observations"]).astype(np.float32))
    return len(cols["rewards"])


class WorldModel(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, latent: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ELU(), nn.Linear(hidden, latent), nn.LayerNorm(latent))
        self.dynamics = nn.Sequential(nn.Linear(latent + act_dim, hidden), nn.ELU(), nn.Linear(hidden, latent), nn.LayerNorm(latent))
        self.reward = nn.Sequential(nn.Linear(latent + act_dim, hidden), nn.ELU(), nn.Linear(hidden, 1))

    def loss(self, obs: torch.Tensor, action: torch.Tensor, reward: torch.Tensor, rho: float = 0.5) -> torch.Tensor:
        """Latent consistency + reward loss over slices ``[B, H + 1]``."""
        horizon = obs.shape[1] - 1
        with torch.no_grad():
            targets = self.encode(obs[:, 1:])  # stop-gradient, as TD-MPC2
        z = self.encode(obs[:, 0])
        total = obs.new_zeros(())
        for t in range(horizon):
            za = torch.cat([z, action[:, t]], -1)
            r_hat = self.reward(za).squeeze(-1)
            z = self.dynamics(za)
            total = total + rho**t * (((z - targets[:, t]) ** 2).mean() + 0.1 * ((r_hat - reward[:, t]) ** 2).mean())
        return total / horizon


def main() -> None:
    p = argparse.ArgumentParser(description="Offline TD-MPC2-style world model on Pendulum-v1 slices")
    p.add_argument("--quick", action="store_true", help="a few seconds: fewer episodes and steps")
    p.add_argument("--dir", type=Path, default=None, help="working directory (default: a temporary one)")
    p.add_argument("--episodes", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="gradient steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    episodes = args.episodes or (20 if args.quick else 100)
    steps = args.steps or (300 if args.quick else 3000)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # leave a core to the stream's sampling thread (see mmbuffer._feed.stream)
    with tempfile.TemporaryDirectory(prefix="mmbuffer-wm-") as tmp:
        run(args.dir or Path(tmp), episodes, steps, args.seed)


def run(work: Path, episodes: int, steps: int, seed: int) -> None:
    work.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    h5 = work / "pendulum-random-v0.hdf5"
    rows = write_d4rl(h5, episodes, seed)
    print(f"wrote {h5.name}: {rows} transitions from {episodes} Pendulum-v1 episodes")
    summary = convert_d4rl(h5, work / "pendulum", overwrite=True, progress=False)
    print(f"converted: rows={summary['rows']} episodes={summary['episodes']} verified={summary.get('verified')}")

    buf = mb.open(work / "pendulum", mode="r")
    model = WorldModel(buf.columns["obs"].shape[0], buf.columns["action"].shape[0])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    losses = []
    with mb.stream(buf, 256, slice_len=4, num_batches=steps, generator=g, keys=["obs", "action", "reward"]) as batches:
        for i, b in enumerate(batches):
            loss = model.loss(b["obs"], b["action"], b["reward"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if i % max(1, steps // 5) == 0:
                print(f"step {i:5d}  loss {loss.item():.4f}")
    buf.close()
    first, last = np.mean(losses[:20]), np.mean(losses[-20:])
    print(f"initial loss {first:.4f}")
    print(f"final loss {last:.4f}")
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
