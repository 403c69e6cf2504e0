"""Stream sampled batches into training: sample and gather on background threads.

``stream(buf, ...)`` returns a :class:`Stream`, an iterator of :class:`~mmbuffer.Batch`
whose next ``prefetch`` batches are sampled and gathered by ``workers`` background
threads while the caller trains, so the gather (page faults, copies, the
``next_obs`` lookup) hides behind the training step. torch's kernels release the
GIL, so on two cores the threads really run side by side.

The threading facts (workers and order, the buffer lock, priorities, shutdown, errors,
devices, the GIL, processes, CPU threads) are in ``docs/design.md``, "The stream:
threading facts" (``tests/feed/test_stream.py`` tests them).

>>> import tempfile, numpy as np, torch, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/s", {"obs": ((3,), "float32")}, capacity=100)
>>> buf.extend({"obs": np.random.rand(50, 3), "truncated": np.arange(50) % 10 == 9},
...            final_obs={"obs": np.zeros((5, 3))})
>>> with mb.stream(buf, 8, slice_len=4, num_batches=3) as batches:
...     shapes = [tuple(b["obs"].shape) for b in batches]
>>> shapes
[(8, 4, 3), (8, 4, 3), (8, 4, 3)]
"""

from __future__ import annotations

import atexit
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Self

import torch

from .. import errors, samplers
from .._disk.checks import check_int
from .processes import ProcessRing, check_processes
from .threads import Pool
from .blocks import BlockLayout, PackedBatch, Ring, read_into
from .._read import frames
from .._read.frames import Stacks
from .._read.gather import Batch, resolve_keys
from ..samplers import Sampler

__all__ = ["Stream", "buffer_lock", "stream"]

_JOIN_S = 30.0  # the longest close() waits for a worker in the middle of a sample
_LIVE: weakref.WeakSet[Stream] = weakref.WeakSet()


def buffer_lock(buf: Any) -> threading.RLock:
    """The re-entrant lock that serializes ``buf``'s sampling with its writes.

    Every ``Buffer`` method that reads or changes the index, the tree or the rows
    holds it (``store.locked``); the stream's worker holds it across sampling and
    gathering one batch.

    Examples
    --------
    >>> import tempfile, mmbuffer as mb
    >>> buf = mb.create(tempfile.mkdtemp() + "/l", {"x": ((), "int64")}, capacity=8, next_keys=())
    >>> buffer_lock(buf) is buffer_lock(buf)
    True
    >>> with buffer_lock(buf):  # re-entrant: the buffer's methods work inside
    ...     buf.extend({"x": [1, 2]})
    >>> len(buf)
    2
    """
    lock = getattr(buf, "lock", None)
    if not isinstance(lock, type(threading.RLock())):
        raise errors.InvalidArgumentError(f"buf: expected an mmbuffer Buffer, got {type(buf).__name__}")
    return lock


class Stream:
    """Iterator of prefetched batches; create it with :func:`stream`.

    Iterate it once (``for b in s``); ``close()`` stops the workers (idempotent).
    ``delivered`` counts the batches returned so far.
    """

    def __init__(
        self,
        source: Pool[tuple[Batch, Any]] | ProcessRing,
        *,
        device: torch.device | None,
        switch_interval: float | None = None,
    ) -> None:
        self.delivered = 0
        self._switch = False
        self._closed = False
        self._done = False
        self._device = device
        self._cuda = device is not None and device.type == "cuda"
        self._move = device is not None and not self._cuda
        # the workers get the maker (buffer, sampler, ring) but never ``self``
        self._pool = source
        if switch_interval is not None:
            _SWITCH.acquire(switch_interval)
            self._switch = True
        self._pool.start()
        _LIVE.add(self)

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._closed or self._done:
            raise StopIteration
        try:
            batch, event = self._pool.get()
        except StopIteration:
            self._done = True
            self.close()
            raise
        except BaseException:
            if self._pool.failed:  # a worker's error (not, say, a KeyboardInterrupt here)
                self.close()
            raise
        if event is not None:  # CUDA: wait for the copy; keep its memory until used here
            current = torch.cuda.current_stream(self._device)
            current.wait_event(event)
            for t in _storages(batch):
                t.record_stream(current)
        elif self._move:
            batch = batch.to(self._device, non_blocking=True)
        self.delivered += 1
        return batch

    # -- shutdown ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers and wait for them; batches not yet delivered are dropped."""
        if self._closed:
            return
        self._closed = True
        self._pool.close(_JOIN_S)
        if self._switch:
            self._switch = False
            _SWITCH.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"<mmbuffer.Stream {state}, delivered={self.delivered}, queued={self._pool.qsize()}>"


