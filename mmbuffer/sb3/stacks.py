"""``FrameStack``: observations stacked by SB3's ``VecFrameStack``, stored one frame a step.

``replay_buffer_kwargs={"path": ..., "frame_stack": k}`` for an env wrapped in
``VecFrameStack(venv, k)``: the observation space the buffer is given is the
stacked one, ``k`` frames concatenated along the channel axis (the first axis,
channels-first images; the last axis otherwise: channels-last images, vectors),
oldest first, zeros before an episode's first step. The store's ``obs`` column is
the single frame (``frame_shape``): ``add`` stores the newest frame of ``obs`` and
``next_obs`` and a column ``depth`` (uint8, ``min(steps since the episode's
first, k - 1)``: how many older frames are real), and sampling rebuilds SB3's
stacks from the frames of the same lane (``rows.Lanes`` keeps ``k - 1`` more rows
per lane than SB3's ring, so the oldest slot still has its older frames).

Stacks are cut by ``depth`` alone, not by the store's episodes: ``Lanes`` ends a
store episode at every commit and before an episode outgrows a lane, where
``VecFrameStack`` goes on stacking, so the core's episode-start padding
(``mmbuffer._read.frames``) would differ from SB3 there.

``add`` checks what it cannot store (``check``): the older ``k - 1`` frames of
``obs`` must be what the store rebuilds (the previous step's frames when the step
continues its episode: not done, and its ``next_obs``'s newest frame is this
``obs``'s newest; zeros otherwise), and the older frames of ``next_obs`` must be
``obs``'s newest ``k - 1``; a mismatch raises ``InvalidArgumentError`` naming
``frame_stack`` before anything is written. Older frames all zeros are always
accepted as a new episode (depth 0: zeros are what the store rebuilds), also with
no ``done`` before them (a fresh env after a resume).

>>> import numpy as np
>>> from gymnasium import spaces
>>> fs = FrameStack.for_space(spaces.Box(0, 255, (5, 4, 3), np.uint8), 3)  # frames (5, 4, 1), channels last
>>> fs.order, fs.frame_shape
('last', (5, 4, 1))
>>> stacked = np.arange(60, dtype=np.uint8).reshape(1, 5, 4, 3)
>>> frames = fs.split(stacked)
>>> frames.shape, bool((fs.assemble(frames) == stacked).all())
((1, 3, 5, 4, 1), True)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import errors

__all__ = ["FrameStack", "ORDERS"]

#: ``channels_order`` values, as ``VecFrameStack``'s: the stack axis is the first or the last
ORDERS = ("first", "last")


class FrameStack:
    """``k`` frames of ``frame_shape`` stacked along the first or last axis (``order``)."""

    def __init__(self, k: int, order: str, frame_shape: tuple[int, ...], dtype: Any) -> None:
        self.k, self.order, self.frame_shape, self.dtype = k, order, tuple(frame_shape), np.dtype(dtype)
        axis = 0 if order == "first" else len(frame_shape) - 1
        shape = list(frame_shape)
        shape[axis] *= k
        self.stacked_shape = tuple(shape)
        # the previous step of every env, as given (checked): frames, next_obs's newest, done, depth
        self._prev: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def for_space(cls, space: Any, k: Any, channels_order: str | None = None) -> FrameStack:
        """The stacking of ``space`` (the stacked Box ``VecFrameStack(venv, k)`` gives),
        the stack axis found as ``VecFrameStack`` finds it from the single frame's space
        (``channels_order`` given: that axis)."""
        from gymnasium import spaces
        from stable_baselines3.common.vec_env.stacked_observations import StackedObservations

        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 1:
            raise errors.InvalidArgumentError(f"frame_stack: expected an integer >= 1 (VecFrameStack's n_stack), got {k!r}")
        if channels_order is not None and channels_order not in ORDERS:
            raise errors.InvalidArgumentError(f"channels_order: expected None or one of {list(ORDERS)}, got {channels_order!r}")
        if not isinstance(space, spaces.Box) or not space.shape:
            raise errors.InvalidArgumentError(
                f"frame_stack: expected a Box observation space stacked by VecFrameStack, got {space!r}"
            )
        k, shape = int(k), tuple(space.shape)
        fits = []
        for order in ORDERS if channels_order is None else (channels_order,):
            axis = 0 if order == "first" else len(shape) - 1
            if shape[axis] % k:
                continue
            c = shape[axis] // k
            cut = (slice(0, c),) if order == "first" else (..., slice(0, c))
            frame = spaces.Box(space.low[cut], space.high[cut], dtype=space.dtype)
            first = StackedObservations.compute_stacking(k, frame, channels_order)[0]
            if first == (order == "first") or len(shape) == 1:
                fits.append((order, tuple(frame.shape)))
        if len(shape) == 1:
            fits = fits[-1:]  # one axis: first and last are the same
        if len(fits) != 1:
            got = ("both the first and the last axis fit; pass channels_order='first' or 'last' (VecFrameStack's "
                   "channels_order) in replay_buffer_kwargs") if fits else (
                   f"neither the first nor the last axis stacks {k} frames as VecFrameStack does (wrapped in "
                   f"VecFrameStack(venv, {k})? its channels_order?)")
            raise errors.InvalidArgumentError(
                f"frame_stack: expected observation_space {shape} stacked by VecFrameStack(venv, {k}) along one axis, got {got}"
            )
        return cls(k, fits[0][0], fits[0][1], space.dtype)

    # -- layout --------------------------------------------------------------------------
    def split(self, stacked: np.ndarray) -> np.ndarray:
        """``[n, *stacked_shape]`` -> ``[n, k, *frame_shape]`` (a view where it can)."""
        n, k = stacked.shape[0], self.k
        if self.order == "first":
            return stacked.reshape(n, k, *self.frame_shape)
        return np.moveaxis(stacked.reshape(n, *self.frame_shape[:-1], k, self.frame_shape[-1]), -2, 1)

    def assemble(self, frames: np.ndarray) -> np.ndarray:
        """``[B, k, *frame_shape]`` -> ``[B, *stacked_shape]`` as ``VecFrameStack`` lays it out."""
        b = frames.shape[0]
        if self.order == "first":
            return frames.reshape(b, *self.stacked_shape)
        return np.ascontiguousarray(np.moveaxis(frames, 1, -2)).reshape(b, *self.stacked_shape)

    # -- add -----------------------------------------------------------------------------
    def forget(self) -> None:
        """Drop the remembered previous step (``load`` reads it from the store again)."""
        self._prev = None

    @property
    def remembers(self) -> bool:
        return self._prev is not None

    def load(self, frames: np.ndarray, next_frame: np.ndarray, done: np.ndarray, depth: np.ndarray) -> None:
        """Remember the previous step of every env (as the store rebuilds it)."""
        self._prev = (frames.copy(), next_frame.copy(), np.asarray(done, bool).copy(), np.asarray(depth).astype(np.int64))

    def check(self, obs: np.ndarray, next_obs: np.ndarray, done: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Check one ``add`` of every env (stacked ``[n, *stacked_shape]``, cast to the
        stored dtype) against what the store rebuilds; return the newest frames of
        ``obs`` and ``next_obs`` and the ``depth`` of the step. Remembers the step
        (call ``commit_check`` only once the step is stored: ``check`` again before
        then re-checks against the same previous step)."""
        k = self.k
        # contiguous copies ([n, k, *frame]): VecTransposeImage gives transposed views, and
        # comparisons over strided frames cost several times more
        frames, nxt = np.ascontiguousarray(self.split(obs)), np.ascontiguousarray(self.split(next_obs))
        n = frames.shape[0]
        flat, flat_next = frames.reshape(n, k, -1), nxt.reshape(n, k, -1)
        depth = np.zeros(n, np.int64)
        expected = np.zeros_like(frames[:, :-1])
        if self._prev is not None:
            p_frames, p_next, p_done, p_depth = self._prev
            cont = ~p_done & (p_next.reshape(n, -1) == flat[:, -1]).all(axis=1)
            depth[cont] = np.minimum(p_depth[cont] + 1, k - 1)
            expected[cont] = p_frames[cont, 1:]
        else:
            cont = np.zeros(n, bool)
        bad = (flat[:, :-1] != expected.reshape(n, k - 1, flat.shape[2])).any(axis=2)
        # an episode that starts with no done before it (a fresh env after a resume whose
        # reset frame equals the stored next frame): zeros are rebuilt exactly, depth 0
        fresh = cont & bad.any(axis=1) & ~flat[:, :-1].reshape(n, -1).any(axis=1)
        depth[fresh], bad[fresh] = 0, False
        for e in np.flatnonzero(bad.any(axis=1)):
            want = ("the previous step's newest frames (the step continues its episode: the previous step was not "
                    "done and its next_obs's newest frame is this obs's newest)") if cont[e] else (
                    "zeros before the episode's first step, as VecFrameStack pads (a new episode: the previous step "
                    "was done, or its next_obs is not this obs, or there is none)")
            raise errors.InvalidArgumentError(
                f"frame_stack: env {e} at step {step}: expected obs's older {k - 1} frames to be {want}, got "
                f"differences at frames {np.flatnonzero(bad[e]).tolist()} of {k - 1}{_diff(expected[e], frames[e, :-1])}: "
                "the store keeps the newest frame of each step and cannot rebuild this stack"
            )
        bad = (flat[:, 1:] != flat_next[:, :-1]).any(axis=2)
        for e in np.flatnonzero(bad.any(axis=1)):
            raise errors.InvalidArgumentError(
                f"frame_stack: env {e} at step {step}: expected next_obs's older {k - 1} frames to be obs's newest "
                f"{k - 1} (VecFrameStack shifts the stack by one frame), got differences at frames "
                f"{np.flatnonzero(bad[e]).tolist()} of {k - 1}{_diff(frames[e, 1:], nxt[e, :-1])}"
            )
        self._pending = (frames, nxt[:, -1], np.asarray(done).reshape(n).astype(bool), depth)
        return frames[:, -1], nxt[:, -1], depth.astype(np.uint8)

    def commit_check(self) -> None:
        """The step last ``check``-ed was stored: it is the previous step from now on."""
        frames, next_frame, done, depth = self._pending
        self.load(frames, next_frame, done, depth)


def _diff(expected: np.ndarray, got: np.ndarray) -> str:
    where = np.argwhere(expected != got)
    if not len(where):
        return ""
    at = tuple(int(i) for i in where[0])
    return f" (first at frame index {at}: expected {expected[at].item()!r}, received {got[at].item()!r}; {len(where)} values differ)"
