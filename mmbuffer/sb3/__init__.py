"""Stable-Baselines3 replay buffers kept on disk in an mmbuffer store (extra ``sb3``).

The one-line change, for DQN, SAC, TD3, DDPG (any SB3 off-policy algorithm)::

    model = DQN("MlpPolicy", env, replay_buffer_class=mmbuffer.sb3.ReplayBuffer,
                replay_buffer_kwargs={"path": "runs/replay"})

(``mmbuffer.sb3.DictReplayBuffer`` for Dict observation spaces.) They are SB3's
``ReplayBuffer`` / ``DictReplayBuffer`` (``isinstance`` holds, so
``load_replay_buffer`` accepts them) whose ``__init__`` allocates nothing in RAM:
``add``, ``sample``, ``_get_samples``, ``size()``, ``pos`` and ``full`` behave as
SB3's, and samples are SB3's ``ReplayBufferSamples`` with the same dtypes,
shapes (``rewards``/``dones`` ``[B, 1]``), device and values, ``VecNormalize``
applied at sampling when ``env`` is given; ``n_envs`` envs are ``n_envs`` streams.

What is kept on disk, at ``path``: one lane of ``buffer_size // n_envs`` rows per
env, SB3's slot ``(pos, env)`` at row ``env * lane + pos``; columns ``obs``
(``obs.<key>`` for Dict spaces, the observation space's dtype), ``action`` (SB3's
dtype, float64 cast to float32), ``reward``, ``done`` and ``timeout``
(``infos[i]["TimeLimit.truncated"]`` when ``handle_timeout_termination``, float32 as SB3;
samples' ``dones = done * (1 - timeout)``). Observations are stored once:
``next_obs`` is the following row's ``obs`` inside an episode and a stored final
observation at its end (SB3's ``_store_transition`` puts the true terminal
observation in ``next_obs``). The newest steps of each env (63 at most) are
held in memory and written as one block; the newest stays until the next
``add`` shows whether its episode goes on. Sampling reads held steps from
memory, so every added step samples with its ``next_obs``. In RAM: those steps
only (``optimize_memory_usage`` is accepted and changes nothing), and with a codec
the core's decoded-chunk cache (``MMBUFFER_DECODE_CACHE_BYTES``, 256 MiB per
column by default; docs/format.md). SB3's arrays
(``observations``, ``next_observations``, ``actions``, ``rewards``, ``dones``,
``timeouts``) are read-only views of the store (:mod:`mmbuffer.sb3.views`).

Commits. SB3 never commits, so ``add`` commits every ``commit_every`` steps
(default 10,000, at most a lane) or ``commit_seconds`` (default 30 s); a crash
loses at most the steps since the last commit. A commit syncs the rows written
since the last one to disk (msync per column and env): more frequent commits
cost more per step. ``close()`` commits and releases
the store's writer lock.

Resuming. ``model.save_replay_buffer(file)`` pickles only the path, the cursor and
the spaces (kilobytes): it commits and closes the store, and the buffer reopens it
when used again. ``load_replay_buffer(file)`` reopens the same store, in the same
process too (the store is opened for reading at the first sample and for writing
at the first ``add``; only one buffer at a time may add to a store). A new
process may also just pass the same ``path``: an existing store is reopened,
checked against the spaces and sizes (``SchemaError`` if they differ), and
training resumes at its cursor.

A learner in another process: ``replay_buffer_kwargs={"path": ..., "mode": "r"}``
opens the store another process's buffer adds to, read-only (``add`` is
``ReadOnlyError``); ``sample``, ``size()``, ``pos`` and ``full`` follow that
writer's commits, and sampling never returns an uncommitted or torn row (the rule:
:mod:`mmbuffer.sb3.follow`).

Prioritized replay: ``PrioritizedReplayBuffer`` with ``PrioritizedDQN`` (SB3's DQN
feeding TD errors back), see :mod:`mmbuffer.sb3.prioritized`.

Frame stacks. For an env wrapped in ``VecFrameStack(venv, k)`` (Atari:
``DQN("CnnPolicy", VecFrameStack(venv, 4), ...)``), ``replay_buffer_kwargs=
{"path": ..., "frame_stack": k}`` stores only the newest frame of each step (the
``obs`` column is the single frame, plus a uint8 ``depth``) and rebuilds SB3's
stacks at sampling, zeros before an episode's first step, bit-identical to SB3's
buffer fed the same stacked transitions; the stack axis is found as
``VecFrameStack`` finds it (``channels_order="first"``/``"last"`` when both
axes fit; ``VecTransposeImage``'s channels-first stacks too). Every ``add``
checks that the older frames of ``obs`` are what the store rebuilds and that
``next_obs`` shifts the stack by one; a mismatch raises ``InvalidArgumentError``
naming ``frame_stack``, before anything is written (:mod:`mmbuffer.sb3.stacks`).
``DictReplayBuffer`` refuses ``frame_stack`` for now.

Codecs. ``replay_buffer_kwargs={"path": ..., "frame_stack": 4, "codec": "zstd"}``
stores the observation column (``obs``, or every ``obs.<key>``) with that codec,
``mb.Column(shape, dtype, codec="zstd")``; the other columns stay raw. The codec
is part of the store's recorded layout: reopening with another one is a
``SchemaError``. With a codec each env's lane is rounded up to a multiple of 512
rows (the codec's chunks and shards divide a lane; ``buffer_size + k - 1`` rows
would make them one row each): up to 511 older steps more per env on disk, which
a ``PrioritizedReplayBuffer`` may also draw. A codec that is not a name is refused
with ``InvalidArgumentError`` naming ``codec`` at construction; an unknown name
(``"zstd"``, ``"zstd:<level 1-22>"`` and ``"lz4"`` are known) with ``SchemaError``
naming the column and ``codec`` at the first ``add``, which creates the store; a
refused create leaves nothing on disk.

>>> import tempfile, gymnasium as gym
>>> from stable_baselines3 import DQN
>>> import mmbuffer.sb3
>>> path = tempfile.mkdtemp() + "/replay"
>>> model = DQN("MlpPolicy", gym.make("CartPole-v1"), learning_starts=50, buffer_size=1000,
...             replay_buffer_class=mmbuffer.sb3.ReplayBuffer, replay_buffer_kwargs={"path": path})
>>> _ = model.learn(100)
>>> model.replay_buffer.size()
100
>>> model.replay_buffer.close()
"""

from .prioritized import PrioritizedDQN, PrioritizedReplayBuffer, PrioritizedReplayBufferSamples
from .replay import DictReplayBuffer, ReplayBuffer

__all__ = ["DictReplayBuffer", "PrioritizedDQN", "PrioritizedReplayBuffer", "PrioritizedReplayBufferSamples", "ReplayBuffer"]