def stream(
    buf: Any,
    batch_size: int,
    slice_len: int | None = None,
    prioritized: bool = False,
    beta: float = 0.4,
    prefetch: int = 4,
    pin_memory: bool = False,
    device: str | torch.device | None = None,
    num_batches: int | None = None,
    generator: torch.Generator | None = None,
    strict: bool = True,
    keys: Iterable[str] | None = None,
    *,
    sampler: Sampler | None = None,
    switch_interval: float | None = 5e-4,
    workers: int | None = None,
    processes: int | None = None,
    stack: Mapping[str, int] | None = None,
    stack_pad: str = "first",
) -> Stream:
    """Sample and gather batches on a background thread, ``prefetch`` ahead.

    Each batch is ``buf.sample(batch_size, ...)`` (``slice_len=None``) or
    ``buf.sample_slices(batch_size, slice_len, strict, ...)``, drawn in order from
    ``generator``: the same generator state gives the same batches as those calls
    in a loop. See the module docstring for the thread, lock, priority and device
    rules.

    Parameters
    ----------
    buf:
        An open ``Buffer`` (writer or reader).
    batch_size:
        Transitions, or slices when ``slice_len`` is given.
    slice_len:
        None for transitions, else ``[batch_size, slice_len]`` windows.
    prioritized, beta:
        Sample by priority with importance exponent ``beta``.
    prefetch:
        Batches kept ready (the queue's bound), ``>= 1``.
    pin_memory:
        Gather each batch into one page-locked block (for asynchronous copies to
        an accelerator).
    device:
        Move each batch there: CUDA through a ring of pinned blocks and one copy
        per batch (threads: on a side stream; ``processes``: on the device's
        current stream), others with ``non_blocking=True``.
    num_batches:
        Stop after that many batches; None streams until ``close()``.
    generator:
        A ``torch.Generator`` used only by the worker.
    strict, keys:
        As in ``sample_slices`` / ``sample``.
    sampler:
        A spec of :mod:`mmbuffer.samplers` (then leave ``slice_len``,
        ``prioritized``, ``beta`` and ``strict`` at their defaults); the flags
        above are shorthands for one.
    switch_interval:
        Seconds; the interpreter's thread switch interval while the stream runs
        (lowered only, restored on close; see the module docstring), or None.
    workers:
        Threads making batches (default 1; 2 with ``device="cuda"``); more than
        one gather side by side, outside the buffer lock (see the module docstring).
    processes:
        Make batches in that many worker processes instead of threads (see
        "Processes" in the module docstring); leave ``workers`` and
        ``pin_memory`` unset.
    stack, stack_pad:
        Frame stacks, as in ``Buffer.sample`` (``mmbuffer._read.frames``).

    Returns
    -------
    Stream
        An iterator (and context manager) of :class:`~mmbuffer.Batch`.

    Raises
    ------
    InvalidArgumentError
        Bad sizes, unknown keys, ``prioritized`` on a store without priorities
        (at once, in the calling thread). Sampling errors (an empty store) are
        raised by ``next()``.

    Examples
    --------
    >>> import tempfile, numpy as np, torch, mmbuffer as mb
    >>> buf = mb.create(tempfile.mkdtemp() + "/r", {"obs": ((2,), "float32")}, capacity=64,
    ...                 priorities=mb.PriorityConfig())
    >>> buf.extend({"obs": np.random.rand(40, 2), "terminated": np.arange(40) % 8 == 7},
    ...            final_obs={"obs": np.zeros((5, 2))})
    >>> g = torch.Generator().manual_seed(0)
    >>> with mb.stream(buf, 16, prioritized=True, generator=g, num_batches=5) as s:
    ...     for b in s:
    ...         buf.update_priorities(b.indices, torch.rand(16))  # safe while the worker samples
    >>> s.delivered
    5
    """
    batch_size = check_int("batch_size", batch_size, 1)
    sampler = samplers.resolve(sampler, slice_len, prioritized=prioritized, beta=beta, strict=strict)
    prefetch = check_int("prefetch", prefetch, 1)
    if num_batches is not None:
        num_batches = check_int("num_batches", num_batches, 0)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise errors.InvalidArgumentError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    sampler.check(buf)
    if switch_interval is not None and not (isinstance(switch_interval, (int, float)) and 0 < switch_interval):
        raise errors.InvalidArgumentError(f"switch_interval: expected seconds > 0 or None, got {switch_interval!r}")
    names = resolve_keys(buf, keys)
    stacks = frames.check(stack, stack_pad, buf.columns)
    dev = None if device is None else torch.device(device)
    if dev is not None and dev.type == "cuda":
        if not torch.cuda.is_available():
            raise errors.InvalidArgumentError(f"device: expected an available device, got {str(dev)!r} (CUDA is not available)")
        if dev.index is None:  # the caller's current device; a new thread's would be cuda:0
            dev = torch.device("cuda", torch.cuda.current_device())
    if pin_memory and not _can_pin():
        warnings.warn(
            "mmbuffer._feed.stream: pin_memory=True but no accelerator is available; batches are not pinned",
            UserWarning,
            stacklevel=2,
        )
        pin_memory = False
    buffer_lock(buf)
    if processes is not None:
        processes = check_processes(buf, sampler, processes, workers=workers, pin=pin_memory, device=dev)
    if workers is None:
        workers = 2 if dev is not None and dev.type == "cuda" else 1
    workers = check_int("workers", workers, 1)
    if processes is not None:
        ring = ProcessRing(buf, sampler, batch_size, names, generator, processes=processes, prefetch=prefetch, limit=num_batches, device=dev,
                           stack=stacks)
        return Stream(ring, device=dev)  # no threads here: the switch interval stays as it is
    maker = _Maker(buf, sampler, batch_size, names, generator, workers=workers, pin=pin_memory, device=dev, stack=stacks)
    pool: Pool[tuple[Batch, Any]] = Pool(maker, workers=workers, depth=prefetch + 1, limit=num_batches, name="mmbuffer-stream")
    return Stream(pool, device=dev, switch_interval=switch_interval)


