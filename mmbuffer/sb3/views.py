"""``ColumnView``: SB3's buffer arrays (``observations``, ``actions``, ``rewards``,
``dones``, ...) as read-only views of the store, for code that inspects them.

SB3 keeps ``[buffer_size, n_envs, ...]`` numpy arrays; the drop-in keeps none.
A view reads the store when indexed: ``view[slots, envs]`` with integer arrays
(what SB3's ``_get_samples`` does) gathers only those transitions; any other
index, and ``np.asarray(view)``, reads the whole array first (all of it in RAM:
mind the size). Slots not written yet read as zeros, as in SB3's arrays. The
only write accepted is SB3's own ``dones[pos - 1] = True`` (``_setup_learn``
with ``optimize_memory_usage``), which marks the newest step of every env done.

>>> import tempfile, numpy as np
>>> from gymnasium import spaces
>>> from mmbuffer.sb3 import ReplayBuffer
>>> rb = ReplayBuffer(10, spaces.Box(-9, 9, (2,)), spaces.Discrete(2), device="cpu", path=tempfile.mkdtemp() + "/v")
>>> for t in range(3):
...     rb.add(np.full((1, 2), t, np.float32), np.full((1, 2), t + 1, np.float32), np.array([1]),
...            np.array([0.5]), np.array([False]), [{}])
>>> rb.observations.shape, rb.rewards[:4, 0].tolist()
((10, 1, 2), [0.5, 0.5, 0.5, 0.0])
>>> rb.next_observations[np.array([2]), np.array([0])].tolist()
[[3.0, 3.0]]
>>> rb.close()
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import errors
from .rows import Lanes

__all__ = ["ColumnView"]


class ColumnView:
    """Store column ``key`` (``obs``, ``next_obs``, ``action``, ``reward``, ``done``,
    ``timeout``, ``obs.<key>``) shaped as SB3's array ``[buffer_size, n_envs, ...]``."""

    def __init__(self, lanes: Lanes, key: str, shape: tuple[int, ...], dtype: Any) -> None:
        self._lanes, self.key = lanes, key
        self.shape = (lanes.buffer_size, lanes.n_envs, *shape)
        self.dtype = np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"ColumnView({self.key!r}, shape={self.shape}, dtype={self.dtype}, store={str(self._lanes.path)!r})"

    def _read(self, slots: np.ndarray, envs: np.ndarray) -> np.ndarray:
        lanes = self._lanes
        out = np.zeros((len(slots), *self.shape[2:]), dtype=self.dtype)
        written = slots < (lanes.adds if lanes.adds < lanes.buffer_size else lanes.buffer_size)
        if written.any() and lanes.path.exists():
            got = lanes.gather(envs[written], slots[written], [self.key])[self.key]
            out[written] = got.reshape((-1, *self.shape[2:]))
        return out

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        n, e = self.shape[:2]
        slots, envs = np.repeat(np.arange(n), e), np.tile(np.arange(e), n)
        out = self._read(slots, envs).reshape(self.shape)
        return out if dtype is None else out.astype(dtype, copy=False)

    def __iter__(self) -> Any:
        return iter(np.asarray(self))  # read once (BaseBuffer.extend zips the arrays)

    def __getitem__(self, index: Any) -> np.ndarray:
        if isinstance(index, tuple) and len(index) == 2 and all(_integers(i) for i in index):
            slots, envs = np.broadcast_arrays(np.asarray(index[0]), np.asarray(index[1]))
            flat = self._read(slots.reshape(-1) % self.shape[0], envs.reshape(-1) % self.shape[1])
            return flat.reshape((*slots.shape, *self.shape[2:]))
        result: np.ndarray = np.asarray(self)[index]
        return result

    def __setitem__(self, index: Any, value: Any) -> None:
        lanes = self._lanes
        newest = (lanes.adds - 1) % lanes.buffer_size
        if self.key != "done" or not isinstance(index, (int, np.integer)) or int(index) != newest:
            raise errors.InvalidArgumentError(
                f"{self.key}: expected no write (the store is written by add) other than SB3's "
                f"dones[{newest}] = True (the newest slot), got [{index!r}]"
            )
        lanes.set_held_done(float(np.max(value)))


def _integers(index: Any) -> bool:
    arr = np.asarray(index)
    return arr.dtype.kind in "iu"
