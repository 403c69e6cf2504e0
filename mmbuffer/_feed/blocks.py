"""A batch as one block: every tensor of a ``Batch`` a view into one flat uint8 tensor.

Moving a batch costs per tensor: an allocation, a page-locking copy (``pin_memory``),
a host-to-device copy, and across a ``DataLoader`` worker boundary a shared-memory
segment, a file descriptor sent over a socket and a map in the receiving process.
A batch of ten columns paid all of that ten times. Packed into one block
(:class:`PackedBatch`) it pays each once, whatever its number of columns.

* :class:`BlockLayout` places a batch's tensors (data columns in order, then
  ``indices``, ``weights``, ``mask``) at offsets aligned to :data:`ALIGN` bytes.
* :class:`PackedBatch` is a :class:`~mmbuffer.Batch` whose tensors are views into
  ``block``: ``to``, ``pin_memory`` and pickling move the block and rebuild views.
* :class:`Ring` holds reusable (pinned) host blocks; a slot is handed out again
  only after the fence of its last use (the CUDA event of its copy) has passed.
* :func:`read_into` draws a batch from a buffer and gathers it straight into a
  block's views (``Buffer.read_batch(..., out=...)``).

>>> import torch
>>> from mmbuffer._read.gather import Batch
>>> b = Batch({"obs": torch.ones(4, 3), "done": torch.zeros(4, dtype=torch.bool)},
...           torch.arange(4), torch.ones(4))
>>> layout = BlockLayout.of(b)
>>> [e.offset for e in layout.entries], layout.nbytes  # obs, done, indices, weights
([0, 64, 128, 192], 256)
>>> p = layout.pack(b)
>>> p["obs"].data_ptr() - p.block.data_ptr(), p["done"].data_ptr() - p.block.data_ptr()
(0, 64)
>>> torch.equal(p["obs"], b["obs"]) and torch.equal(p.indices, b.indices)
True
"""

from __future__ import annotations

import functools

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from .threads import POLL_S
from .._read.frames import Stacks
from .._read.gather import Batch
from ..samplers import Draw, Sampler

__all__ = ["ALIGN", "BlockLayout", "Entry", "PackedBatch", "Ring", "Stopped", "read_into"]

