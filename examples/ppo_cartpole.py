"""PPO on Gymnasium ``CartPole-v1``, rollouts kept in a multi-lane store.

Each iteration collects ``--rollout`` steps from each of ``--envs`` environments
and appends them to the store, one lane per environment (``num_streams``), each
lane a ring that keeps the last few rollouts on disk. Then:

* values and the old log-probabilities of the rollout are computed with
  ``mmbuffer.losses.minibatched`` (a no-grad pass in chunks, results identical to
  one full pass, memory bounded by the chunk),
* advantages with ``mmbuffer.losses.gae``: episodes ending by termination do not
  bootstrap, episodes cut by CartPole's 500-step limit bootstrap from the stored
  final observation (``next_obs`` of their last row), the rollout's unfinished
  episodes from the current observation,
* the clipped PPO objective over shuffled minibatches.

At the end, ``mmbuffer.losses.gae_from_buffer`` (with ``lam=1``: Monte-Carlo
returns) measures the value error over every complete episode still stored.

    python examples/ppo_cartpole.py [--quick] [--iterations N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from torch import nn

import mmbuffer as mb
from mmbuffer.losses import gae, gae_from_buffer, minibatched

OBS, ACTIONS = 4, 2


class ActorCritic(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(OBS, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, ACTIONS))
        self.v = nn.Sequential(nn.Linear(OBS, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def dist(self, obs: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.pi(obs))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.v(obs).squeeze(-1)


def collect(envs: list[gym.Env], obs: np.ndarray, model: ActorCritic, steps: int, stats: dict) -> tuple[dict, list, np.ndarray]:
    """``steps`` steps of each env: per-lane step arrays, per-lane final observations, current obs."""
    n = len(envs)
    cols = {k: np.zeros((steps, n), dtype=d) for k, d in (("action", np.int64), ("reward", np.float32), ("terminated", bool), ("truncated", bool))}
    cols["obs"] = np.zeros((steps, n, OBS), dtype=np.float32)
    finals: list[list[np.ndarray]] = [[] for _ in range(n)]
    for t in range(steps):
        with torch.no_grad():
            actions = model.dist(torch.as_tensor(obs)).sample().numpy()
        cols["obs"][t] = obs
        cols["action"][t] = actions
        for i, env in enumerate(envs):
            nxt, r, term, trunc, _ = env.step(int(actions[i]))
            cols["reward"][t, i], cols["terminated"][t, i], cols["truncated"][t, i] = r, term, trunc
            stats["ret"][i] += r
            if term or trunc:
                finals[i].append(nxt)
                stats["returns"].append(stats["ret"][i])
                stats["ret"][i] = 0.0
                nxt, _ = env.reset()
            obs[i] = nxt
    return cols, finals, obs


def main() -> None:
    p = argparse.ArgumentParser(description="PPO on CartPole-v1 with mmbuffer's minibatched and gae")
    p.add_argument("--quick", action="store_true", help="a few seconds: 25 iterations")
    p.add_argument("--iterations", type=int, default=None)
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--rollout", type=int, default=128, help="steps per env per iteration")
    p.add_argument("--store", type=Path, default=None, help="store directory (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.store is None:
        with tempfile.TemporaryDirectory(prefix="mmbuffer-ppo-") as tmp:
            args.store = Path(tmp) / "rollouts"
            train(args)
    else:
        train(args)


def train(args: argparse.Namespace) -> None:
    iterations = args.iterations or (25 if args.quick else 120)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    n, T = args.envs, args.rollout
    lane = max(1024, 4 * T)  # a lane must hold CartPole's longest episode (500 steps)
    store = args.store
    buf = mb.create(
        store,
        {"obs": ((OBS,), "float32"), "action": ((), "int64"), "reward": ((), "float32")},
        capacity=lane * n,
        num_streams=n,
    )
    envs = [gym.make("CartPole-v1") for _ in range(n)]
    obs = np.stack([env.reset(seed=args.seed + i)[0] for i, env in enumerate(envs)]).astype(np.float32)
    model = ActorCritic()
    opt = torch.optim.Adam(model.parameters(), lr=2.5e-3)
    stats: dict = {"ret": np.zeros(n), "returns": []}
    written = np.zeros(n, dtype=np.int64)  # rows appended per lane
    gamma, lam, clip = 0.99, 0.95, 0.2
    t0 = time.perf_counter()
    means = []

    for it in range(iterations):
        cols, finals, obs = collect(envs, obs, model, T, stats)
        for i in range(n):  # one extend per lane: the rollout's rows of env i
            fin = {"obs": np.stack(finals[i])} if finals[i] else None
            buf.extend({k: v[:, i] for k, v in cols.items()}, stream=i, final_obs=fin)
        rows = torch.as_tensor(np.stack([i * lane + (written[i] + np.arange(T)) % lane for i in range(n)], 1))  # [T, n]
        written += T
        data = buf.get(rows, keys=["obs", "action", "reward", "terminated", "truncated"])
        flat_obs, flat_act = data["obs"].reshape(T * n, OBS), data["action"].reshape(T * n)

        with torch.no_grad():
            values = minibatched(model.value, flat_obs, 256).reshape(T, n)
            old_logp = minibatched(lambda b: model.dist(b["obs"]).log_prob(b["action"]), {"obs": flat_obs, "action": flat_act}, 256)
            next_values = torch.empty_like(values)
            next_values[:-1] = values[1:]
            next_values[-1] = model.value(torch.as_tensor(obs))  # unfinished episodes: the current observation
            trunc = data["truncated"]
            if trunc.any():  # time-limit ends: bootstrap from the stored final observation
                final = buf.get(rows[trunc], keys=["next_obs"])["next_obs"]
                next_values[trunc] = model.value(final)
        adv, ret = gae(data["reward"], values, next_values, data["terminated"], trunc, gamma, lam)
        adv, ret = adv.reshape(-1), ret.reshape(-1)

        for _ in range(4):
            for mbi in torch.randperm(T * n).split(128):
                d = model.dist(flat_obs[mbi])
                ratio = (d.log_prob(flat_act[mbi]) - old_logp[mbi]).exp()
                a = (adv[mbi] - adv[mbi].mean()) / (adv[mbi].std() + 1e-8)
                pg = -torch.min(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a).mean()
                vloss = 0.5 * (model.value(flat_obs[mbi]) - ret[mbi]).pow(2).mean()
                loss = pg + 0.5 * vloss - 0.01 * d.entropy().mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
        buf.commit()
        recent = stats["returns"][-10:]
        means.append(float(np.mean(recent)) if recent else float("nan"))
        if it % max(1, iterations // 10) == 0 or it == iterations - 1:
            print(f"iteration {it:4d}  steps {int(written.sum()):7d}  mean return (last 10 episodes) {means[-1]:.1f}", flush=True)

    idx, adv_mc, _ = gae_from_buffer(buf, model.value, gamma, 1.0, 512)
    print(f"value error over {buf.num_episodes} stored episodes ({len(idx)} rows): mean |G - V| = {adv_mc.abs().mean():.2f}")
    buf.close()
    for env in envs:
        env.close()
    print(f"first mean return {means[0]:.1f}")
    print(f"last mean return {means[-1]:.1f}")
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
