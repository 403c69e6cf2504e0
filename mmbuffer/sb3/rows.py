"""``Lanes``: the store side of the SB3 drop-in, with no SB3 import.

An SB3 replay buffer of ``buffer_size`` slots per env and ``n_envs`` envs is an
mmbuffer store of ``n_envs`` streams, each a lane of ``buffer_size`` rows:
SB3's slot ``(pos, env)`` is global row ``env * buffer_size + pos`` (a lane's
ring position is its cursor modulo the lane, as SB3's ``pos``). With frame
stacks of ``k`` (``stacks.py``) a lane has ``k - 1`` rows more, and step ``a``
of an env (``a`` from 0) is row ``env * lane + a % lane``. With a codec the lane
is rounded up to a multiple of ``CODEC_LANE`` rows (the codec's chunks divide
it); the rows past SB3's ring hold older steps, which only a prioritized buffer
(drawing store rows) may draw.

Observations are stored once. ``next_<obs>`` of a row is the following row's
observation inside an episode and the stored final observation at an episode's
end. SB3's ``add`` gives ``next_obs`` with every step, so the newest steps of
each env are *held* in memory (``block - 1`` at most, 63 by default) and written
as one ``extend`` per env when the block fills; the newest stays held until the
next ``add`` tells whether the chain goes on. A step continues its episode when
it is not ``done`` and the next step's ``obs`` equals its ``next_obs``; otherwise
(``done``, or an ``obs`` that is not the given ``next_obs``) it is written as an
episode end with ``next_obs`` as its final observation. The store's own last row
of a continuing episode has no following row yet; its ``next_obs`` is the
oldest held step's ``obs``. ``gather`` patches both from memory, so every added
transition samples with its ``next_obs``, as in SB3. ``commit`` first writes the
held steps, the newest as an episode end (truncated), so a committed store
never has an open episode and a crash loses only the steps since the last
commit. An episode is also cut (truncated) before it would outgrow its lane
(mmbuffer keeps episodes whole in a lane; SB3 does not care).

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
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import errors
from ..buffer import Buffer
from ..opening import create as create_buffer
from ..opening import open as open_buffer
from ..schema import Column, PriorityConfig

from .follow import Follower

if TYPE_CHECKING:
    from .stacks import FrameStack

__all__ = ["ATTR", "Lanes", "codec_column"]

#: the store attribute that records the SB3 layout (checked when a store is reopened)
ATTR = "sb3"
#: with a codec, lanes are a multiple of this many rows (recorded in the layout)
CODEC_LANE = 512


class Lanes:
    """``n_envs`` lanes of ``buffer_size`` rows in the store at ``path`` (created at
    the first ``add`` if missing), with the newest steps of each env held in memory
    (``block - 1`` at most; ``block`` is at least 2 and at most ``buffer_size``).

    The store is opened lazily: for writing at the first ``add`` (taking the
    store's writer lock), for reading at the first ``gather`` when nothing writes
    in this object. ``close`` commits and releases it; the object opens it again
    when used again (``__getstate__`` of the SB3 classes relies on that).
    ``read_only``: a learner's view of a store another process writes, opened at
    once and moved to its newest commit by ``follow`` (``follow.py``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        columns: Mapping[str, tuple[tuple[int, ...], str]],
        obs_columns: Sequence[str],
        *,
        buffer_size: int,
        n_envs: int,
        commit_every: int = 10_000,
        commit_seconds: float = 30.0,
        layout: Mapping[str, Any] | None = None,
        priorities: PriorityConfig | None = None,
        block: int = 64,
        stack: FrameStack | None = None,
        codec: str | None = None,
        read_only: bool = False,
    ) -> None:
        self.path = Path(path)
        self.read_only = bool(read_only)
        self.columns = {k: (tuple(s), str(np.dtype(d))) for k, (s, d) in columns.items()}
        self.obs_columns = tuple(obs_columns)
        self.buffer_size, self.n_envs = int(buffer_size), int(n_envs)
        self.commit_every = _positive("commit_every", commit_every)
        if isinstance(commit_seconds, bool) or not isinstance(commit_seconds, (int, float)) or not commit_seconds > 0:
            raise errors.InvalidArgumentError(f"commit_seconds: expected a positive number of seconds, got {commit_seconds!r}")
        self.commit_seconds = float(commit_seconds)
        self.layout = {"buffer_size": self.buffer_size, "n_envs": self.n_envs, **(layout or {})}
        # frame stacks (stacks.py): the obs column holds single frames, and each lane keeps
        # k - 1 rows more than SB3's ring so that the oldest slot still has its older frames
        self.stack = stack
        self.lane = self.buffer_size + (0 if stack is None else stack.k - 1)
        if stack is not None:
            self.layout.update(frame_stack=stack.k, channels_order=stack.order)
        # the observation columns' codec (``codec_column``), recorded in the layout when set
        self.specs: dict[str, Any] = dict(self.columns)
        if codec is not None:
            self.specs.update({c: codec_column(self.columns[c], codec) for c in self.obs_columns})
            # a codec's chunks and shards divide the lane: a lane of buffer_size + k - 1 rows
            # (often prime-like) would make them one row each, so it is rounded up
            self.lane = -(-self.lane // CODEC_LANE) * CODEC_LANE
            self.layout.update(codec=codec, lane=self.lane)
        self.priorities = priorities
        self._buf: Buffer | None = None
        # the newest steps, held in memory: column -> [block, n_envs, ...], obs column -> its next_obs
        self.block = max(2, min(_positive("block", block), self.buffer_size))
        self._pend: dict[str, np.ndarray] = {}
        self._pend_next: dict[str, np.ndarray] = {}
        self._h = 0  # steps held (per env)
        self._open_len = np.zeros(self.n_envs, dtype=np.int64)  # rows of each lane's open episode
        self._since = 0  # adds since the last commit
        self._last_commit = time.monotonic()
        self.adds = 0  # steps added per env, over the store's life
        if self.read_only:  # a learner following another process's commits (follow.py)
            self._follower = Follower(self.path)
            self._buf = open_buffer(self.path, mode="r")  # StoreNotFoundError when missing
            try:
                self.adds = self._check(self._buf)
            except BaseException:
                self._release()
                raise
        elif self.path.exists():
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
        if self.read_only:
            raise errors.ReadOnlyError(f"{self.path}: opened with mode='r' (a learner reading another process's store): nothing is written")
        self._release()
        if not self.path.exists():
            self._buf = create_buffer(
                self.path, self.specs, self.lane * self.n_envs, num_streams=self.n_envs,
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
            if self._check(buf) != self.adds - self._h:
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

    def follow(self, force: bool = False) -> bool:
        """A reader (``read_only``): move ``adds`` to the writer's newest commit when one
        may have landed (``follow.Follower``; ``force``: reload now). Return whether ``adds``
        changed. The lanes' committed steps are equal after every commit of an SB3 buffer;
        were they not, the smallest is followed (the others' newer steps are not drawn)."""
        if not self.read_only:
            return False
        fresh = self._buf is None
        buf = self.reader()
        if not (fresh or force or self._follower.due()):
            return False
        if not fresh:
            buf.refresh()
        before, self.adds = self.adds, int(buf.view().written.min())
        return self.adds != before

    def _release(self) -> None:
        if self._buf is not None:
            buf, self._buf = self._buf, None
            buf.close()

    # -- writing -------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Steps per env held in memory, not yet in the store."""
        return self._h

    def add(self, row: Mapping[str, np.ndarray], next_obs: Mapping[str, np.ndarray]) -> None:
        """One step of every env: ``row`` column -> ``[n_envs, ...]`` (``done``,
        ``timeout`` included), ``next_obs`` obs column -> ``[n_envs, ...]``."""
        self.writer()
        self._allocate()
        h = self._h
        for c in self.columns:
            self._pend[c][h] = row[c]  # cast to the stored dtype: compared as stored
        for c in self.obs_columns:
            self._pend_next[c][h] = next_obs[c]
        self._h += 1
        self.adds += 1
        if self._h == self.block:
            self._write(self._h - 1)  # the newest step stays held: its episode may go on
        self._since += 1
        if self._since >= min(self.commit_every, self.buffer_size) or time.monotonic() - self._last_commit >= self.commit_seconds:
            self.commit()

    def _allocate(self) -> None:
        if not self._pend:
            shape = (self.block, self.n_envs)
            self._pend = {c: np.zeros(shape + s, dtype=d) for c, (s, d) in self.columns.items()}
            self._pend_next = {c: np.zeros(shape + self.columns[c][0], dtype=self.columns[c][1]) for c in self.obs_columns}

    def _write(self, m: int) -> None:
        """Write the oldest ``m`` held steps of every env (one ``extend`` per env): a
        step continues its episode when it is not done and the next held step's
        ``obs`` is its ``next_obs`` (and the episode fits the lane), else it ends
        there with its ``next_obs`` as final observation. The rest move to the front."""
        assert self._buf is not None
        if m <= 0:
            return
        pend, nxt, h = self._pend, self._pend_next, self._h
        chained = np.zeros((m, self.n_envs), dtype=bool)  # the last written step of a flush ends
        k = min(m, h - 1)
        if k > 0:
            chained[:k] = pend["done"][:k] == 0
            for c in self.obs_columns:
                same = pend[c][1 : k + 1] == nxt[c][:k]
                chained[:k] &= same.reshape(k, self.n_envs, -1).all(axis=2)
        for e in range(self.n_envs):
            ended = ~chained[:, e]
            length = int(self._open_len[e])
            for i in range(m):  # an episode never outgrows its lane (commits, every lane at most, end them first)
                length += 1
                if ended[i] or length >= self.buffer_size:
                    ended[i], length = True, 0
            self._open_len[e] = length
            terminated = ended & (pend["done"][:m, e] != 0) & (pend["timeout"][:m, e] == 0)
            for a in range(0, m, self.buffer_size):  # a block is at most a lane (buffer_size 1: 2 steps)
                b = min(a + self.buffer_size, m)
                steps = {c: pend[c][a:b, e] for c in self.columns}
                steps["terminated"], steps["truncated"] = terminated[a:b], ended[a:b] & ~terminated[a:b]
                end = ended[a:b]
                final = {c: nxt[c][a:b, e][end] for c in self.obs_columns} if end.any() else None
                self._buf.extend(steps, stream=e, final_obs=final)
        for arrays in (pend, nxt):
            for held in arrays.values():
                held[: h - m] = held[m:h]
        self._h = h - m

    def set_held_done(self, value: float) -> None:
        """Set ``done`` of the newest step of every env (SB3's ``dones[pos - 1] = True``)."""
        if self.read_only:
            raise errors.ReadOnlyError(f"dones: {self.path} is opened with mode='r' (a learner reading another process's store)")
        if self._h == 0:
            raise errors.InvalidArgumentError("dones: expected a newest step held in memory to mark done, got none")
        self._pend["done"][self._h - 1] = value

    def flush(self) -> None:
        """Write every held step; the newest ends its episode (its ``next_obs`` as final)."""
        if self._h:
            self.writer()
            self._write(self._h)

    def commit(self) -> int:
        """``flush``, then commit the store; return its generation (0: nothing written yet)."""
        self._since, self._last_commit = 0, time.monotonic()
        if self._h == 0 and (self._buf is None or self._buf.mode != "a"):
            return 0 if self._buf is None else self._buf.generation
        self.flush()
        return self.writer().commit()

    def close(self) -> None:
        """``commit`` (when writing) and release the store; using the object again reopens it."""
        if self._h or (self._buf is not None and self._buf.mode == "a"):
            self.commit()
        self._release()

    # -- reading -------------------------------------------------------------------------
    def steps_at(self, slots: np.ndarray) -> np.ndarray:
        """The step (per env, from 0) now at each SB3 slot: the newest ``a < adds``
        with ``a % buffer_size == slot`` (negative for slots not written yet)."""
        return self.adds - 1 - (self.adds - 1 - np.asarray(slots, dtype=np.int64)) % self.buffer_size

    def gather(self, envs: np.ndarray, slots: np.ndarray, keys: Sequence[str], held: bool = True) -> dict[str, np.ndarray]:
        """Rows at SB3 slots ``(slots, envs)`` as ``{key: numpy [B, ...]}`` (keys: columns
        and ``next_<obs column>``), held steps and the open rows' ``next_obs`` from memory
        (``held=False``: the store's rows as they are, for rows a store sampler drew).
        With frame stacks, ``obs`` and ``next_obs`` are stacked as SB3's ``VecFrameStack``."""
        return self.gather_steps(np.asarray(envs, dtype=np.int64), self.steps_at(slots), keys, held)

    def gather_steps(self, envs: np.ndarray, steps: np.ndarray, keys: Sequence[str], held: bool = True) -> dict[str, np.ndarray]:
        """``gather`` by step number (``steps_at``; a store row ``r`` is step
        ``rows_steps(r)``) rather than SB3 slot."""
        envs, steps = np.asarray(envs, dtype=np.int64), np.asarray(steps, dtype=np.int64)
        fs = self.stack
        if fs is None:
            return self._raw(envs, steps, keys, held)
        col = self.obs_columns[0]
        stacked = [k for k in keys if k in (col, f"next_{col}")]
        plain = [k for k in keys if k not in stacked]
        if not stacked:
            return self._raw(envs, steps, plain, held)
        extra = [k for k in ("depth", f"next_{col}") if k not in plain]
        out = self._raw(envs, steps, [*plain, *extra], held)
        depth = out["depth"].astype(np.int64)
        following = out[f"next_{col}"]
        for k in extra:
            del out[k]
        want = steps[:, None] + np.arange(1 - fs.k, 1, dtype=np.int64)  # oldest first
        low = (steps - depth)[:, None]
        frames = self._raw(envs[:, None], np.maximum(want, low), [col], held)[col]
        frames[want < low] = 0  # before the episode's first step: zeros, as VecFrameStack
        if col in keys:
            out[col] = fs.assemble(frames)
        if f"next_{col}" in keys:
            out[f"next_{col}"] = fs.assemble(np.concatenate([frames[:, 1:], following[:, None]], axis=1))
        return out

    def rows_steps(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(envs, steps)`` of global store rows (rows the store holds now)."""
        rows = np.asarray(rows, dtype=np.int64)
        envs, at = rows // self.lane, rows % self.lane
        written = self.adds - self._h  # steps in the store, per env
        return envs, written - 1 - (written - 1 - at) % self.lane

    def _raw(self, envs: np.ndarray, steps: np.ndarray, keys: Sequence[str], held: bool) -> dict[str, np.ndarray]:
        """The stored columns at ``(envs, steps)`` (broadcast, any shape), held steps
        patched from memory unless ``held`` is False."""
        envs, steps = np.broadcast_arrays(envs, steps)
        shape = steps.shape
        envs, steps = envs.reshape(-1), steps.reshape(-1)
        rows = envs * self.lane + steps % self.lane
        out = {k: v.numpy().reshape(len(rows), *v.shape[1:]) for k, v in self.reader().get(rows, keys).items()}
        h = self._h
        if h and held:
            pend, nxt = self._pend, self._pend_next
            last = self.adds - h - 1  # the lanes' last stored step, continuing into the held ones if open
            if last >= 0:
                m = (steps == last) & (self._open_len[envs] > 0)
                if m.any():
                    for c in self.obs_columns:
                        if f"next_{c}" in out:
                            out[f"next_{c}"][m] = pend[c][0, envs[m]]
            j = steps - (self.adds - h)  # the held step, if any
            m = j >= 0
            if m.any():
                for k in out:
                    src = nxt[k[5:]] if k.startswith("next_") else pend[k]
                    out[k][m] = src[j[m], envs[m]]
        return {k: v.reshape(*shape, *v.shape[1:]) for k, v in out.items()}


def codec_column(column: tuple[tuple[int, ...], str], codec: Any) -> Any:
    """``mb.Column(shape, dtype, codec=codec)``; ``InvalidArgumentError`` naming ``codec``
    when it is not a name (the core checks the name itself at create).

    >>> codec_column(((84, 84), "uint8"), "zstd").codec
    'zstd'
    """
    if not isinstance(codec, str):
        raise errors.InvalidArgumentError(f"codec: expected a codec name such as 'zstd' or 'lz4', got {codec!r}")
    return Column(column[0], column[1], codec=codec)


def _positive(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise errors.InvalidArgumentError(f"{what}: expected a positive integer, got {value!r}")
    return int(value)
