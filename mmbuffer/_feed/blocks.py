"""A batch as one block: every tensor of a ``Batch`` a view into one flat uint8 tensor.

Moving a batch costs per tensor: an allocation, a page-locking copy (``pin_memory``),
a host-to-device copy, and across a ``DataLoader`` worker boundary a shared-memory
segment, a file descriptor sent over a socket and a map in the receiving process.
A batch of ten columns paid all of that ten times. Packed into one block
(:class:`PackedBatch`) it pays each once, whatever its number of columns.

* :class:`BlockLayout` places a batch's tensors (data columns in order, then
  ``indices``, ``weights``, ``mask``) at offsets aligned to :data:`ALIGN` bytes.
* :class:`PackedBatch` is a :class:`~mmbuffer.Batch` whose tensors are views into
  ``block``, each made on first use: ``to``, ``pin_memory`` and pickling move the
  block, and the copy makes the views its user reads.
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

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
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


#: Where one tensor of a layout lies: dtype, shape, contiguous strides, offset in
#: elements of its dtype (offsets are ``ALIGN``-aligned, so exact).
Placement = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Where each tensor of a batch lies in its block (fixed for a stream's batches)."""

    entries: tuple[Entry, ...]
    nbytes: int
    plan: dict[tuple[str, str], Placement] = field(init=False, compare=False, repr=False)  # by (kind, name)

    def __post_init__(self) -> None:
        plan = {}
        for e in self.entries:
            strides = [1] * len(e.shape)
            for i in range(len(e.shape) - 2, -1, -1):
                strides[i] = strides[i + 1] * max(e.shape[i + 1], 1)
            plan[(e.kind, e.name)] = (e.dtype, e.shape, tuple(strides), e.offset // e.dtype.itemsize)
        object.__setattr__(self, "plan", plan)

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
        return self.plan[("indices", "")][1]

    def matches(self, batch: Batch) -> bool:
        """Whether ``batch`` has exactly this layout's tensors (names, dtypes, shapes)."""
        return BlockLayout.of(batch).entries == self.entries

    def check(self, block: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``block`` is a flat uint8 tensor of at least ``nbytes``."""
        if block.dtype != torch.uint8 or block.dim() != 1 or block.numel() < self.nbytes:
            raise ValueError(f"block: expected a flat uint8 tensor of >= {self.nbytes} bytes, got {block.dtype} {tuple(block.shape)}")

    def views(self, block: torch.Tensor) -> dict[str, Any]:
        """``{"data": {column: view}, "indices": view, "weights": view, "mask": view or None}``."""
        self.check(block)
        out: dict[str, Any] = {"data": {}, "mask": None}
        wholes: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
        for kind, name in self.plan:
            view = _view(self, block, wholes, (kind, name))
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
        pairs = [(packed[k], v) for k, v in batch.data.items()]
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


def _view(layout: BlockLayout, block: torch.Tensor, wholes: dict[torch.dtype, tuple[torch.Tensor, int]], key: tuple[str, str]) -> torch.Tensor:
    """The tensor ``key`` of ``layout`` in ``block``: one ``as_strided`` of a view of the
    whole block as its dtype (made once per dtype, kept in ``wholes``). No slicing by
    ``block[...]``: torch's indexing is the dearest call of a hand-over."""
    dtype, shape, strides, at = layout.plan[key]
    got = wholes.get(dtype)
    if got is None:
        base = block if block.numel() == layout.nbytes else block.narrow(0, 0, layout.nbytes)
        whole = base.view(dtype)
        got = wholes[dtype] = (whole, int(whole.storage_offset()))
    return got[0].as_strided(shape, strides, got[1] + at)


class PackedBatch(Batch):
    """A :class:`~mmbuffer.Batch` whose tensors are views into one flat uint8 ``block``.

    Each view is made on first use (``batch["obs"]`` makes that column's only, ``data``
    all the columns'), so a training step that reads three of nine tensors pays for
    three on its thread. ``to(device)`` and ``pin_memory()`` move the block once and
    return a ``PackedBatch`` over the copy; pickling (a ``DataLoader`` worker's batch)
    sends the block and the layout, and the receiver makes the views it uses.
    """

    __slots__ = ("_data", "_made", "_wholes", "block", "layout")

    def __init__(
        self, block: torch.Tensor, layout: BlockLayout, written_at: np.ndarray | None = None, *, views: dict[str, Any] | None = None
    ) -> None:
        layout.check(block)
        self.block = block
        self.layout = layout
        self.written_at = written_at
        self._wholes: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
        self._made: dict[tuple[str, str], torch.Tensor | None] = {}
        self._data: dict[str, torch.Tensor] | None = None
        if views is not None:
            self._data = dict(views["data"])
            self._made.update({("indices", ""): views["indices"], ("weights", ""): views["weights"], ("mask", ""): views["mask"]})

    def _get(self, key: tuple[str, str]) -> torch.Tensor | None:
        """The view ``key`` (made now if not yet); None if the layout has no such tensor."""
        made = self._made
        if key in made:
            return made[key]
        if key not in self.layout.plan:
            return None
        view = made[key] = _view(self.layout, self.block, self._wholes, key)
        return view

    def _needed(self, kind: str) -> torch.Tensor:
        got = self._get((kind, ""))
        assert got is not None  # every layout has indices and weights
        return got

    def __getitem__(self, key: str) -> torch.Tensor:
        got = self._data[key] if self._data is not None else self._get(("data", key))
        if got is None:
            raise KeyError(key)
        return got

    @property
    def data(self) -> dict[str, torch.Tensor]:
        if self._data is None:
            self._data = {name: self[name] for kind, name in self.layout.plan if kind == "data"}
        return self._data

    @data.setter
    def data(self, value: dict[str, torch.Tensor]) -> None:
        self._data = value

    @property
    def indices(self) -> torch.Tensor:
        return self._needed("indices")

    @indices.setter
    def indices(self, value: torch.Tensor) -> None:
        self._made[("indices", "")] = value

    @property
    def weights(self) -> torch.Tensor:
        return self._needed("weights")

    @weights.setter
    def weights(self, value: torch.Tensor) -> None:
        self._made[("weights", "")] = value

    @property
    def mask(self) -> torch.Tensor | None:
        return self._get(("mask", ""))

    @mask.setter
    def mask(self, value: torch.Tensor | None) -> None:
        self._made[("mask", "")] = value

    def make_views(self) -> PackedBatch:
        """Make every view now, on this thread (a producer thread does, so that the
        consumer's thread has none left to make); returns ``self``."""
        for key in self.layout.plan:
            self._get(key)
        return self

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
