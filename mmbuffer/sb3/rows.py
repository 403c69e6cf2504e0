"""``Lanes``: the store side of the SB3 drop-in, with no SB3 import.

An SB3 replay buffer of ``buffer_size`` slots per env and ``n_envs`` envs is an
mmbuffer store of ``n_envs`` streams, each a lane of ``buffer_size`` rows:
SB3's slot ``(pos, env)`` is global row ``env * buffer_size + pos`` (a lane's
ring position is its cursor modulo the lane, as SB3's ``pos``).

Observations are stored once. ``next_<obs>`` of a row is the following row's
observation inside an episode and the stored final observation at an episode's
end. SB3's ``add`` gives ``next_obs`` with every step, so the newest step of each
env is *held* in memory until the next ``add`` tells whether the chain goes on
(the new ``obs`` equals the held ``next_obs`` and the step was not ``done``: the
row is written as a continuing row) or breaks (``done``, or an ``obs`` that is
not the held ``next_obs``: written as an episode end with ``next_obs`` as its
final observation). The store's own last row of a continuing episode has no
following row yet; its ``next_obs`` is the held row's ``obs``. ``gather`` patches
both from memory, so every added transition samples with its ``next_obs``, as in
SB3. ``commit`` first writes the held rows as episode ends (truncated), so a
committed store never has an open episode and a crash loses only the rows
since the last commit. An episode is also cut (truncated) before it would
outgrow its lane (mmbuffer keeps episodes whole in a lane; SB3 does not care).

SB3's own ``done`` and ``TimeLimit.truncated`` are stored as columns ``done``
and ``timeout`` (float32, as SB3 keeps them), so the samples' ``dones`` are
bit-identical to SB3's whatever the episode cuts above.

>>> import tempfile, numpy as np
>>> cols = {"obs": ((2,), "float32"), "action": ((1,), "int64"), "reward": ((), "float32"),
...         "done": ((), "float32"), "timeout": ((), "float32")}
>>> lanes = Lanes(tempfile.mkdtemp() + "/r", cols, ("obs",), buffer_size=8, n_envs=1)
>>> for t in range(3):
...     row = {"obs": np.full((1, 2), t, np.float32), "action": np.zeros((1, 1), np.int64),
...            "reward": np.ones(1, np.float32), "done": np.zeros(1, np.float32),
...            "timeout": np.zeros(1, np.float32)}
...     lanes.add(row, {"obs": np.full((1, 2), t + 1, np.float32)})
>>> lanes.gather(np.zeros(3, np.int64), np.arange(3), ["next_obs"])["next_obs"][:, 0].tolist()
[1.0, 2.0, 3.0]
>>> lanes.close()
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import errors
from ..buffer import Buffer
from ..opening import create as create_buffer
from ..opening import open as open_buffer
from ..schema import PriorityConfig

__all__ = ["ATTR", "Lanes"]

#: the store attribute that records the SB3 layout (checked when a store is reopened)
ATTR = "sb3"


class Lanes:
    """``n_envs`` lanes of ``buffer_size`` rows in the store at ``path`` (created at
    the first ``add`` if missing), with the newest step of each env held in memory.

    The store is opened lazily: for writing at the first ``add`` (taking the
    store's writer lock), for reading at the first ``gather`` when nothing writes
    in this object. ``close`` commits and releases it; the object opens it again
    when used again (``__getstate__`` of the SB3 classes relies on that).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        columns: Mapping[str, tuple[tuple[int, ...], str]],
        obs_columns: Sequence[str],
        *,
        buffer_size: int,
        n_envs: int,
        commit_every: int = 1000,
        commit_seconds: float = 30.0,
        layout: Mapping[str, Any] | None = None,
        priorities: PriorityConfig | None = None,
    ) -> None:
        self.path = Path(path)
        self.columns = {k: (tuple(s), str(np.dtype(d))) for k, (s, d) in columns.items()}
        self.obs_columns = tuple(obs_columns)
        self.buffer_size, self.n_envs = int(buffer_size), int(n_envs)
        self.commit_every = _positive("commit_every", commit_every)
        if isinstance(commit_seconds, bool) or not isinstance(commit_seconds, (int, float)) or not commit_seconds > 0:
            raise errors.InvalidArgumentError(f"commit_seconds: expected a positive number of seconds, got {commit_seconds!r}")
        self.commit_seconds = float(commit_seconds)
        self.layout = {"buffer_size": self.buffer_size, "n_envs": self.n_envs, **(layout or {})}
        self.priorities = priorities
        self._buf: Buffer | None = None
        self._held: dict[str, np.ndarray] | None = None  # column -> [n_envs, ...]: the newest step
        self._held_next: dict[str, np.ndarray] = {}  # obs column -> [n_envs, ...]: its next_obs
        self._open_len = np.zeros(self.n_envs, dtype=np.int64)  # rows of each lane's open episode
        self._since = 0  # adds since the last commit
        self._last_commit = time.monotonic()
        self.adds = 0  # steps added per env, over the store's life
        if self.path.exists():
            with open_buffer(self.path, mode="r") as buf:
                self.adds = self._check(buf)

    # -- the store -----------------------------------------------------------------------
    def _check(self, buf: Buffer) -> int:
        """Refuse a store of another layout; return its steps per env."""
        have = {
            k: (tuple(c.shape), str(np.dtype(c.dtype))) for k, c in buf.columns.items() if k not in ("terminated", "truncated")
        }
        if have != self.columns or tuple(sorted(buf.next_keys)) != tuple(sorted(self.obs_columns)):
            raise errors.SchemaError(f"{self.path}: expected columns {self.columns}, got {have} (another env or action space?)")
        if buf.priorities != self.priorities:
            raise errors.SchemaError(f"{self.path}: expected priorities {self.priorities}, got {buf.priorities}")
        stored = buf.attrs.get(ATTR)
        if stored != self.layout:
            raise errors.SchemaError(f"{self.path}: expected a store with {ATTR} layout {self.layout}, got {stored}")
        written = buf.view().written
        if len(set(int(w) for w in written)) != 1:
            raise errors.CorruptStoreError(f"{self.path}: expected the same rows in every env's lane, got {written.tolist()}")
        return int(written[0])

    def writer(self) -> Buffer:
        """The store opened for writing (created when missing)."""
        if self._buf is not None and self._buf.mode == "a":
            return self._buf
        self._release()
        if not self.path.exists():
            self._buf = create_buffer(
                self.path, self.columns, self.buffer_size * self.n_envs, num_streams=self.n_envs,
                next_keys=self.obs_columns, attrs={ATTR: self.layout}, priorities=self.priorities,
            )
            return self._buf
        try:
            buf = open_buffer(self.path, mode="a")
        except errors.LockedError as exc:
            raise errors.LockedError(
                f"{exc}; another mmbuffer.sb3 buffer (say the one load_replay_buffer made) writes "
                f"{self.path}: only one replay buffer can add to a store"
            ) from None
        try:
            if self._check(buf) != self.adds - (self._held is not None):
                raise errors.CorruptStoreError(
                    f"{self.path}: expected {self.adds} steps per env (this buffer's cursor), got "
                    f"{int(buf.view().written[0])}: another buffer wrote to the store meanwhile"
                )
        except BaseException:
            buf.close()
            raise
        self._buf = buf
        return buf

    def reader(self) -> Buffer:
        """The store as this object has it open, or opened for reading."""
        if self._buf is None:
            if not self.path.exists():
                raise errors.EmptyBufferError(f"{self.path}: expected a store, got none yet (the first add creates it)")
            self._buf = open_buffer(self.path, mode="r")
        return self._buf

    def _release(self) -> None:
        if self._buf is not None:
            buf, self._buf = self._buf, None
            buf.close()

    # -- writing -------------------------------------------------------------------------
    def add(self, row: Mapping[str, np.ndarray], next_obs: Mapping[str, np.ndarray]) -> None:
        """One step of every env: ``row`` column -> ``[n_envs, ...]`` (``done``,
        ``timeout`` included), ``next_obs`` obs column -> ``[n_envs, ...]``."""
        self.writer()
        row = {c: np.asarray(row[c], dtype=self.columns[c][1]) for c in self.columns}  # compared as stored
        if self._held is not None:
            for e in range(self.n_envs):
                chained = not self._held["done"][e] and all(
                    np.array_equal(row[c][e], self._held_next[c][e]) for c in self.obs_columns
                )
                self._write(e, chained)
        self._held = {c: np.array(row[c], copy=True) for c in self.columns}
        self._held_next = {c: np.array(next_obs[c], dtype=self.columns[c][1], copy=True) for c in self.obs_columns}
        self.adds += 1
        self._since += 1
        if self._since >= min(self.commit_every, self.buffer_size) or time.monotonic() - self._last_commit >= self.commit_seconds:
            self.commit()

    def _write(self, e: int, chained: bool) -> None:
        """Write env ``e``'s held row to its lane: continuing when ``chained`` (and its
        episode fits the lane), else as an episode end with its ``next_obs`` as final."""
        assert self._held is not None and self._buf is not None
        held = self._held
        ended = not chained or self._open_len[e] + 1 >= self.buffer_size
        steps = {c: held[c][e : e + 1] for c in self.columns}
        terminated = ended and bool(held["done"][e]) and not held["timeout"][e]
        steps["terminated"], steps["truncated"] = np.array([terminated]), np.array([ended and not terminated])
        final = {c: self._held_next[c][e : e + 1] for c in self.obs_columns} if ended else None
        self._buf.extend(steps, stream=e, final_obs=final)
        self._open_len[e] = 0 if ended else self._open_len[e] + 1

    def set_held_done(self, value: float) -> None:
        """Set ``done`` of the newest step of every env (SB3's ``dones[pos - 1] = True``)."""
        if self._held is None:
            raise errors.InvalidArgumentError("dones: expected a newest step held in memory to mark done, got none")
        self._held["done"][:] = value

    def flush(self) -> None:
        """Write the held rows as episode ends (their ``next_obs`` as final observation)."""
        if self._held is not None:
            self.writer()
            for e in range(self.n_envs):
                self._write(e, False)
            self._held, self._held_next = None, {}

    def commit(self) -> int:
        """``flush``, then commit the store; return its generation (0: nothing written yet)."""
        self._since, self._last_commit = 0, time.monotonic()
        if self._held is None and (self._buf is None or self._buf.mode != "a"):
            return 0 if self._buf is None else self._buf.generation
        self.flush()
        return self.writer().commit()

    def close(self) -> None:
        """``commit`` (when writing) and release the store; using the object again reopens it."""
        if self._held is not None or (self._buf is not None and self._buf.mode == "a"):
            self.commit()
        self._release()

    # -- reading -------------------------------------------------------------------------
    def gather(self, envs: np.ndarray, slots: np.ndarray, keys: Sequence[str], held: bool = True) -> dict[str, np.ndarray]:
        """Rows at SB3 slots ``(slots, envs)`` as ``{key: numpy [B, ...]}`` (keys: columns
        and ``next_<obs column>``), held rows and the open rows' ``next_obs`` from memory
        (``held=False``: the store's rows as they are, for rows a store sampler drew)."""
        envs, slots = np.asarray(envs, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        rows = envs * self.buffer_size + slots
        out = {k: v.numpy() for k, v in self.reader().get(rows, keys).items()}
        if self._held is None or self.adds == 0 or not held:
            return out
        rows_held, n = self._held, self.buffer_size
        if self.adds >= 2:  # the lanes' last stored rows, continuing into the held rows
            m = (slots == (self.adds - 2) % n) & (self._open_len[envs] > 0)
            if m.any():
                for c in self.obs_columns:
                    if f"next_{c}" in out:
                        out[f"next_{c}"][m] = rows_held[c][envs[m]]
        m = slots == (self.adds - 1) % n  # the held rows themselves
        if m.any():
            for k in out:
                src = self._held_next[k[5:]] if k.startswith("next_") else rows_held[k]
                out[k][m] = src[envs[m]]
        return out


def _positive(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise errors.InvalidArgumentError(f"{what}: expected a positive integer, got {value!r}")
    return int(value)
