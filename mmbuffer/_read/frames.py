"""Frame stacks built at sample time from frames stored once (``stack={"pixels": 4}``).

A row's stack of ``k`` frames is the column at the ``k`` rows ending at the row,
oldest first: absolute rows ``a - k + 1 .. a`` of its lane. Positions before the
first row of the row's episode are padded, never filled from the previous episode
or another lane: ``stack_pad="first"`` repeats the episode's first frame
(Gymnasium's ``FrameStackObservation``), ``"zero"`` writes zeros (SB3's
``VecFrameStack``, Dopamine). ``next_<col>`` of a stacked next-derived column is the
stack as of the next observation: frames ``a - k + 2 .. a`` and ``next_<col>`` of
the row (the following row, or the episode's final observation), padded alike.

How a batch is read (O(batch * k), whatever the size of the store):

1. under the store's lock, the sampler draws the rows and, against the same
   ledger state, the start of each row's episode is found by a binary search over
   its lane's episode ends (``_ledger.index.containing_start``; the open episode
   starts at the lane's open start);
2. one ``[*items, k]`` matrix of source rows (ring arithmetic by
   ``_ledger.layout.Layout``) is read with one ``gather`` call for the stacked
   columns of that ``k``, the other keys (and each stacked column's next frame)
   with one more;
3. the earliest source row of each item is what a reader re-checks against the
   writer (``recheck.py``): the stacked frames are older than the sampled row, so
   the ring overwrites them first.

>>> import tempfile, numpy as np, torch, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/f", {"pixels": ((2,), "uint8")}, capacity=16,
...                 next_keys=("pixels",))
>>> frames = np.arange(10, 16, dtype="uint8").repeat(2).reshape(6, 2)
>>> buf.extend({"pixels": frames, "terminated": np.array([0, 0, 1, 0, 0, 1], bool)},
...            final_obs={"pixels": np.array([[98, 98], [99, 99]], "uint8")})
>>> b = buf.sample(64, stack={"pixels": 3}, generator=torch.Generator().manual_seed(0))
>>> tuple(b["pixels"].shape), tuple(b["next_pixels"].shape)
((64, 3, 2), (64, 3, 2))
>>> def by_row(key):  # first byte of each frame, per sampled row
...     return dict(sorted(zip(b.indices.tolist(), b[key][..., 0].tolist())))
>>> by_row("pixels")       # oldest first; rows 3-5 are the second episode
{0: [10, 10, 10], 1: [10, 10, 11], 2: [10, 11, 12], 3: [13, 13, 13], 4: [13, 13, 14], 5: [13, 14, 15]}
>>> by_row("next_pixels")  # episode ends: their final observation comes last
{0: [10, 10, 11], 1: [10, 11, 12], 2: [11, 12, 98], 3: [13, 13, 14], 4: [13, 14, 15], 5: [14, 15, 99]}
>>> b = buf.sample(64, stack={"pixels": 3}, stack_pad="zero", generator=torch.Generator().manual_seed(0))
>>> by_row("pixels")[4]
[0, 13, 14]
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import errors
from .._ledger import index
from .._ledger.store import Store
from ..samplers import Draw
from .gather import gather
from .memory import recycled

#: ``stack_pad`` values: repeat the episode's first frame, or zeros
PADS = ("first", "zero")


@dataclass(frozen=True, slots=True)
class Stacks:
    """A checked ``stack=`` / ``stack_pad=`` pair: column -> frames, and the padding.
    A value (hashable, picklable): it travels to stream workers and DataLoader
    processes."""

    sizes: tuple[tuple[str, int], ...]
    pad: str = "first"

    def frames(self, name: str) -> int | None:
        """Frames per stack of key ``name`` (``<col>`` or ``next_<col>``), None if unstacked."""
        base = name[5:] if name.startswith("next_") and name not in dict(self.sizes) else name
        return dict(self.sizes).get(base)

    def shape(self, name: str, row_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The per-item shape of key ``name`` whose rows have ``row_shape``."""
        k = self.frames(name)
        return row_shape if k is None else (k, *row_shape)

    def read(
        self, store: Store, draw: Callable[[np.ndarray], Draw], positions: np.ndarray, names: list[str],
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[Draw, dict[str, torch.Tensor], np.ndarray]:
        """Draw the items at batch ``positions`` and read ``names`` with stacks; return
        the draw, the data (in ``names`` order) and the earliest row each item reads
        (global row ids ``[items]``, what ``recheck.overwritten`` checks)."""
        with store.lock:  # the draw and the episode starts from one ledger state
            drawn = draw(positions)
            rows, written = drawn[0], drawn[3]
            lane, absolute, start = episode_starts(store, rows, written)
        lay = store.layout
        items = len(positions)
        sizes = dict(self.sizes)
        stacked = {n for n in names if self.frames(n) is not None}
        nexts = {n: n[5:] for n in stacked if n not in sizes}  # next_<col> -> <col>
        plain = [n for n in names if n not in stacked] + list(nexts)
        data = gather(store, rows, plain, _subset(out, [n for n in names if n not in stacked]))
        wanted = {n for n in stacked if n in sizes} | set(nexts.values())
        by_k: dict[int, list[str]] = {}
        for col in sorted(wanted):
            by_k.setdefault(sizes[col], []).append(col)
        stacks: dict[str, torch.Tensor] = {}
        for k, cols in by_k.items():
            want = absolute[..., None] + np.arange(1 - k, 1, dtype=np.int64)
            low = start[..., None]
            src = lay.rows(lane[..., None], np.maximum(want, low))
            got = gather(store, src, cols, _subset(out, [c for c in cols if c in stacked]))
            if self.pad == "zero":
                pad = want < low
                if pad.any():
                    for value in got.values():
                        value.numpy()[pad] = 0
            stacks.update(got)
        for name, col in nexts.items():  # frames a-k+2 .. a, then the row's next frame
            frame = data.pop(name)
            stack = stacks[col]
            caller = out.get(name) if out is not None else None
            fits = (caller is not None and caller.device.type == "cpu" and caller.is_contiguous()
                    and caller.shape == stack.shape and caller.dtype == stack.dtype)
            target = caller if fits and caller is not None else recycled(tuple(stack.shape), stack.numpy().dtype)
            k, m = stack.shape[rows.ndim], rows.size
            dst = target.numpy().reshape(m, k, -1)  # numpy: one plain copy each, no torch threads
            dst[:, : k - 1] = stack.numpy().reshape(m, k, -1)[:, 1:]
            dst[:, k - 1] = frame.numpy().reshape(m, -1)
            if caller is not None and target is not caller:
                target = caller.copy_(target)
            data[name] = target
        kmax = max(sizes.values())
        first = np.maximum(absolute.reshape(items, -1)[:, 0] - (kmax - 1), start.reshape(items, -1)[:, 0])
        earliest = lay.rows(lane.reshape(items, -1)[:, 0], first)
        result = {n: stacks[n] if n in stacked and n in sizes else data[n] for n in names}
        return drawn, result, earliest


def episode_starts(store: Store, rows: np.ndarray, written: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lane, absolute row, absolute start of its episode)`` of each global row id in
    ``rows`` (any shape), drawn when the lanes' cursors were ``written``.

    One binary search per lane over its episode ends (the open episode starts at
    the lane's open start); a Python loop over the lanes the rows touch, never
    over rows. Call under the store's lock, against the ledger state the rows were
    drawn from (a writer's later extend may evict the rows' episodes).
    """
    lay = store.layout
    lane = lay.lane(rows)
    absolute = lay.absolute_at(rows, np.asarray(written, dtype=np.int64)[lane])
    start = np.empty_like(absolute)
    if rows.size:
        flat_lane, flat_abs, flat_start = lane.reshape(-1), absolute.reshape(-1), start.reshape(-1)
        order = np.argsort(flat_lane, kind="stable")
        bounds = np.searchsorted(flat_lane[order], np.arange(store.num_streams + 1))
        for l in np.flatnonzero(np.diff(bounds)):
            pick = order[bounds[l] : bounds[l + 1]]
            flat_start[pick] = index.containing_start(store.ends, int(l), lay.lane_size, store.lanes[l], flat_abs[pick])
        np.minimum(start, absolute, out=start)  # a row is never before its own episode's start
    return lane, absolute, start


def check(stack: Mapping[str, int] | Stacks | None, stack_pad: str = "first", columns: Iterable[str] | None = None) -> Stacks | None:
    """``stack``/``stack_pad`` checked (typed errors naming the argument, the expected and
    the received value); None when nothing is stacked. ``columns``: the stored
    column names (None: check the column names later, with the store).

    >>> check({"pixels": 4}, "zero", ["pixels"])
    Stacks(sizes=(('pixels', 4),), pad='zero')
    >>> check({"pixels": 0})
    Traceback (most recent call last):
        ...
    mmbuffer.errors.InvalidArgumentError: stack['pixels']: expected an integer >= 1 (frames per stack), got 0
    """
    if not isinstance(stack_pad, str) or stack_pad not in PADS:
        raise errors.InvalidArgumentError(f"stack_pad: expected one of {list(PADS)}, got {stack_pad!r}")
    if stack is None:
        return None
    if isinstance(stack, Stacks):  # already checked: its own padding, its names against ``columns``
        return check(dict(stack.sizes), stack.pad, columns)
    if not isinstance(stack, Mapping):
        raise errors.InvalidArgumentError(
            f"stack: expected a mapping column -> frames per stack ({{'pixels': 4}}), got {type(stack).__name__} {stack!r}"
        )
    sizes = []
    known = None if columns is None else sorted(columns)
    for name, k in stack.items():
        if not isinstance(name, str) or (known is not None and name not in known):
            raise errors.InvalidArgumentError(f"stack: expected stored column names among {known}, got unknown {name!r}")
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 1:
            raise errors.InvalidArgumentError(f"stack[{name!r}]: expected an integer >= 1 (frames per stack), got {k!r}")
        sizes.append((name, operator.index(k)))
    if not sizes:
        return None
    return Stacks(tuple(sorted(sizes)), stack_pad)


def for_store(stacks: Stacks | None, store: Any) -> Stacks | None:
    """``stacks`` (checked without a store) with its column names checked against
    ``store``'s columns."""
    return None if stacks is None else check(stacks, stacks.pad, store.columns)


def _subset(out: Mapping[str, torch.Tensor] | None, names: list[str]) -> dict[str, torch.Tensor] | None:
    if out is None:
        return None
    return {n: out[n] for n in names if n in out}
