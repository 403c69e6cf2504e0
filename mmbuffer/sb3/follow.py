"""A learner in another process: an SB3 buffer reading a store that an actor writes (``mode="r"``).

``replay_buffer_kwargs={"path": path, "mode": "r"}`` (or ``ReplayBuffer(..., path=path,
mode="r")``) opens the store another process's buffer adds to, read-only: no writer
lock is taken, and ``add`` (like ``update_priorities``, ``commit``-ing held steps,
SB3's ``dones[pos - 1] = True``) raises ``ReadOnlyError`` before anything changes.
The store must exist (``StoreNotFoundError`` otherwise: the actor's first ``add``
creates it) and have the layout the arguments give (``SchemaError``).

Following the writer. ``sample``, ``_get_samples``, ``size()``, ``pos`` and ``full``
first move the buffer to the writer's newest commit: one ``stat`` of the store's
``manifest.json`` (a commit replaces that file), and only when it changed, or a
second passed (``RECHECK_SECONDS``), the last commit is reloaded (``Buffer.refresh``:
a manifest read) and ``pos``/``full`` become the committed steps'. Steps the actor
added since its last commit are not seen (they are not durable yet); the actor's
buffer commits every ``commit_every`` steps or ``commit_seconds``.

Never a torn row. The actor's ring overwrites committed steps before its next
commit, so the rule of the core's readers (``mmbuffer._read.recheck``) applies: the
writer raises ``index/reserved`` past a row before it writes it, so step ``a`` of an
env (its absolute row in the env's lane) is intact exactly while ``a >=
reserved[env] - lane``; a transition reads step ``a`` and younger rows (``next_obs``),
a frame stack also its ``k - 1`` older steps, so it is checked at ``a - (k - 1)``.
``sample`` draws SB3's way (a slot below ``size()``, then an env, ``np.random``); a
draw that is not intact is drawn again uniformly among the committed steps that are
(so a sample is uniform over the committed, intact steps: all of them until the
actor's ring wraps, then all but the oldest ones the writer has reserved since its
last commit: about the steps it added since, plus up to a sixteenth of a lane). After the copy every item is checked again against the reservation
as it stands then; an item the writer may have begun rewriting meanwhile is drawn
and read again. ``_get_samples(batch_inds, env_indices)`` with the caller's slots
refuses a slot whose rows are being rewritten (before or after the copy) with
``RowNotLiveError``. When no committed step is intact (the actor wrote a whole ring
since its last commit, ``commit_every`` too large for ``buffer_size``),
``EmptyBufferError``. A ``PrioritizedReplayBuffer`` opened so draws from the
priorities the actor wrote, with the same checks (``update_priorities`` is the
writer's). The arrays (``rb.observations[...]``, :mod:`mmbuffer.sb3.views`) of a
reader read the committed rows as they are, with no re-check: inspect them, sample
with ``sample``.

>>> import tempfile, numpy as np
>>> from gymnasium import spaces
>>> from mmbuffer.sb3 import ReplayBuffer
>>> path, box = tempfile.mkdtemp() + "/replay", spaces.Box(-9, 9, (2,))
>>> actor = ReplayBuffer(100, box, spaces.Discrete(2), device="cpu", path=path, commit_every=4)
>>> def step(t):
...     actor.add(np.full((1, 2), t, np.float32), np.full((1, 2), t + 1, np.float32), np.array([t % 2]),
...               np.array([float(t)]), np.array([False]), [{}])
>>> for t in range(4):
...     step(t)
>>> learner = ReplayBuffer(100, box, spaces.Discrete(2), device="cpu", path=path, mode="r")
>>> learner.size(), learner.sample(8).rewards.max().item() <= 3
(4, True)
>>> for t in range(4, 10):
...     step(t)
>>> learner.size()  # the actor committed at 8 steps; 9 and 10 are not committed yet
8
>>> actor.close(); learner.close()
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .. import errors
from ..buffer import Buffer

__all__ = ["Follower", "RECHECK_SECONDS", "draw_intact", "read_intact"]

#: a reader reloads the last commit at least this often, even when ``manifest.json``'s stat is unchanged
RECHECK_SECONDS = 1.0
#: reads of a batch in a row whose items the writer laps before ``EmptyBufferError``
MAX_REREADS = 64

#: what ``read_intact`` keeps per batch item: ``envs`` and ``steps`` (int64), and any other arrays a redraw returns
Items = dict[str, np.ndarray]


class Follower:
    """Whether the store at ``path`` may have a new commit: its ``manifest.json`` was
    replaced since the last ``due()`` that said so, or ``RECHECK_SECONDS`` passed."""

    def __init__(self, path: Path) -> None:
        self._file = path / "manifest.json"
        self._key: tuple[int, ...] | None = None
        self._at = 0.0
        self.due()

    def due(self) -> bool:
        try:
            st = os.stat(self._file)
            key: tuple[int, ...] = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        except OSError:
            key = ()
        now = time.monotonic()
        if key == self._key and now - self._at < RECHECK_SECONDS:
            return False
        self._key, self._at = key, now
        return True


def span(stack_k: int | None) -> int:
    """Older steps an item reads besides its own: ``k - 1`` with frame stacks of ``k``."""
    return 0 if stack_k is None else stack_k - 1


def intact(envs: np.ndarray, steps: np.ndarray, reserved: np.ndarray, lane: int, older: int) -> np.ndarray:
    """Which items (env, step) the writer cannot be rewriting, by ``reserved``: the oldest
    step each reads, ``step - older``, is at or above ``reserved[env] - lane`` (and the
    step was written: a slot past ``size()`` is not a step)."""
    ok: np.ndarray = (steps >= 0) & (steps - older >= reserved[envs] - lane)
    return ok


def draw_intact(n: int, adds: int, buffer_size: int, reserved: np.ndarray, lane: int, older: int) -> Items | None:
    """``n`` (env, step) drawn uniformly (``np.random``) among the committed steps (the
    newest ``buffer_size`` of ``adds`` per env) that are intact by ``reserved``; None
    when there is none."""
    lo = np.maximum(adds - min(adds, buffer_size), reserved - lane + older)
    counts = np.maximum(adds - lo, 0)
    total = int(counts.sum())
    if total == 0:
        return None
    u = np.random.randint(0, total, size=n).astype(np.int64)
    cum = np.cumsum(counts)
    envs = np.searchsorted(cum, u, side="right").astype(np.int64)
    return {"envs": envs, "steps": lo[envs] + u - (cum[envs] - counts[envs])}


def read_intact(
    buf: Buffer,
    items: Items,
    gather: Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]],
    lane: int,
    older: int,
    redraw: Callable[[int, np.ndarray], Items | None] | None,
) -> tuple[dict[str, np.ndarray], Items]:
    """``gather(envs, steps)`` of every item, checked against the writer's reservation
    before and after the copy (module docstring). ``redraw(m, reserved)`` gives ``m``
    fresh items for those that fail (None: nothing intact left, ``EmptyBufferError``);
    without it a failing item is ``RowNotLiveError``. Returns the data and the items
    as finally read."""
    out: dict[str, np.ndarray] | None = None
    todo = np.arange(len(items["steps"]))
    for _ in range(MAX_REREADS):
        bad = ~intact(items["envs"][todo], items["steps"][todo], buf.reservation(), lane, older)
        if bad.any():
            _replace(items, todo[bad], redraw, buf)
        got = gather(items["envs"][todo], items["steps"][todo])
        if out is None:
            out = got
        else:
            for k, v in got.items():
                out[k][todo] = v
        todo = todo[~intact(items["envs"][todo], items["steps"][todo], buf.reservation(), lane, older)]
        if not len(todo):
            return out, items
    raise errors.EmptyBufferError(
        f"sample: expected rows that stay put while they are read, got rows overwritten by the writer in "
        f"{MAX_REREADS} reads in a row (the writer laps {buf.path} faster than a batch is read)"
    )


def _replace(items: Items, at: np.ndarray, redraw: Callable[[int, np.ndarray], Items | None] | None, buf: Buffer) -> None:
    if redraw is None:
        bad = sorted({(int(e), int(s)) for e, s in zip(items["envs"][at][:4], items["steps"][at][:4])})
        raise errors.RowNotLiveError(
            f"batch_inds: expected slots whose rows the writer of {buf.path} is not rewriting, got {len(at)} that are "
            f"(env, step) {bad}: sample() draws those again; the oldest slots, just past pos, are reserved by the writer"
        )
    fresh = redraw(len(at), buf.reservation())
    if fresh is None:
        raise errors.EmptyBufferError(
            f"sample: expected committed steps in {buf.path} that the writer is not rewriting, got none: it wrote "
            "a whole ring since its last commit (commit more often: commit_every below buffer_size)"
        )
    for k, v in fresh.items():
        items[k][at] = v

