"""Prioritized replay for SB3's DQN (Schaul et al. 2016): ``PrioritizedReplayBuffer``
and ``PrioritizedDQN``, the smallest ``DQN`` subclass that feeds TD errors back.

SB3 has no prioritized replay (DLR-RM/stable-baselines3#1242). The hook needs no
patching of SB3: the buffer's ``sample`` returns SB3's fields plus ``weights``
(importance weights ``[B, 1]``) and ``indices`` (store rows), a plain ``DQN``
still trains on it (uniformly weighted, priorities never updated), and
``PrioritizedDQN.train`` is SB3's ``DQN.train`` with the Huber loss weighted and
``replay_buffer.update_priorities(indices, |TD error|)`` after each step::

    model = mmbuffer.sb3.PrioritizedDQN("MlpPolicy", env,
        replay_buffer_class=mmbuffer.sb3.PrioritizedReplayBuffer,
        replay_buffer_kwargs={"path": "runs/replay", "alpha": 0.6, "beta": 0.4})

Draws come from the store's priority tree (``torch``'s global generator, which
SB3's ``set_random_seed`` seeds), so they cover the rows the store can sample:
every added step except the newest one or two of each env (the newest is held
in memory, the store's open last row waits for its next observation), and not
the remaining rows of an episode whose first rows the ring overwrote (mmbuffer
evicts whole episodes). A new row gets the largest live priority, capped
at ``max_priority ** alpha`` (default ``max_priority=1e4``, well above Huber TD
errors, so the cap does not bind on them). ``beta`` is an attribute; anneal it
with a callback if wanted.

>>> import tempfile, gymnasium as gym
>>> model = PrioritizedDQN("MlpPolicy", gym.make("CartPole-v1"), learning_starts=50, buffer_size=500,
...     replay_buffer_class=PrioritizedReplayBuffer, replay_buffer_kwargs={"path": tempfile.mkdtemp() + "/per"})
>>> _ = model.learn(100)
>>> s = model.replay_buffer.sample(8)
>>> tuple(s.weights.shape), s.indices.dtype
((8, 1), torch.int64)
>>> model.replay_buffer.close()
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .. import errors
from .._read.gather import Batch
from ..schema import PriorityConfig
from .replay import ReplayBuffer

from stable_baselines3 import DQN
from stable_baselines3.common.vec_env import VecNormalize

__all__ = ["PrioritizedDQN", "PrioritizedReplayBuffer", "PrioritizedReplayBufferSamples"]

_REMEMBERED = 64


class PrioritizedReplayBufferSamples(NamedTuple):
    """SB3's ``ReplayBufferSamples`` fields, then ``weights`` (float32 ``[B, 1]``)
    and ``indices`` (int64 ``[B]`` store rows, for ``update_priorities``)."""

    observations: torch.Tensor
    actions: torch.Tensor
    next_observations: torch.Tensor
    dones: torch.Tensor
    rewards: torch.Tensor
    discounts: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    indices: torch.Tensor | None = None


class PrioritizedReplayBuffer(ReplayBuffer):
    """:class:`~mmbuffer.sb3.ReplayBuffer` whose store keeps a priority tree; ``sample``
    draws by priority and returns :class:`PrioritizedReplayBufferSamples`.

    Keywords (``replay_buffer_kwargs``) besides ``ReplayBuffer``'s: ``alpha`` (0.6),
    ``beta`` (0.4), ``eps`` (1e-6), ``max_priority`` (1e4): see ``mb.PriorityConfig``.
    """

    _hold_steps = 2  # steps reach the store (and its sampler) one add after they are added

    def __init__(self, *args: Any, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6,
                 max_priority: float = 1e4, **kwargs: Any) -> None:
        self._config = PriorityConfig(alpha=alpha, eps=eps, max_priority=max_priority)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta <= 1:
            raise errors.InvalidArgumentError(f"beta: expected a number in [0, 1], got {beta!r}")
        self.beta = float(beta)
        super().__init__(*args, **kwargs)
        self._init_kwargs.update(alpha=alpha, beta=beta, eps=eps, max_priority=max_priority)
        self._written: dict[int, tuple[weakref.ref[torch.Tensor], np.ndarray]] = {}

    def _priority_config(self) -> PriorityConfig | None:
        return self._config

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["init"]["beta"] = self.beta  # as annealed so far
        return state

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> PrioritizedReplayBufferSamples:  # type: ignore[override]
        """``batch_size`` rows drawn with probability ``p_i / sum p`` and their
        importance weights ``(N P(i)) ** -beta / max``. A reader (``mode="r"``): by the
        priorities the writer committed, intact rows only (:mod:`mmbuffer.sb3.follow`)."""
        if self._lanes.read_only:
            self._follow()
            items = self._draw_rows(batch_size)
            got, items = self._read_intact(items, lambda m, reserved: self._draw_rows(m))
            rows, weights, written = items["rows"], items["weights"], items["written"][0]
        else:
            rows, weights, written = self._lanes.reader().sample_indices(batch_size, prioritized=True, beta=self.beta)
            envs, steps = self._lanes.rows_steps(rows)  # the store's rows as they are (none held)
            got = self._lanes.gather_steps(envs, steps, self._keys(), held=False)
        base = self._transitions(got, env)
        indices = torch.from_numpy(rows)
        self._remember(indices, written)
        return PrioritizedReplayBufferSamples(
            base.observations, base.actions, base.next_observations, base.dones, base.rewards,
            weights=torch.as_tensor(weights.reshape(-1, 1), device=self.device), indices=indices,
        )

    def _draw_rows(self, m: int) -> dict[str, np.ndarray]:
        """A reader's draw of ``m`` rows by priority, as ``follow.read_intact`` items."""
        lanes = self._lanes
        rows, weights, written = lanes.reader().sample_indices(m, prioritized=True, beta=self.beta)
        envs, at = rows // lanes.lane, rows % lanes.lane
        last = written[envs] - 1  # the lanes' committed cursors: row -> step
        return {"envs": envs, "steps": last - (last - at) % lanes.lane, "rows": rows, "weights": weights,
                "written": np.broadcast_to(written, (m, len(written))).copy()}

    def update_priorities(self, indices: torch.Tensor, priorities: Any) -> None:
        """Set the priorities (``|TD error|``, before ``eps`` and ``alpha``) of the rows a
        ``sample`` returned (``indices``: its ``indices``); ``[B]`` or ``[B, 1]``.
        Rows overwritten since that sample are left alone. ``ReadOnlyError`` in a
        reader (``mode="r"``): the priorities are the writer's to set."""
        if self._lanes.read_only:
            raise errors.ReadOnlyError(
                f"update_priorities: expected a buffer opened with mode='a' (the one that adds), got mode='r': the "
                f"priorities of {self.path} are set by the process that writes it; nothing was changed"
            )
        entry = self._written.get(id(indices))
        written = entry[1] if entry is not None and entry[0]() is indices else None
        pri = torch.as_tensor(priorities).detach().to(torch.float64).cpu().reshape(-1)
        idx = torch.as_tensor(indices).cpu()
        target: Any = Batch({}, idx, torch.ones(0), None, written) if written is not None else idx
        self._lanes.writer().update_priorities(target, pri)

    def _remember(self, indices: torch.Tensor, written: np.ndarray) -> None:
        if len(self._written) >= _REMEMBERED:
            self._written = {k: v for k, v in self._written.items() if v[0]() is not None}
            while len(self._written) >= _REMEMBERED:
                self._written.pop(next(iter(self._written)))
        self._written[id(indices)] = (weakref.ref(indices), written.copy())