#: Byte alignment of every tensor in a block (a cache line; any dtype's alignment).
ALIGN = 64


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a block: ``kind`` is ``"data"`` (then ``name`` is the column),
    ``"indices"``, ``"weights"`` or ``"mask"``."""

    kind: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Where each tensor of a batch lies in its block (fixed for a stream's batches)."""

    entries: tuple[Entry, ...]
    nbytes: int

    @classmethod
    def of(cls, batch: Batch) -> BlockLayout:
        """The layout of ``batch``'s tensors, in order: data columns, indices, weights, mask."""
        tensors: list[tuple[str, str, torch.Tensor]] = [("data", k, v) for k, v in batch.data.items()]
        tensors += [("indices", "", batch.indices), ("weights", "", batch.weights)]
        if batch.mask is not None:
            tensors.append(("mask", "", batch.mask))
        entries = []
        offset = 0
        for kind, name, t in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append(Entry(kind, name, t.dtype, tuple(t.shape), offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        return cls(tuple(entries), max(offset, ALIGN))

    @property
    def rows_shape(self) -> tuple[int, ...]:
        """The shape of the batch's ``indices`` (``[B]`` or ``[B, L]``)."""
        return next(e.shape for e in self.entries if e.kind == "indices")

    def matches(self, batch: Batch) -> bool:
        """Whether ``batch`` has exactly this layout's tensors (names, dtypes, shapes)."""
        return BlockLayout.of(batch).entries == self.entries

    def views(self, block: torch.Tensor) -> dict[str, Any]:
        """``{"data": {column: view}, "indices": view, "weights": view, "mask": view or None}``."""
        if block.dtype != torch.uint8 or block.dim() != 1 or block.numel() < self.nbytes:
            raise ValueError(f"block: expected a flat uint8 tensor of >= {self.nbytes} bytes, got {block.dtype} {tuple(block.shape)}")
        out: dict[str, Any] = {"data": {}, "mask": None}
        # one dtype view of the whole block per dtype, then one as_strided per tensor:
        # a third of the tensor operations (they are most of a CUDA stream's get())
        wholes: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
        for kind, name, dtype, shape, strides, at in _plan(self):
            got = wholes.get(dtype)
            if got is None:
                whole = block[: self.nbytes].view(dtype)
                got = wholes[dtype] = (whole, int(whole.storage_offset()))
            view = got[0].as_strided(shape, strides, got[1] + at)
            if kind == "data":
                out["data"][name] = view
            else:
                out[kind] = view
        return out

    def empty(self, *, pin: bool = False) -> torch.Tensor:
        """A new block (page-locked with ``pin``)."""
        return torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)

    def pack(self, batch: Batch, block: torch.Tensor | None = None, views: dict[str, Any] | None = None) -> PackedBatch:
        """``batch`` copied into ``block`` (default: a new one) as a :class:`PackedBatch`
        (``views``: ``self.views(block)``, when the caller has them already)."""
        block = self.empty() if block is None else block
        packed = PackedBatch(block, self, batch.written_at, views=views)
        pairs = [(packed.data[k], v) for k, v in batch.data.items()]
        pairs += [(packed.indices, batch.indices), (packed.weights, batch.weights)]
        if packed.mask is not None and batch.mask is not None:
            pairs.append((packed.mask, batch.mask))
        for dst, src in pairs:
            if dst.data_ptr() != src.data_ptr():  # else gathered in place already
                # numpy: one plain copy without the GIL; torch's copy_ of a large CPU
                # tensor fans out to its intra-op threads, which a loaded host (or a
                # training step using them) makes slow
                np.copyto(dst.numpy(), src.numpy())
        return packed


@functools.lru_cache(maxsize=64)
def _plan(layout: BlockLayout) -> tuple[tuple[str, str, torch.dtype, tuple[int, ...], tuple[int, ...], int], ...]:
    """Per tensor of ``layout``: kind, name, dtype, shape, contiguous strides and its
    offset in elements of its dtype (offsets are ``ALIGN``-aligned, so exact)."""
    plan = []
    for e in layout.entries:
        strides = [1] * len(e.shape)
        for i in range(len(e.shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * max(e.shape[i + 1], 1)
        plan.append((e.kind, e.name, e.dtype, e.shape, tuple(strides), e.offset // e.dtype.itemsize))
    return tuple(plan)


class PackedBatch(Batch):
    """A :class:`~mmbuffer.Batch` whose tensors are views into one flat uint8 ``block``.

    ``to(device)`` and ``pin_memory()`` move the block once and return a
    ``PackedBatch`` over the copy; pickling (a ``DataLoader`` worker's batch)
    sends the block and the layout, and the receiver rebuilds the views.
    """

    __slots__ = ("block", "layout")

    def __init__(
        self, block: torch.Tensor, layout: BlockLayout, written_at: np.ndarray | None = None, *, views: dict[str, Any] | None = None
    ) -> None:
        views = layout.views(block) if views is None else views
        super().__init__(views["data"], views["indices"], views["weights"], views["mask"], written_at)
        self.block = block
        self.layout = layout

    def to(self, device: Any, non_blocking: bool = False) -> PackedBatch:
        """The same batch on ``device``: one copy of the block."""
        return PackedBatch(self.block.to(device, non_blocking=non_blocking), self.layout, self.written_at)

    def pin_memory(self) -> PackedBatch:
        """The same batch in page-locked memory: one pinned copy of the block."""
        return PackedBatch(self.block.pin_memory(), self.layout, self.written_at)

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedBatch, (self.block, self.layout, self.written_at))


class Fence(Protocol):
    """What a slot waits on before reuse (``torch.cuda.Event`` is one)."""

    def synchronize(self) -> None: ...


class Stopped(Exception):
    """:meth:`Ring.acquire` gave up because the stop event was set."""


class Ring:
    """``slots`` reusable host blocks of ``nbytes`` (page-locked when ``pin``).

    :meth:`acquire` hands out a free slot, first waiting on the fence its last
    user released it with (the copy that still reads it), so a slot is never
    refilled while in use; :meth:`release` returns it with that fence.
    """

    def __init__(self, nbytes: int, slots: int, *, pin: bool) -> None:
        self.blocks = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(slots)]
        self._free: queue.Queue[tuple[int, Fence | None]] = queue.Queue()
        for i in range(slots):
            self._free.put((i, None))

    def acquire(self, stop: threading.Event | None = None) -> int:
        """A free slot's number (blocks; raises :class:`Stopped` once ``stop`` is set)."""
        while True:
            if stop is not None and stop.is_set():
                raise Stopped
            try:
                slot, fence = self._free.get(timeout=POLL_S)
                break
            except queue.Empty:
                continue
        if fence is not None:
            fence.synchronize()
        return slot

    def release(self, slot: int, fence: Fence | None = None) -> None:
        """Give ``slot`` back; it is reused only after ``fence`` (if any) has passed."""
        self._free.put((slot, fence))

    def free(self) -> int:
        """Slots free now (their fences may not have passed yet)."""
        return self._free.qsize()


class _ShapeChanged(Exception):
    def __init__(self, drawn: Draw) -> None:
        super().__init__()
        self.drawn = drawn


def read_into(
    buf: Any,
    sampler: Sampler,
    size: int,
    names: list[str],
    generator: torch.Generator | None,
    *,
    block: torch.Tensor | None = None,
    layout: BlockLayout | None = None,
    hold_lock: bool = True,
    first_draw: Callable[[], object] | None = None,
    stack: Stacks | None = None,
) -> Batch:
    """Draw ``size`` items with ``sampler`` from ``buf`` and gather them.

    With ``block`` and ``layout``, the columns are gathered straight into the
    block's views and indices, weights and mask copied in: a :class:`PackedBatch`
    comes back; if the draw's shape differs from the layout's (a short last batch),
    a plain :class:`~mmbuffer.Batch` of its own. Without them, a plain ``Batch``
    (``buf.sample`` draws exactly the same). Draws take the buffer lock;
    ``first_draw`` runs inside it just before the first draw (the stream numbers
    its batches there, so that numbers follow the generator's order).
    ``hold_lock=False`` gathers without holding the lock and has the buffer
    re-check every item against the writer afterwards (redrawing those it may have
    overwritten), so several threads can gather at once. ``stack``: frame stacks
    (``mmbuffer._read.frames``).
    """
    lock = buf.lock
    started = False

    def draw(positions: np.ndarray) -> Draw:
        nonlocal started
        with lock:
            if not started:
                started = True
                if first_draw is not None:
                    first_draw()
                drawn: Draw = buf.indices(sampler, len(positions), generator)
                if layout is not None and drawn[0].shape != layout.rows_shape:
                    raise _ShapeChanged(drawn)
                return drawn
            return buf.indices(sampler, len(positions), generator)  # type: ignore[no-any-return]

    out = None if block is None or layout is None else layout.views(block)
    try:
        batch = _read(buf, draw, size, names, out, hold_lock, stack)
    except _ShapeChanged as changed:
        replay: list[Draw] = [changed.drawn]

        def again(positions: np.ndarray) -> Draw:
            return replay.pop() if replay else draw(positions)

        return _read(buf, again, size, names, None, hold_lock, stack)
    if out is None:
        return batch
    assert layout is not None and block is not None
    return layout.pack(batch, block, out)


def _read(
    buf: Any, draw: Callable[[np.ndarray], Draw], size: int, names: list[str], out: dict[str, Any] | None, hold_lock: bool,
    stack: Stacks | None = None,
) -> Batch:
    data = None if out is None else out["data"]
    if hold_lock:
        with buf.lock:
            return buf.read_batch(draw, size, names, out=data, stack=stack)  # type: ignore[no-any-return]
    return buf.read_batch(draw, size, names, out=data, recheck=True, stack=stack)  # type: ignore[no-any-return]
