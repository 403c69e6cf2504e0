"""Online SAC on Gymnasium ``Pendulum-v1`` with a prioritized on-disk replay store.

The actor loop appends every step to the store (``extend``: sampleable at once),
a background thread streams prioritized batches (``mb.stream(...,
prioritized=True)``), the critic loss is importance-weighted and its TD errors
go back as new priorities (``mmbuffer.losses.per_weighted_loss`` +
``buf.update_priorities``), the targets come from
``mmbuffer.losses.sac_targets``.

Kill it and resume it. The store is committed at the end of every episode, so
every commit holds whole episodes, and the networks, optimizers and step counter
are checkpointed beside the store (``<store>.ckpt.pt``, atomic rename) just
before. ``--resume`` reopens the same store: the rows it holds are the replay
data, the run continues from the stored row count (rows written after the last
commit were never committed: the kill loses at most one episode), and the
checkpoint restores the learner.

    python examples/online_sac.py --store runs/sac --steps 6000        # start
    python examples/online_sac.py --store runs/sac --steps 6000 --resume  # after a kill
    python examples/online_sac.py --quick                                # a few seconds
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from torch import nn

import mmbuffer as mb
from mmbuffer.losses import per_weighted_loss, sac_targets

OBS, ACT, MAX_ACTION = 3, 1, 2.0


def mlp(i: int, o: int, h: int = 128) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o))


class Actor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(OBS, 2 * ACT)

    def forward(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = self.net(obs).chunk(2, -1)
        std = log_std.clamp(-5, 2).exp()
        u = mean if deterministic else mean + std * torch.randn_like(mean)
        a = torch.tanh(u)
        logp = (-0.5 * ((u - mean) / std) ** 2 - std.log() - 0.5 * math.log(2 * math.pi)).sum(-1)
        logp = logp - torch.log(1 - a.pow(2) + 1e-6).sum(-1)
        return a * MAX_ACTION, logp


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q1, self.q2 = mlp(OBS + ACT, 1), mlp(OBS + ACT, 1)

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([obs, act / MAX_ACTION], -1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


class Agent:
    def __init__(self, lr: float) -> None:
        self.actor, self.critic, self.target = Actor(), Critic(), Critic()
        self.target.load_state_dict(self.critic.state_dict())
        self.log_alpha = torch.zeros((), requires_grad=True)
        self.opt_actor = torch.optim.Adam(self.actor.parameters(), lr=lr)
        self.opt_critic = torch.optim.Adam(self.critic.parameters(), lr=lr)
        self.opt_alpha = torch.optim.Adam([self.log_alpha], lr=lr)
        self.updates = 0

    def act(self, obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            a, _ = self.actor(torch.as_tensor(obs, dtype=torch.float32)[None])
        return a[0].numpy()

    def update(self, b: mb.Batch, gamma: float = 0.99, tau: float = 0.01) -> tuple[float, torch.Tensor]:
        alpha = self.log_alpha.exp().detach()
        # terminal next states (none in Pendulum; truncated rows bootstrap from the
        # stored final observation) never reach the networks with skip_done_states
        y = sac_targets(
            b["reward"], b["next_obs"], b["terminated"], self.actor, self.target, gamma, alpha,
            skip_done_states=True,
        )
        q1, q2 = self.critic(b["obs"], b["action"])
        loss1, prio1 = per_weighted_loss(q1, y, b.weights, kind="huber")
        loss2, prio2 = per_weighted_loss(q2, y, b.weights, kind="huber")
        self.opt_critic.zero_grad()
        (loss1 + loss2).backward()
        self.opt_critic.step()

        a, logp = self.actor(b["obs"])
        q = torch.min(*self.critic(b["obs"], a))
        actor_loss = (alpha * logp - q).mean()
        self.opt_actor.zero_grad()
        actor_loss.backward()
        self.opt_actor.step()
        alpha_loss = -(self.log_alpha * (logp.detach() - ACT).mean())  # target entropy -|A|
        self.opt_alpha.zero_grad()
        alpha_loss.backward()
        self.opt_alpha.step()
        with torch.no_grad():
            for p, tp in zip(self.critic.parameters(), self.target.parameters()):
                tp.lerp_(p, tau)
        self.updates += 1
        return float((loss1 + loss2).detach()), torch.maximum(prio1, prio2)

    def state_dict(self) -> dict:
        return {
            k: getattr(self, k).state_dict()
            for k in ("actor", "critic", "target", "opt_actor", "opt_critic", "opt_alpha")
        } | {"log_alpha": self.log_alpha.detach().clone(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        for k in ("actor", "critic", "target", "opt_actor", "opt_critic", "opt_alpha"):
            getattr(self, k).load_state_dict(state[k])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.updates = state["updates"]


def save_checkpoint(path: Path, agent: Agent, rows: int) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save({"agent": agent.state_dict(), "rows": rows, "rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)  # a kill leaves the old checkpoint or the new one, never half


def main() -> None:
    p = argparse.ArgumentParser(description="Online SAC on Pendulum-v1 with a prioritized mmbuffer store")
    p.add_argument("--store", type=Path, default=None, help="store directory (default: a temporary one)")
    p.add_argument("--steps", type=int, default=None, help="total environment steps (over resumes)")
    p.add_argument("--resume", action="store_true", help="continue from the rows in --store")
    p.add_argument("--quick", action="store_true", help="a few seconds: 1200 steps")
    p.add_argument("--learning-starts", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.resume and args.store is None:
        p.error("--resume needs --store (the store to continue)")
    if args.store is None:
        with tempfile.TemporaryDirectory(prefix="mmbuffer-sac-") as tmp:
            args.store = Path(tmp) / "replay"
            train(args)
    else:
        train(args)


def train(args: argparse.Namespace) -> None:
    steps = args.steps or (1200 if args.quick else 6000)
    store = args.store
    ckpt = store.with_name(store.name + ".ckpt.pt")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # small networks: one intra-op thread, the other core samples
    agent = Agent(lr=1e-3)

    if args.resume and store.exists():
        buf = mb.open(store)  # the single writer; rows past the last commit are gone
        rows = len(buf)
        print(f"resumed from {rows} stored rows ({buf.num_episodes} episodes, generation {buf.generation})")
        if ckpt.exists():
            state = torch.load(ckpt, weights_only=True)  # tensors and plain containers only: no pickled code
            agent.load_state_dict(state["agent"])
            torch.set_rng_state(state["rng"])
            print(f"restored learner from checkpoint at {state['rows']} rows ({agent.updates} updates)")
    else:
        if store.exists():
            shutil.rmtree(store)
        buf = mb.create(
            store,
            {"obs": ((OBS,), "float32"), "action": ((ACT,), "float32"), "reward": ((), "float32")},
            capacity=max(steps, 1000),
            priorities=mb.PriorityConfig(alpha=0.6),
        )
        rows = 0
        print(f"new store {store}")

    env = gym.make("Pendulum-v1")
    obs, _ = env.reset(seed=args.seed + rows)
    episode_return, returns, losses = 0.0, [], []
    batches = None  # the prioritized stream, started once there is enough data
    t0 = time.perf_counter()
    try:
        while rows < steps:
            if rows < args.learning_starts:
                action = env.action_space.sample().astype(np.float32)
            else:
                action = agent.act(obs).astype(np.float32)
            nxt, reward, term, trunc, _ = env.step(action)
            trunc = trunc or rows + 1 == steps  # the run ends here: cut the episode, keep it whole
            done = term or trunc
            buf.extend(
                {"obs": obs[None], "action": action[None], "reward": [reward], "terminated": [term], "truncated": [trunc]},
                final_obs={"obs": nxt[None]} if done else None,
            )
            rows += 1
            episode_return += float(reward)
            obs = nxt
            if rows >= args.learning_starts:
                if batches is None:
                    g = torch.Generator().manual_seed(args.seed + rows)
                    batches = mb.stream(buf, args.batch_size, prioritized=True, beta=0.4, generator=g, prefetch=2)
                b = next(batches)
                loss, new_priorities = agent.update(b)
                buf.update_priorities(b.indices, new_priorities)  # safe while the stream samples
                losses.append(loss)
            if done:
                returns.append(episode_return)
                save_checkpoint(ckpt, agent, rows)
                buf.commit()  # whole episodes only: a resumed run starts a fresh one
                recent = np.mean(losses[-200:]) if losses else float("nan")
                print(
                    f"committed rows={rows} episodes={buf.num_episodes} return={episode_return:.1f} "
                    f"critic_loss={recent:.3f} alpha={agent.log_alpha.exp().item():.3f}",
                    flush=True,
                )
                obs, _ = env.reset(seed=args.seed + rows)
                episode_return = 0.0
    finally:
        if batches is not None:
            batches.close()
        env.close()
    buf.close()
    print(f"first returns {np.round(returns[:3], 1).tolist()}  last returns {np.round(returns[-3:], 1).tolist()}")
    print(f"done rows={rows} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