class PrioritizedDQN(DQN):
    """SB3's ``DQN`` whose ``train`` weights the Huber loss by the samples' importance
    weights and feeds ``|TD error|`` back with ``update_priorities`` (needs a
    :class:`PrioritizedReplayBuffer`). Everything else is SB3's ``DQN``."""

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        """SB3's ``DQN.train`` (2.x) with the two prioritized-replay lines."""
        buffer = self.replay_buffer
        if not isinstance(buffer, PrioritizedReplayBuffer):
            raise errors.InvalidArgumentError(
                f"replay_buffer_class: expected mmbuffer.sb3.PrioritizedReplayBuffer for PrioritizedDQN, got {type(buffer).__name__}"
            )
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        losses = []
        for _ in range(gradient_steps):
            data = buffer.sample(batch_size, env=self._vec_normalize_env)
            assert data.weights is not None and data.indices is not None
            with torch.no_grad():
                next_q = self.q_net_target(data.next_observations).max(dim=1)[0].reshape(-1, 1)
                target_q = data.rewards + (1 - data.dones) * self.gamma * next_q
            current_q = torch.gather(self.q_net(data.observations), dim=1, index=data.actions.long())
            loss = (data.weights * F.smooth_l1_loss(current_q, target_q, reduction="none")).mean()
            losses.append(loss.item())
            self.policy.optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
            buffer.update_priorities(data.indices, (current_q - target_q).abs().detach())
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", np.mean(losses))
