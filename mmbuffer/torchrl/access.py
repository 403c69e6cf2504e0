"""Reading a :class:`~mmbuffer.torchrl.ReplayBuffer` as TorchRL's buffers are read
besides ``sample``: rows by index (``rb[i]``, ``rb[a:b]``), the transforms applied
on the way out, and prefetching of the next batches in a thread."""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import errors, samplers
from .._read.gather import Batch
from ..buffer import Buffer
from ..samplers.epoch import EpochCursor, EpochState
from .keys import KeyMap, to_tensordict
import mmbuffer.torchrl.nstep as nstep



def is_key(index: Any) -> bool:
    """Whether ``rb[index]`` names a key (``"observation"``, ``("next", "reward")``)."""
    return isinstance(index, str) or (isinstance(index, tuple) and bool(index) and all(isinstance(k, str) for k in index))


def rows(buf: Buffer, layout: KeyMap, index: Any, open_rows: np.ndarray) -> Any:
    """``rb[index]`` before the transforms (see :func:`select_rows`) in TorchRL's
    layout; ``open_rows``: rows whose episode end is provisional."""
    picked, single = select_rows(buf, index)
    b = Batch(buf.get(picked), torch.from_numpy(picked), torch.ones(len(picked)))
    out = to_tensordict(b, layout, samplers.Uniform(), flatten=False, open_rows=open_rows)
    return out[0] if single else out


def iterate(sample: Callable[[int | None], Any], size: int, spec: samplers.Sampler, root: Path) -> Iterator[Any]:
    """``sample(None)`` batch after batch; with an ``Epoch`` spec (TorchRL's samplers
    without replacement) up to the end of the epoch under way, the last batch
    holding what is left of it (as TorchRL's last, short one). ``root``: the store,
    where the epoch's position is saved after each batch."""
    if not isinstance(spec, samplers.Epoch):
        while True:
            yield sample(None)
    per_item = spec.slice_len or 1

    def position() -> EpochState | None:
        st = EpochCursor(root, spec.name, seed=spec.seed, slice_len=spec.slice_len, shard=spec.shard).state
        return st if st.num_items >= 0 else None

    st, epoch = position(), None
    while True:
        n = size
        if st is not None:
            left = st.num_items - st.position
            if epoch is None:
                epoch = st.epoch + 1 if left <= 0 else st.epoch
            if 0 < left < size // per_item:
                n = left * per_item
        yield sample(n if n != size else None)
        st = position()
        if st is None:  # the epoch ended with this batch; the next starts at the next draw
            return
        if epoch is None:
            epoch = st.epoch
        if st.epoch > epoch or st.position >= st.num_items:
            return


def live_rows(buf: Buffer) -> np.ndarray:
    """Every live row's global id, ascending (TorchRL's storage positions with one
    stream: ``0 .. len - 1``, or the whole ring once it is full), but the last row of
    an open episode (its next observation is not known yet: a reader's view)."""
    view = buf.view()
    parts = [buf.layout.rows(lane, np.arange(lv.first_start, lv.visible_end, dtype=np.int64))
             for lane, lv in enumerate(view.lanes)]
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


