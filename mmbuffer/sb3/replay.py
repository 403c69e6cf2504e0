"""``ReplayBuffer`` / ``DictReplayBuffer``: SB3's replay buffers over an mmbuffer
store (see :mod:`mmbuffer.sb3` for the rules; the store side is ``rows.py``).

>>> import tempfile, numpy as np
>>> from gymnasium import spaces
>>> rb = ReplayBuffer(100, spaces.Box(-1, 1, (3,)), spaces.Discrete(2), device="cpu",
...                   path=tempfile.mkdtemp() + "/replay")
>>> for t in range(5):
...     rb.add(np.full((1, 3), t / 10, np.float32), np.full((1, 3), (t + 1) / 10, np.float32),
...            np.array([1]), np.array([1.0]), np.array([t == 4]), [{}])
>>> rb.size(), rb.pos
(5, 5)
>>> s = rb._get_samples(np.array([3, 4]), env_indices=np.array([0, 0]))
>>> s.next_observations[:, 0].tolist(), s.dones.tolist(), s.actions.dtype
([0.4000000059604645, 0.5], [[0.0], [1.0]], torch.int64)
>>> rb.close()
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import errors
from .._ledger.closing import close_first
from ..schema import PriorityConfig
from .follow import draw_intact, read_intact, span
from .rows import Lanes
from .stacks import FrameStack
from .views import ColumnView

try:
    from gymnasium import spaces
    from stable_baselines3.common import buffers as sb3_buffers
    from stable_baselines3.common.preprocessing import get_action_dim, get_obs_shape
    from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples
    from stable_baselines3.common.utils import get_device
    from stable_baselines3.common.vec_env import VecNormalize
except ImportError as exc:  # pragma: no cover - the extra is installed where tests run
    raise ImportError(f"mmbuffer.sb3: expected stable-baselines3 installed (pip install 'mmbuffer[sb3]'), got {exc}") from exc

__all__ = ["DictReplayBuffer", "ReplayBuffer"]

COMMIT_EVERY = 10_000
COMMIT_SECONDS = 30.0


class _OnDisk:
    """What ``ReplayBuffer`` and ``DictReplayBuffer`` share: the constructor SB3's
    algorithms call, ``add``, ``sample``, ``_get_samples``, pickling, ``close``."""

    # set by the SB3 base classes' __init__, which is never called: every attribute
    # SB3's algorithms read is set by __init__ below
    buffer_size: int
    observation_space: spaces.Space[Any]
    action_space: spaces.Space[Any]
    obs_shape: Any
    action_dim: int
    _pos: int
    _full: bool
    device: torch.device
    n_envs: int
    optimize_memory_usage: bool
    handle_timeout_termination: bool
    _lanes: Lanes
    #: steps per env held in memory before they are written as one block (``Lanes``)
    _hold_steps = 64

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        device: torch.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        path: str | os.PathLike[str] | None = None,
        commit_every: int = COMMIT_EVERY,
        commit_seconds: float = COMMIT_SECONDS,
        frame_stack: int | None = None,
        channels_order: str | None = None,
        codec: Any = None,
        mode: str = "a",
    ) -> None:
        # SB3's __init__ is not called: it allocates every array in RAM
        if mode not in ("a", "r"):
            raise errors.InvalidArgumentError(
                f"mode: expected 'a' (this buffer adds) or 'r' (a learner reading a store another process adds to), got {mode!r}"
            )
        if path is None:
            raise errors.InvalidArgumentError(
                'path: expected the store directory, replay_buffer_kwargs={"path": "runs/replay"}, got None'
            )
        if frame_stack is None and channels_order is not None:
            raise errors.InvalidArgumentError(
                f"channels_order: expected None without frame_stack (it names VecFrameStack's stack axis), got {channels_order!r}"
            )
        if isinstance(n_envs, bool) or not isinstance(n_envs, (int, np.integer)) or n_envs < 1:
            raise errors.InvalidArgumentError(f"n_envs: expected a positive integer, got {n_envs!r}")
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, np.integer)) or buffer_size < 1:
            raise errors.InvalidArgumentError(f"buffer_size: expected a positive integer, got {buffer_size!r}")
        self.observation_space, self.action_space = observation_space, action_space
        self.obs_shape = get_obs_shape(observation_space)
        self.action_dim = get_action_dim(action_space)
        self.n_envs = int(n_envs)
        self.buffer_size = max(int(buffer_size) // self.n_envs, 1)  # per env, as SB3
        self.device = get_device(device)
        # observations are stored once, next_obs derived: SB3#934's conflict does not arise
        self.optimize_memory_usage = bool(optimize_memory_usage)
        self.handle_timeout_termination = bool(handle_timeout_termination)
        self._stack = None if frame_stack is None else self._frame_stack(frame_stack, channels_order)
        action_dtype = np.float32 if action_space.dtype == np.float64 else action_space.dtype  # SB3's _maybe_cast_dtype
        self._action_dtype = np.dtype(action_dtype)
        columns = {c: (shape, str(np.dtype(dtype))) for c, (shape, dtype) in self._obs_columns().items()}
        columns.update({
            "action": ((self.action_dim,), str(self._action_dtype)),
            "reward": ((), "float32"),
            "done": ((), "float32"),
            "timeout": ((), "float32"),
        })
        if self._stack is not None:
            columns["obs"] = (self._stack.frame_shape, str(self._stack.dtype))  # one frame a step
            columns["depth"] = ((), "uint8")
        self._lanes = Lanes(
            Path(path).absolute(), columns, tuple(self._obs_columns()), buffer_size=self.buffer_size, n_envs=self.n_envs,
            commit_every=commit_every, commit_seconds=commit_seconds, priorities=self._priority_config(),
            block=self._hold_steps, stack=self._stack, codec=codec, read_only=mode == "r",
        )
        # what __setstate__ calls __init__ with (path absolute: a pickle may be loaded elsewhere)
        self._init_kwargs: dict[str, Any] = {
            "buffer_size": buffer_size, "observation_space": observation_space, "action_space": action_space,
            "device": str(self.device), "n_envs": self.n_envs, "optimize_memory_usage": self.optimize_memory_usage,
            "handle_timeout_termination": self.handle_timeout_termination, "path": str(self._lanes.path),
            "commit_every": self._lanes.commit_every, "commit_seconds": self._lanes.commit_seconds,
            "frame_stack": frame_stack, "channels_order": channels_order, "codec": codec, "mode": mode,
        }
        self._cursor()
        self._finalizer = weakref.finalize(self, self._lanes.close)  # a buffer garbage-collected mid-run
        self._finalizer.atexit = False  # at exit: before the core closes the writer (it holds steps in memory)
        close_first(self, self._lanes.close)

    def _priority_config(self) -> PriorityConfig | None:
        return None  # PrioritizedReplayBuffer: its PriorityConfig

    def _cursor(self) -> None:
        adds = self._lanes.adds
        self._pos, self._full = adds % self.buffer_size, adds >= self.buffer_size

    def _follow(self) -> None:
        """A reader: move to the writer's newest commit (``follow.py``)."""
        if self._lanes.read_only:
            self._lanes.follow()
            self._cursor()

    @property
    def mode(self) -> str:
        """``"a"``: this buffer adds (one buffer per store); ``"r"``: a learner reading a
        store another process adds to, following its commits (:mod:`mmbuffer.sb3.follow`)."""
        return "r" if self._lanes.read_only else "a"

    @property
    def pos(self) -> int:
        """SB3's next slot (a reader: as of the writer's newest commit)."""
        self._follow()
        return self._pos

    @property
    def full(self) -> bool:
        """Whether every slot was written (a reader: as of the writer's newest commit)."""
        self._follow()
        return self._full

    def size(self) -> int:
        """SB3's ``size()``: steps per env held, at most ``buffer_size`` (a reader: committed)."""
        self._follow()
        return self.buffer_size if self._full else self._pos

    # -- what SB3 calls ------------------------------------------------------------------
    @property
    def path(self) -> Path:
        """The store directory."""
        return self._lanes.path

    # SB3's arrays, as read-only views of the store (views.py): for code that inspects them
    @property
    def observations(self) -> Any:
        return self._obs_views("")

    @property
    def next_observations(self) -> Any:
        return self._obs_views("next_")

    @property
    def actions(self) -> ColumnView:
        return ColumnView(self._lanes, "action", (self.action_dim,), self._action_dtype)

    @property
    def rewards(self) -> ColumnView:
        return ColumnView(self._lanes, "reward", (), np.float32)

    @property
    def dones(self) -> ColumnView:
        """Also takes ``dones[pos - 1] = True`` (SB3's ``_setup_learn`` with
        ``optimize_memory_usage``): the newest step of every env is marked done."""
        return ColumnView(self._lanes, "done", (), np.float32)

    @property
    def timeouts(self) -> ColumnView:
        return ColumnView(self._lanes, "timeout", (), np.float32)

    def add(
        self,
        obs: Any,
        next_obs: Any,
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        """One step of every env, as SB3's ``add`` (``next_obs`` the true final
        observation at an episode end, as SB3's ``_store_transition`` gives it).
        ``ReadOnlyError`` in a reader (``mode="r"``), before anything is written."""
        if self._lanes.read_only:
            raise errors.ReadOnlyError(
                f"add: expected a buffer opened with mode='a' (the actor's), got mode='r': {self.path} is written "
                "by another process and read by this learner; nothing was added"
            )
        n = self.n_envs
        row = self._obs_row(obs)
        row.update({
            "action": np.asarray(action).reshape((n, self.action_dim)).astype(self._action_dtype, copy=False),
            "reward": np.asarray(reward, dtype=np.float32).reshape(n),
            "done": np.asarray(done, dtype=np.float32).reshape(n),
            "timeout": np.zeros(n, dtype=np.float32),
        })
        if self.handle_timeout_termination:
            row["timeout"] = np.array([info.get("TimeLimit.truncated", False) for info in infos], dtype=np.float32)
        next_row = self._obs_row(next_obs)
        fs = self._stack
        if fs is not None:  # store the newest frames, checked against the stacks the store rebuilds
            if not fs.remembers and self._lanes.adds:
                self._remember_newest()
            dtype = self._lanes.columns["obs"][1]
            row["obs"], next_row["obs"], row["depth"] = fs.check(
                row["obs"].astype(dtype, copy=False), next_row["obs"].astype(dtype, copy=False), row["done"], self._lanes.adds
            )
        self._lanes.add(row, next_row)
        if fs is not None:
            fs.commit_check()
        self._cursor()

    def _frame_stack(self, k: Any, channels_order: str | None) -> FrameStack:
        return FrameStack.for_space(self.observation_space, k, channels_order)

    def _remember_newest(self) -> None:
        """Load the newest stored step of every env into the frame-stack check (a
        reopened store: the next ``add`` is checked against it)."""
        assert self._stack is not None
        envs = np.arange(self.n_envs)
        steps = np.full(self.n_envs, self._lanes.adds - 1)
        got = self._lanes.gather_steps(envs, steps, ["obs", "next_obs", "done", "depth"])
        fs = self._stack
        fs.load(fs.split(got["obs"]), fs.split(got["next_obs"])[:, -1], got["done"] != 0, got["depth"])

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> Any:
        """``batch_size`` transitions drawn as SB3 draws them (``np.random``): a slot
        below ``size()``, then an env; every slot samples, ``optimize_memory_usage``
        or not (the next observations are all kept). A reader (``mode="r"``): the
        writer's committed steps, intact ones only (:mod:`mmbuffer.sb3.follow`)."""
        if self._lanes.read_only:
            self._follow()
            if self._lanes.adds == 0:
                raise errors.EmptyBufferError(f"sample: expected committed steps in {self.path}, got none yet")
            slots = np.random.randint(0, self.buffer_size if self._full else self._pos, size=batch_size)
            envs = np.random.randint(0, high=self.n_envs, size=(batch_size,)).astype(np.int64)
            items = {"envs": envs, "steps": self._lanes.steps_at(slots)}
            return self._transitions(self._read_intact(items, self._redraw)[0], env)
        upper_bound = self.buffer_size if self.full else self.pos
        batch_inds = np.random.randint(0, upper_bound, size=batch_size)
        return self._get_samples(batch_inds, env=env)

    def _get_samples(
        self, batch_inds: np.ndarray, env: VecNormalize | None = None, env_indices: np.ndarray | None = None,
    ) -> Any:
        """SB3's ``_get_samples``: ``env_indices`` drawn with ``np.random`` as SB3 draws
        them when not given. A reader refuses a slot whose rows the writer is
        rewriting with ``RowNotLiveError`` (:mod:`mmbuffer.sb3.follow`)."""
        if env_indices is None:
            env_indices = np.random.randint(0, high=self.n_envs, size=(len(batch_inds),))
        if self._lanes.read_only:
            self._follow()
            items = {"envs": np.array(env_indices, dtype=np.int64), "steps": self._lanes.steps_at(batch_inds)}
            return self._transitions(self._read_intact(items, None)[0], env)
        return self._transitions(self._lanes.gather(np.asarray(env_indices), np.asarray(batch_inds), self._keys()), env)

    def _read_intact(
        self, items: dict[str, np.ndarray], redraw: Callable[[int, np.ndarray], dict[str, np.ndarray] | None] | None,
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """A reader's gather of ``items`` (``envs``, ``steps``), checked against the writer
        (``follow.read_intact``)."""
        lanes, keys = self._lanes, self._keys()
        return read_intact(
            lanes.reader(), items, lambda e, s: lanes.gather_steps(e, s, keys), lanes.lane, self._older(), redraw,
        )

    def _older(self) -> int:
        return span(None if self._stack is None else self._stack.k)

    def _redraw(self, m: int, reserved: np.ndarray) -> dict[str, np.ndarray] | None:
        """``m`` steps drawn uniformly among the committed intact ones (a newer commit
        first when there is none)."""
        lanes = self._lanes
        got = draw_intact(m, lanes.adds, self.buffer_size, reserved, lanes.lane, self._older())
        if got is None and lanes.follow(force=True):
            got = draw_intact(m, lanes.adds, self.buffer_size, lanes.reader().reservation(), lanes.lane, self._older())
        return got

    def _keys(self) -> list[str]:
        obs_cols = list(self._obs_columns())
        return [*obs_cols, *(f"next_{c}" for c in obs_cols), "action", "reward", "done", "timeout"]

    def _transitions(self, got: dict[str, np.ndarray], env: VecNormalize | None) -> Any:
        """SB3's samples of the gathered ``got`` (``_keys``)."""
        dones = (got["done"] * (1 - got["timeout"])).reshape(-1, 1)
        rewards = got["reward"].reshape(-1, 1)
        if env is not None:
            rewards = env.normalize_reward(rewards).astype(np.float32)
        obs = self._normalize(self._obs_value(got, ""), env)
        next_obs = self._normalize(self._obs_value(got, "next_"), env)
        return self._samples(obs, got["action"], next_obs, dones, rewards)

    def _torch(self, array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(array, device=self.device)

    @staticmethod
    def _normalize(obs: Any, env: VecNormalize | None) -> Any:
        return obs if env is None else env.normalize_obs(obs)

    # -- per observation kind (overridden by DictReplayBuffer) ----------------------------
    def _obs_columns(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        return {"obs": (tuple(self.obs_shape), self.observation_space.dtype)}

    def _obs_row(self, obs: Any) -> dict[str, np.ndarray]:
        return {"obs": np.asarray(obs).reshape((self.n_envs, *self.obs_shape))}

    def _obs_value(self, got: dict[str, np.ndarray], prefix: str) -> Any:
        return got[f"{prefix}obs"]

    def _obs_views(self, prefix: str) -> Any:
        return ColumnView(self._lanes, f"{prefix}obs", tuple(self.obs_shape), self.observation_space.dtype)

    def _samples(self, obs: Any, actions: np.ndarray, next_obs: Any, dones: np.ndarray, rewards: np.ndarray) -> Any:
        t = self._torch
        return ReplayBufferSamples(t(obs), t(actions), t(next_obs), t(dones), t(rewards))

    # -- the store -----------------------------------------------------------------------
    def commit(self) -> int:
        """Write the held steps and commit the store (``add`` does it every
        ``commit_every`` steps or ``commit_seconds``); return the generation."""
        return self._lanes.commit()

    def close(self) -> None:
        """Commit and release the store (its writer lock); using the buffer again reopens it."""
        self._lanes.close()

    def reset(self) -> None:
        """Refused: the store keeps what was added (SB3's ``reset`` only moves ``pos``)."""
        raise errors.InvalidArgumentError(
            f"reset: expected no call, got one: the store at {self.path} keeps its rows; use a new path for an empty buffer"
        )

    def __getstate__(self) -> dict[str, Any]:
        """Commit and close the store; the state is its path, the cursor and the
        constructor's arguments (kilobytes, not the data). This buffer reopens the
        store when it is used again."""
        self._lanes.close()
        return {"init": dict(self._init_kwargs), "adds": self._lanes.adds}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Reopen the store ``state`` names (lazily: reading at the first sample, the
        writer lock at the first add), checked against the state's layout."""
        type(self).__init__(self, **state["init"])
        if state["adds"] and not self.path.exists():
            raise errors.StoreNotFoundError(f"{self.path}: expected the store this pickled buffer names, found nothing")
        if self._lanes.adds < state["adds"]:
            raise errors.CorruptStoreError(
                f"{self.path}: expected at least {state['adds']} steps per env (the pickled cursor), "
                f"got {self._lanes.adds}: the store is older than the pickle"
            )


class ReplayBuffer(_OnDisk, sb3_buffers.ReplayBuffer):  # type: ignore[misc, override]
    """SB3's ``ReplayBuffer`` kept in an mmbuffer store at ``path`` (the one extra
    keyword SB3's algorithms pass through ``replay_buffer_kwargs``).

    Keywords: ``path`` (required; an existing store is reopened and resumed),
    ``commit_every`` (steps, default 10,000, at most a lane) and ``commit_seconds``
    (default 30): ``add`` commits when either is reached; ``frame_stack`` (``k`` of
    the env's ``VecFrameStack``: one frame stored a step, stacks rebuilt at
    sampling, see :mod:`mmbuffer.sb3.stacks`) with ``channels_order`` (None: as
    ``VecFrameStack`` detects it); ``codec`` (``"zstd"``, ``"lz4"``, ...: the
    observation column's codec, ``mb.Column(..., codec=codec)``; None: raw);
    ``mode`` (``"a"``, default: this buffer adds; ``"r"``: a learner reading a store
    another process adds to, see :mod:`mmbuffer.sb3.follow`).
    """


class DictReplayBuffer(_OnDisk, sb3_buffers.DictReplayBuffer):  # type: ignore[misc, override]
    """SB3's ``DictReplayBuffer`` kept in an mmbuffer store: one column
    ``obs.<key>`` per observation key (keywords as :class:`ReplayBuffer`;
    ``frame_stack`` refused for now)."""

    def _frame_stack(self, k: Any, channels_order: str | None) -> FrameStack:
        raise errors.InvalidArgumentError(
            f"frame_stack: expected None for a Dict observation space, got {k!r}: DictReplayBuffer stores "
            "stacked Dict observations as given (frame_stack=None); single-frame storage is ReplayBuffer's"
        )

    def _obs_columns(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        space = self.observation_space
        if not isinstance(space, spaces.Dict):
            raise errors.InvalidArgumentError(f"observation_space: expected a gymnasium Dict space, got {space!r}")
        return {f"obs.{k}": (tuple(shape), space[k].dtype) for k, shape in self.obs_shape.items()}

    def _obs_row(self, obs: Any) -> dict[str, np.ndarray]:
        return {f"obs.{k}": np.asarray(obs[k]).reshape((self.n_envs, *shape)) for k, shape in self.obs_shape.items()}

    def _obs_value(self, got: dict[str, np.ndarray], prefix: str) -> Any:
        return {k: got[f"{prefix}obs.{k}"] for k in self.obs_shape}

    def _obs_views(self, prefix: str) -> Any:
        space = self.observation_space
        assert isinstance(space, spaces.Dict)
        return {k: ColumnView(self._lanes, f"{prefix}obs.{k}", tuple(shape), space[k].dtype) for k, shape in self.obs_shape.items()}

    def _samples(self, obs: Any, actions: np.ndarray, next_obs: Any, dones: np.ndarray, rewards: np.ndarray) -> Any:
        t = self._torch
        return DictReplayBufferSamples(
            observations={k: t(v) for k, v in obs.items()},
            actions=t(actions),
            next_observations={k: t(v) for k, v in next_obs.items()},
            dones=t(dones),
            rewards=t(rewards),
        )
