"""Stream sampled batches into training: sample and gather on a background thread.

``stream(buf, ...)`` returns a :class:`Stream`, an iterator of :class:`~mmbuffer.Batch`
whose next ``prefetch`` batches are sampled and gathered by one background thread
while the caller trains, so the gather (page faults, fancy indexing, the
``next_obs`` lookup) hides behind the training step. torch's kernels release the
GIL, so on two cores the two threads really run side by side.

Threading facts
---------------
* **One worker thread** per stream. It is the only user of ``generator``: the
  batches come out in the order ``buf.sample``/``buf.sample_slices`` would give
  them in a plain loop with the same generator state. Do not draw from that
  generator elsewhere while the stream runs; after the stream stops, the generator
  has advanced past up to ``prefetch + 1`` batches that were never delivered.
* **The buffer lock.** The worker samples under the buffer's re-entrant lock
  (:func:`buffer_lock`), which every ``Buffer`` method that reads or changes
  rows, index or tree also takes, so the training thread may keep writing
  (``extend``/``commit``) and reprioritizing (``update_priorities``) while the
  worker samples; each such call waits for at most one sample + gather (a few
  ms). Without the lock, an ``extend`` that wraps the ring tears slices being
  gathered and an ``update_priorities`` racing the tree descent draws
  zero-priority rows.
* **Priorities.** Batches already prefetched when ``update_priorities`` runs were
  drawn with the old priorities (at most ``prefetch + 1`` batches of lag); their
  importance weights are those of the old distribution. ``update_priorities``
  still applies to their rows (it ignores rows overwritten since the sample).
* **Shutdown.** ``close()`` (also ``with``-exit, ``break`` followed by the
  iterator's release, garbage collection, an exception in the loop once the
  stream is released, and interpreter exit) sets a stop event, drains the queue
  and joins the thread. The worker holds no reference to the :class:`Stream`, so
  dropping the last reference closes it. ``with mb.stream(...) as s:`` is the
  deterministic form.
* **Errors** raised in the worker (an empty store, a bad ``slice_len``) are
  re-raised by the ``next()`` that would have returned the failed batch.
* **Devices.** ``pin_memory=True`` pins each batch in the worker (page-locked
  memory needs an accelerator; without one it warns once and does not pin, as
  ``DataLoader`` does). ``device="cuda"`` pins as well (a ``non_blocking`` copy from
  pageable memory is synchronous) and issues the copy in the worker on a
  dedicated CUDA side stream, recording an event; the consumer makes its current
  stream wait on that event and marks the tensors as used on it
  (``record_stream``), so the copy overlaps the previous step's kernels and the
  caching allocator never reuses their memory early. Other devices are moved in
  the consumer thread with ``non_blocking=True``.
* **The GIL.** The worker's sampling is partly Python and partly numpy calls
  that hold the GIL; with CPython's default 5 ms switch interval a training
  thread that wants the GIL back (between two torch kernels) can wait up to 5 ms
  behind it, which on two cores cost ~35% of a 5 ms step. While a stream runs,
  the interpreter's switch interval is lowered to ``switch_interval`` (0.5 ms;
  ``sys.setswitchinterval``, process-wide) and restored when the last stream
  closes, unless something else changed it meanwhile; ``switch_interval=None``
  leaves it alone.
* **CPU threads.** Leave the worker a core: with as many torch intra-op threads
  as cores, OpenMP threads spin between kernels and starve it (online SAC on two
  cores: 26 s with 2 threads, 3.3 s with ``torch.set_num_threads(1)``).
* ``EpochSampler`` does not take the buffer lock: do not iterate one on a buffer
  that a running stream samples while the same process writes to it.

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
import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Self

import torch

from . import errors, samplers
from ._checks import check_int
from ._producer import Producer
from .gather import Batch, resolve_keys
from .samplers import Sampler

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

    Iterate it once (``for b in s``); ``close()`` stops the worker (idempotent).
    ``delivered`` counts the batches returned so far.
    """

    def __init__(
        self,
        draw: Callable[[], Batch],
        lock: threading.RLock,
        *,
        prefetch: int,
        num_batches: int | None,
        pin_memory: bool,
        device: torch.device | None,
        switch_interval: float | None = None,
    ) -> None:
        self.delivered = 0
        self._switch = False
        self._closed = False
        self._done = False
        self._device = device
        cuda = device is not None and device.type == "cuda"
        self._cuda = cuda
        side = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
        move = device if cuda else None
        # the worker gets everything it needs but never ``self``
        self._producer: Producer[tuple[Batch, Any]] = Producer(
            _batches(draw, lock, num_batches, pin_memory or cuda, move, side),
            depth=prefetch,
            name="mmbuffer-stream",
        )
        if switch_interval is not None:
            _SWITCH.acquire(switch_interval)
            self._switch = True
        self._producer.start()
        _LIVE.add(self)

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._closed or self._done:
            raise StopIteration
        try:
            batch, event = self._producer.get()
        except StopIteration:
            self._done = True
            self.close()
            raise
        except BaseException:
            if self._producer.failed:  # the worker's error (not, say, a KeyboardInterrupt here)
                self.close()
            raise
        if self._cuda:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(event)
            for t in _tensors(batch):
                t.record_stream(current)
        elif self._device is not None:
            batch = batch.to(self._device, non_blocking=True)
        self.delivered += 1
        return batch

    # -- shutdown ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker and wait for it; batches not yet delivered are dropped."""
        if self._closed:
            return
        self._closed = True
        self._producer.close(_JOIN_S)
        if self._switch:
            self._switch = False
            _SWITCH.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_producer", None) is not None:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"<mmbuffer.Stream {state}, delivered={self.delivered}, queued={self._producer.qsize()}>"


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
        Pin each batch in the worker (for asynchronous copies to an accelerator).
    device:
        Move each batch there with ``non_blocking=True``.
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
    if sampler is None:
        sampler = samplers.from_flags(slice_len, prioritized=prioritized, beta=beta, strict=strict)
    elif not isinstance(sampler, samplers.Sampler) or (slice_len, prioritized, beta, strict) != (None, False, 0.4, True):
        raise errors.InvalidArgumentError(
            f"sampler: expected an mb.samplers spec and no slice_len/prioritized/beta/strict flags, got sampler={sampler!r}, "
            f"slice_len={slice_len!r}, prioritized={prioritized!r}, beta={beta!r}, strict={strict!r}"
        )
    prefetch = check_int("prefetch", prefetch, 1)
    if num_batches is not None:
        num_batches = check_int("num_batches", num_batches, 0)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise errors.InvalidArgumentError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    sampler.check(buf)
    if switch_interval is not None and not (isinstance(switch_interval, (int, float)) and 0 < switch_interval):
        raise errors.InvalidArgumentError(f"switch_interval: expected seconds > 0 or None, got {switch_interval!r}")
    names = resolve_keys(buf, keys)
    dev = None if device is None else torch.device(device)
    if dev is not None and dev.type == "cuda":
        if not torch.cuda.is_available():
            raise errors.InvalidArgumentError(f"device: expected an available device, got {str(dev)!r} (CUDA is not available)")
        if dev.index is None:  # the caller's current device; a new thread's would be cuda:0
            dev = torch.device("cuda", torch.cuda.current_device())
    if pin_memory and not _can_pin():
        warnings.warn(
            "mmbuffer.stream: pin_memory=True but no accelerator is available; batches are not pinned",
            UserWarning,
            stacklevel=2,
        )
        pin_memory = False
    lock = buffer_lock(buf)
    # the unbound method: the worker's closure holds the buffer, not its wrappers
    draw = functools.partial(type(buf).sample, buf, batch_size, generator, keys=names, sampler=sampler)
    return Stream(
        draw, lock, prefetch=prefetch, num_batches=num_batches, pin_memory=pin_memory, device=dev,
        switch_interval=switch_interval,
    )


# -- the worker ----------------------------------------------------------------------------
def _batches(
    draw: Callable[[], Batch],
    lock: threading.RLock,
    num_batches: int | None,
    pin: bool,
    device: torch.device | None,
    side: Any,
) -> Iterator[tuple[Batch, Any]]:
    """Yield ``(Batch, event)`` (``event``: the CUDA copy's, else ``None``); run by the producer thread."""
    n = 0
    while num_batches is None or n < num_batches:
        with lock:
            batch = draw()
        event = None
        if pin:
            batch = batch.pin_memory()
        if device is not None:  # CUDA: copy on the side stream, hand over an event
            with torch.cuda.device(device), torch.cuda.stream(side):
                batch = batch.to(device, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(side)
        yield batch, event
        del batch
        n += 1


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


def _tensors(batch: Batch) -> list[torch.Tensor]:
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