def select_rows(buf: Buffer, index: Any) -> tuple[np.ndarray, bool]:
    """The global rows ``index`` names, and whether it named one row (a TensorDict
    without batch dims). Non-negative integers (an int, a list, a tensor) are row
    ids, as ``extend`` and ``sample`` return them; a slice or a negative int counts
    in :func:`live_rows`. A row that is not live is ``RowNotLiveError`` (an
    ``IndexError``, as TorchRL raises past its storage)."""
    if isinstance(index, slice):
        return live_rows(buf)[index], False
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool) and index < 0:
        live = live_rows(buf)
        if -index > len(live):
            raise errors.RowNotLiveError(f"index: expected -{len(live)} <= index < 0 (live rows), got {index}")
        return live[index : index + 1 if index != -1 else None], True
    rows = torch.as_tensor(index).cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
    if rows.dtype == bool:
        raise errors.InvalidArgumentError(f"index: expected row ids, a slice or a negative int, got a boolean mask {rows.shape}")
    if rows.dtype.kind not in "iu":
        raise errors.InvalidArgumentError(f"index: expected row ids, a slice or a negative int, got {index!r}")
    single = rows.ndim == 0
    rows = rows.astype(np.int64).reshape(-1)
    view = buf.view()
    lane = np.clip(rows, 0, buf.capacity - 1) // buf.lane_size
    absolute = buf.layout.absolute(np.clip(rows, 0, buf.capacity - 1), view.written)
    first = np.array([lv.first_start for lv in view.lanes], dtype=np.int64)[lane]
    end = np.array([lv.visible_end for lv in view.lanes], dtype=np.int64)[lane]  # not an open episode's last row
    bad = (rows < 0) | (rows >= buf.capacity) | (absolute < first) | (absolute >= end)
    if bad.any():
        raise errors.RowNotLiveError(
            f"index: expected live rows of the store at {buf.path} ({len(buf)} live), got {rows[bad][:5].tolist()}"
        )
    return rows, single


def transforms(transform: Any) -> list[Callable[[Any], Any]]:
    """``transform`` as a list of callables TensorDict -> TensorDict, applied in
    order to sampled data (a torchrl ``Transform`` is one: calling it is its
    forward; a ``Compose`` gives its parts); a ``MultiStepTransform`` among them
    also acts at ``extend`` (``nstep.py``), other inverse transforms are refused."""
    items = nstep.expand(transform)
    for t in items:
        nstep.check_transform(t)
    return items


def last_rows(buf: Buffer | None, streams: list[int]) -> np.ndarray:
    """The global row of the last row written to each of ``streams``."""
    if buf is None or not streams:
        return np.zeros(0, dtype=np.int64)
    lanes = buf.store.lanes  # the writer's cursors (no view built: this runs with every sample)
    out: np.ndarray = buf.layout.rows(np.asarray(streams), np.array([lanes[s].written - 1 for s in streams]))
    return out


class Sampled:
    """The lane cursors of the last 256 batches ``sample`` returned, by the identity of
    their ``"index"`` tensor (``update_priority`` then skips rows rewritten since)."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], np.ndarray | None]] = {}

    def remember(self, index: torch.Tensor, written: np.ndarray | None) -> None:
        if len(self._seen) >= self.size:
            self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
            while len(self._seen) >= self.size:
                self._seen.pop(next(iter(self._seen)))
        self._seen[id(index)] = (weakref.ref(index), written)

    def written_at(self, index: Any) -> np.ndarray | None:
        entry = self._seen.get(id(index))
        return entry[1] if entry is not None and entry[0]() is index else None

    def clear(self) -> None:
        self._seen.clear()


class Prefetch:
    """Up to ``depth`` batches drawn ahead in threads (TorchRL's ``prefetch=``): each
    ``next`` returns the oldest and draws another. The store's lock makes a draw one
    step beside the writer's extends; an error of a draw is raised by ``next``."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="mmbuffer-prefetch")
        self._queue: collections.deque[Future[Any]] = collections.deque()

    def next(self, draw: Callable[[], Any]) -> Any:
        while len(self._queue) < self.depth:
            self._queue.append(self._pool.submit(draw))
        return self._queue.popleft().result()

    def close(self) -> None:
        """Drop the batches drawn ahead and stop the threads."""
        for f in self._queue:
            f.cancel()
        self._queue.clear()
        self._pool.shutdown(wait=True)


def tensordict() -> Any:
    try:
        import tensordict
    except ImportError:  # pragma: no cover - the extra is installed where tests run
        raise errors.InvalidArgumentError(
            "mmbuffer.torchrl: expected tensordict installed (pip install 'mmbuffer[torchrl]'), got an ImportError"
        ) from None
    return tensordict


def as_tensordict(data: Any) -> Any:
    if not isinstance(data, tensordict().TensorDictBase):
        raise errors.InvalidArgumentError(f"data: expected a TensorDict, got {type(data).__name__}")
    return data


def positive(what: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise errors.InvalidArgumentError(f"{what}: expected a positive integer, got {value!r}")
    return int(value)