# -- the workers ---------------------------------------------------------------------------
class _Maker:
    """Makes one batch per call, in a pool thread: draw, gather, and for CUDA copy.

    Plain (no pinning, no CUDA): a :class:`~mmbuffer.Batch` as ``buf.sample``
    returns it. Pinned: a :class:`~mmbuffer._feed.blocks.PackedBatch` gathered into a
    fresh page-locked block. CUDA: gathered into a slot of a :class:`Ring` of
    pinned blocks (``workers + 1``), copied in one piece on the thread's side
    stream; the slot goes back to the ring with the copy's event, so it is refilled
    only once the copy has finished. The first batch fixes the block layout (until
    then batches are packed after the gather).
    """

    def __init__(
        self, buf: Any, sampler: Sampler, size: int, names: list[str], generator: torch.Generator | None,
        *, workers: int, pin: bool, device: torch.device | None, stack: Stacks | None = None,
    ) -> None:
        self.buf = buf
        self.stack = stack
        self.sampler = sampler
        self.size = size
        self.names = names
        self.generator = generator
        self.hold_lock = workers == 1  # one worker gathers under the lock, as buf.sample does
        self.device = device
        self.cuda = device is not None and device.type == "cuda"
        self.pin = pin or self.cuda
        self.slots = workers + 1
        self.layout: BlockLayout | None = None
        self.ring: Ring | None = None
        self._setup = threading.Lock()
        self._local = threading.local()

    def __call__(self, ticket: Callable[[], int], stop: threading.Event) -> tuple[Batch, Any]:
        if not self.pin:
            return self._read(ticket, None), None
        ring = self.ring
        if ring is None:
            block = None if self.layout is None else self.layout.empty(pin=True)
            batch = self._packed(self._read(ticket, block))
            return self._copy(batch) if self.cuda else (batch, None)
        slot = ring.acquire(stop)
        event = None
        try:
            batch = self._packed(self._read(ticket, ring.blocks[slot]))
            moved, event = self._copy(batch)
            return moved, event
        finally:
            ring.release(slot, event)

    def _read(self, ticket: Callable[[], int], block: torch.Tensor | None) -> Batch:
        return read_into(
            self.buf, self.sampler, self.size, self.names, self.generator,
            block=block, layout=self.layout, hold_lock=self.hold_lock, first_draw=ticket, stack=self.stack,
        )

    def _packed(self, batch: Batch) -> PackedBatch:
        """``batch`` itself if gathered into a block, else packed into a new pinned one."""
        if isinstance(batch, PackedBatch):
            return batch
        layout = BlockLayout.of(batch)
        with self._setup:
            if self.layout is None:
                self.layout = layout
                if self.cuda:
                    self.ring = Ring(layout.nbytes, self.slots, pin=True)
        return layout.pack(batch, layout.empty(pin=True))

    def _copy(self, batch: PackedBatch) -> tuple[PackedBatch, Any]:
        """One host-to-device copy on this thread's side stream, and its event."""
        side = getattr(self._local, "side", None)
        if side is None:
            side = self._local.side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        with torch.cuda.device(self.device), torch.cuda.stream(side):
            moved = batch.to(self.device, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(side)
        return moved.make_views(), event  # here, not on the training thread


class _SwitchInterval:
    """Process-wide: lower ``sys.setswitchinterval`` while any stream runs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.saved: float | None = None  # the value before the first stream lowered it
        self.ours: float | None = None  # the value we set

    def acquire(self, interval: float) -> None:
        with self.lock:
            self.users += 1
            current = sys.getswitchinterval()
            if interval < current:
                if self.saved is None:
                    self.saved = current
                sys.setswitchinterval(interval)
                self.ours = sys.getswitchinterval()

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0 and self.saved is not None:
                if sys.getswitchinterval() == self.ours:  # nobody changed it meanwhile
                    sys.setswitchinterval(self.saved)
                self.saved = self.ours = None


_SWITCH = _SwitchInterval()


def _storages(batch: Batch) -> list[torch.Tensor]:
    """One tensor per memory block of ``batch`` (a packed batch has one)."""
    if isinstance(batch, PackedBatch):
        return [batch.block]
    out = [*batch.data.values(), batch.indices, batch.weights]
    if batch.mask is not None:
        out.append(batch.mask)
    return out


def _can_pin() -> bool:
    accel = getattr(torch, "accelerator", None)
    if accel is not None:
        return bool(accel.is_available())
    return bool(torch.cuda.is_available())




@atexit.register
def _close_all() -> None:
    """Stop every live stream before the interpreter tears down daemon threads."""
    for s in list(_LIVE):
        s.close()
