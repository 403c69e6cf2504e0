"""Reading a :class:`~mmbuffer.torchrl.ReplayBuffer` as TorchRL's buffers are read
besides ``sample``: rows by index (``rb[i]``, ``rb[a:b]``), the transforms applied
on the way out, and prefetching of the next batches in a thread."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import errors, samplers
from .._read.gather import Batch
from ..buffer import Buffer
from .keys import to_tensordict

if TYPE_CHECKING:
    from .replay import ReplayBuffer


def getitem(rb: ReplayBuffer, index: Any) -> Any:
    """``rb[index]`` (see :func:`select_rows`); a key (``rb["observation"]``, a
    nested key as a tuple) is that key of every live row, as TorchRL's."""
    if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(k, str) for k in index)):
        return rb[:][index]
    buf, layout = rb.buffer, rb._layout
    assert layout is not None
    with buf.lock:
        rows, single = select_rows(buf, index)
        data = buf.get(rows)
        open_rows = rb._open_rows()
    b = Batch(data, torch.from_numpy(rows), torch.ones(len(rows)))
    out = to_tensordict(b, layout, samplers.Uniform(), flatten=False, open_rows=open_rows)
    return rb._transformed(out[0] if single else out)


def iterate(rb: ReplayBuffer) -> Iterator[Any]:
    """``rb.sample()`` batch after batch; with an ``Epoch`` spec (TorchRL's samplers
    without replacement) up to the end of the epoch under way, the last batch
    holding what is left of it (as TorchRL's last, short one)."""
    size = rb.batch_size
    if size is None:
        raise errors.InvalidArgumentError("batch_size: expected one set at construction to iterate, got None")
    spec = rb.sampler
    if not isinstance(spec, samplers.Epoch):
        while True:
            yield rb.sample()
    per_item = spec.slice_len or 1
    if rb._translated.num_slices is not None:
        per_item = size // rb._translated.num_slices
    epoch = None
    while True:
        cursor = rb.buffer._sampler_state.epochs.get(spec.name)  # noqa: SLF001 - the spec's position
        n = size
        if cursor is not None and cursor.state.num_items >= 0:
            st = cursor.state
            left = st.num_items - st.position
            if epoch is None:
                epoch = st.epoch + 1 if left <= 0 else st.epoch
            if 0 < left < size // per_item:
                n = left * per_item
        yield rb.sample(n if n != size else None)
        st = rb.buffer._sampler_state.epochs[spec.name].state  # noqa: SLF001
        if epoch is None:
            epoch = st.epoch
        if st.epoch > epoch or st.position >= st.num_items:
            return


def live_rows(buf: Buffer) -> np.ndarray:
    """Every live row's global id, ascending (TorchRL's storage positions with one
    stream: ``0 .. len - 1``, or the whole ring once it is full)."""
    view = buf.view()
    parts = [buf.layout.rows(lane, np.arange(lv.first_start, int(view.written[lane]), dtype=np.int64))
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
    bad = (rows < 0) | (rows >= buf.capacity) | (absolute < first) | (absolute >= view.written[lane])
    if bad.any():
        raise errors.RowNotLiveError(
            f"index: expected live rows of the store at {buf.path} ({len(buf)} live), got {rows[bad][:5].tolist()}"
        )
    return rows, single


def compose(transform: Any) -> Any:
    """TorchRL's ``Compose`` of ``transform``: a ``Transform``, a callable taking and
    returning a TensorDict, or a list of them (TorchRL itself must be installed)."""
    try:
        from torchrl.envs.transforms import Compose, Transform
        from torchrl.envs.transforms.transforms import _CallableTransform
    except ImportError:  # pragma: no cover - torchrl is installed where tests run
        raise errors.InvalidArgumentError(
            f"transform: expected torchrl installed to apply {transform!r}, got an ImportError"
        ) from None
    items = transform if isinstance(transform, (list, tuple)) else [] if transform is None else [transform]
    out = []
    for t in items:
        if not isinstance(t, Transform):
            if not callable(t):
                raise errors.InvalidArgumentError(f"transform: expected a torchrl Transform or a callable, got {t!r}")
            t = _CallableTransform(t)
        out.append(t)
    return Compose(*out)


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
