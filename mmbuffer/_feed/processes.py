"""Producers in other processes: a shared ring of batch blocks, only slot numbers cross.

``mb.stream(buf, ..., processes=N)`` runs N worker processes (``spawn``; they
never touch CUDA). The main process creates one shared-memory file (in
``/dev/shm`` where it exists) holding ``slots`` blocks, one
:class:`~mmbuffer._feed.blocks.BlockLayout` block a batch (every tensor of a batch,
indices, weights and mask included, in one flat run of bytes) plus the batch's
lane cursors; with CUDA it page-locks the whole file once
(``cudaHostRegister``), so a block's ``.to("cuda", non_blocking=True)`` is one
asynchronous copy. The file is unlinked as soon as every worker has mapped it:
nothing is left in ``/dev/shm`` whatever happens next, and the memory is freed
when the last process unmaps it.

* **Workers.** Worker ``w`` opens the store read-only (``mb.open(path, "r")``),
  owns slots ``[w * k, (w + 1) * k)``, and for each batch takes a free slot,
  draws with its own generator, gathers straight into the slot's views and sends
  the slot number (one 4-byte frame) over its pipe. It sees the last commit only: rows a
  writer extended but did not commit are not streamed. It calls ``refresh()``
  when the main process hands back a slot with a newer generation of ``buf``
  (a writer in the main process committed) and every :data:`REFRESH_EVERY`
  batches (a writer elsewhere).
* **Order.** Batch ``i`` comes from worker ``i % N`` (round robin). Worker ``w``
  seeds its generator from one number drawn from the caller's ``generator`` (or
  torch's global generator) and ``w``: the same generator state gives the same
  batches.
* **Main process.** ``get`` receives the next slot from its worker; with CUDA it
  issues one copy of the block on the current stream of ``device`` (so the step
  that follows is ordered after it, as with ``batch.to(device, non_blocking=True)``
  in a loader loop) and records the slot's event, and the slot goes back to its
  worker once that event has passed (pending events are polled at every
  ``get``); without CUDA the block is copied out and the slot goes back at once.
  No threads. A CUDA ``get`` is a handful of calls (it runs on the training
  thread, between steps): at most one read of the pipe when the batch is ready (frames of
  :mod:`~mmbuffer._feed.pipes`, not ``Connection``'s), no stream or device
  context, no new event, and no views: the batch makes each on first use
  (:class:`~mmbuffer._feed.blocks.PackedBatch`).
* **Errors.** A worker's exception is re-raised by ``get`` (same type for
  mmbuffer's errors and builtin ones, with its message); a worker that died is a
  ``ChildProcessError``, never a hang.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/p", {"obs": ((3,), "float32")}, capacity=64)
>>> layout = layout_for(buf, mb.samplers.Slices(4), 8, ["obs", "next_obs"])
>>> [(e.kind, e.name, e.shape) for e in layout.entries]  # doctest: +NORMALIZE_WHITESPACE
[('data', 'obs', (8, 4, 3)), ('data', 'next_obs', (8, 4, 3)), ('indices', '', (8, 4)),
 ('weights', '', (8,)), ('mask', '', (8, 4))]
"""

from __future__ import annotations

import builtins
import contextlib
import json
import mmap
import os
import struct
import tempfile
import uuid
from collections import deque
from multiprocessing import connection, get_all_start_methods, get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import errors
from .._disk.checks import check_int
from .pipes import Inbox, send_message, send_number
from .threads import POLL_S
from .blocks import ALIGN, BlockLayout, PackedBatch, read_into
from .._read.frames import Stacks
from .._read.gather import Batch
from ..samplers import Sampler

__all__ = ["PREFIX", "REFRESH_EVERY", "ProcessRing", "check_processes", "layout_for"]

#: Worker ``refresh()`` period in batches (besides a newer generation of the caller's buffer).
REFRESH_EVERY = 100
#: Name prefix of the shared-memory files (``/dev/shm/<PREFIX><pid>-<random>``).
PREFIX = "mmbuffer-ring-"
_START_S = 120.0  # the longest a worker may take to start (spawn imports torch)
_JOIN_S = 5.0
_BACK = struct.Struct("<iq")  # slot handed back, generation of the caller's buffer


def layout_for(buf: Any, sampler: Sampler, size: int, names: list[str], stack: Stacks | None = None) -> BlockLayout:
    """The block layout of ``size``-item batches of ``names`` drawn with ``sampler``
    (and frame stacks ``stack``), from the schema alone (no draw)."""
    inner: Any = getattr(sampler, "sampler", sampler)  # Recent wraps a sampler
    rows = (size, int(inner.slice_len)) if sampler.slices else (size,)
    columns = buf.store.columns
    data = {}
    for name in names:
        col = columns[name.removeprefix("next_")]
        dtype = torch.from_numpy(np.empty(0, np.dtype(col.dtype))).dtype
        shape = tuple(col.shape) if stack is None else stack.shape(name, tuple(col.shape))
        data[name] = torch.empty((*rows, *shape), dtype=dtype)
    mask = torch.empty(rows, dtype=torch.bool) if sampler.slices else None
    return BlockLayout.of(Batch(data, torch.empty(rows, dtype=torch.int64), torch.empty(size, dtype=torch.float32), mask))


def check_processes(buf: Any, sampler: Sampler, processes: int, *, workers: int | None, pin: bool, device: torch.device | None) -> int:
    """``processes`` checked, and the options it cannot go with refused (typed errors)."""
    processes = check_int("processes", processes, 1)
    if workers is not None:
        raise errors.InvalidArgumentError(f"workers: expected None with processes={processes} (threads or processes, not both), got {workers!r}")
    if pin and (device is None or device.type != "cuda"):
        raise errors.InvalidArgumentError("pin_memory: expected False with processes (batches come back as copies; with device='cuda' the ring is page-locked), got True")
    if sampler.stateful:
        raise errors.InvalidArgumentError(f"sampler: expected a random sampler with processes (an epoch is not split over processes here), got {sampler!r}")
    if not Path(str(buf.path)).is_dir():
        raise errors.InvalidArgumentError(f"processes: expected a buffer of a local store (the workers open its path), got path {str(buf.path)!r}")
    return processes


class ProcessRing:
    """``processes`` worker processes filling a shared ring; :meth:`get` returns
    ``(batch, event or None)`` in round-robin order (see the module docstring).

    The same interface as :class:`~mmbuffer._feed.threads.Pool` (``start``, ``get``,
    ``close``, ``qsize``, ``failed``), so :class:`~mmbuffer.Stream` drives either.
    """

    def __init__(
        self, buf: Any, sampler: Sampler, size: int, names: list[str], generator: torch.Generator | None,
        *, processes: int, prefetch: int, limit: int | None, device: torch.device | None, stack: Stacks | None = None,
    ) -> None:
        self.failed = False
        self._closed = True  # until start() has set everything up
        self._buf = buf
        self._device = device
        self._cuda = device is not None and device.type == "cuda"
        self._limit = limit
        self._delivered = 0
        self.layout = layout_for(buf, sampler, size, names, stack)
        lanes = len(buf.reservation())
        self._cursor_at = -(-self.layout.nbytes // ALIGN) * ALIGN
        self._lanes = lanes
        self._slot_bytes = -(-(self._cursor_at + 8 * lanes) // mmap.PAGESIZE) * mmap.PAGESIZE
        self._per = max(2, -(-prefetch // processes) + 1)  # slots per worker
        self._n = processes
        base = int(torch.randint(0, 2**62, (1,), generator=generator).item())
        seeds = np.random.SeedSequence(base).spawn(processes)
        self._seeds = [int(s.generate_state(1, np.uint64)[0]) for s in seeds]
        self._args = (str(buf.path), sampler, size, names, limit, stack)
        self._pending: deque[int] = deque()  # slots whose copies are in flight (their events: ``_events``)
        self._path: Path | None = None
        self._procs: list[Any] = []
        self._conns: list[Any] = []  # the pipes (their descriptors carry frames: ``pipes``)
        self._inboxes: list[Inbox] = []
        self._registered: int | None = None
        self._map: mmap.mmap | None = None
        self._memory: torch.Tensor | None = None
        self._blocks: list[torch.Tensor] = []
        self._cursors: list[np.ndarray] = []
        self._events: list[Any] = []  # CUDA: one event per slot, recorded after its copy

    # -- start ---------------------------------------------------------------------------
    def start(self) -> None:
        """Create and map the ring, start the workers, wait until each has mapped it."""
        shm = Path("/dev/shm")
        folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        path = folder / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        total = self._slot_bytes * self._per * self._n
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._path = path
        self._closed = False
        try:
            try:
                os.ftruncate(fd, total)
                self._map = mmap.mmap(fd, total)
            finally:
                os.close(fd)
            memory = self._memory = torch.frombuffer(self._map, dtype=torch.uint8)
            if self._cuda:
                self._pin(memory, total)
            starts = [s * self._slot_bytes for s in range(self._per * self._n)]
            self._blocks = [memory[at : at + self.layout.nbytes] for at in starts]
            cursors = [at + self._cursor_at for at in starts]
            self._cursors = [memory[at : at + 8 * self._lanes].view(torch.int64).numpy() for at in cursors]
            if self._cuda:
                self._events = [torch.cuda.Event() for _ in starts]  # type: ignore[no-untyped-call]
            self._spawn()
            for w in range(self._n):
                msg = self._receive(w, _START_S)
                if msg != b"R":
                    self._decode(w, msg)  # the worker's error, re-raised here
                    raise ChildProcessError(f"worker process {w}: expected a ready message, got {msg!r}")
        except BaseException:
            self.close()
            raise
        finally:
            self._unlink()

    def _pin(self, memory: torch.Tensor, total: int) -> None:
        ptr = memory.data_ptr()
        code = torch.cuda.cudart().cudaHostRegister(ptr, total, 0)  # type: ignore[no-untyped-call]
        if int(code) != 0:
            raise errors.InvalidArgumentError(f"device: expected host memory CUDA can page-lock, got cudaHostRegister error {code}")
        self._registered = ptr

    def _spawn(self) -> None:
        ctx = _context()
        path, sampler, size, names, limit, stack = self._args
        for w in range(self._n):
            mine, theirs = ctx.Pipe()
            quota = None if limit is None else limit // self._n + (1 if w < limit % self._n else 0)
            slots = list(range(w * self._per, (w + 1) * self._per))
            spec = (path, sampler, size, names, self.layout, str(self._path), self._slot_bytes, self._cursor_at, self._lanes,
                    slots, self._seeds[w], quota, int(self._buf.generation), stack)
            p = ctx.Process(target=_work, args=(spec, theirs), name=f"mmbuffer-stream-proc{w}", daemon=True)
            self._conns.append(mine)
            os.set_blocking(mine.fileno(), False)  # the training thread reads what has arrived, never waits in a read
            self._inboxes.append(Inbox(mine.fileno()))
            p.start()
            theirs.close()
            self._procs.append(p)

    # -- the consumer's side ---------------------------------------------------------------
    def get(self) -> tuple[Batch, Any]:
        """The next batch in round-robin order (blocks); see the module docstring for errors."""
        if self._closed or (self._limit is not None and self._delivered >= self._limit):
            raise StopIteration
        w = self._delivered % self._n
        while True:
            self._reclaim()
            frame = self._take(w)  # the usual case: the batch is ready, one read
            if frame is not None:
                break
            mine = [slot for slot in self._pending if slot // self._per == w]
            if len(mine) == self._per:  # every slot of w is still being copied: wait for the oldest
                self._events[mine[0]].synchronize()
                continue
            if connection.wait([self._conns[w], self._procs[w].sentinel], POLL_S):
                frame = self._receive(w, None)  # a frame, or the worker ended: _receive tells which
                break
        slot = self._decode(w, frame)
        written = self._cursors[slot].copy()
        self._delivered += 1
        if not self._cuda:
            batch = PackedBatch(self._blocks[slot].clone(), self.layout, written)
            self._give_back(slot)
            return batch, None
        moved = self._blocks[slot].to(self._device, non_blocking=True)  # on the device's current stream
        self._events[slot].record(torch.cuda.current_stream(self._device))
        self._pending.append(slot)
        return PackedBatch(moved, self.layout, written), None

    def _receive(self, w: int, timeout: float | None) -> int | bytes:
        """The next frame of worker ``w`` (waits); ``ChildProcessError`` if it died first."""
        proc = self._procs[w]
        waited = 0.0
        while True:
            frame = self._take(w)
            if frame is None and not proc.is_alive():
                frame = self._take(w)  # what it sent just before it ended
                if frame is None:
                    self.failed = True
                    raise ChildProcessError(f"mmbuffer._feed.stream: worker process {w} (pid {proc.pid}) exited with code {proc.exitcode}")
            if frame is not None:
                return frame
            if timeout is not None and waited >= timeout:
                raise ChildProcessError(f"mmbuffer._feed.stream: worker process {w} did not start within {timeout:.0f} s")
            connection.wait([self._conns[w], proc.sentinel], POLL_S)
            waited += POLL_S

    def _take(self, w: int) -> int | bytes | None:
        """Worker ``w``'s next frame if it has arrived, else None (never blocks)."""
        try:
            return self._inboxes[w].take()
        except (EOFError, OSError):
            proc = self._procs[w]
            self.failed = True
            raise ChildProcessError(f"mmbuffer._feed.stream: worker process {w} (pid {proc.pid}) closed its pipe (exit code {proc.exitcode})") from None

    def _decode(self, w: int, msg: int | bytes) -> int:
        if isinstance(msg, int):
            return msg
        self.failed = True
        if msg[:1] == b"E":
            kind, text = json.loads(msg[1:].decode())
            cls = getattr(errors, kind, None) or getattr(builtins, kind, None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                try:
                    raise cls(text)
                except TypeError:
                    pass
            raise ChildProcessError(f"worker process {w}: {kind}: {text}")
        raise ChildProcessError(f"worker process {w}: expected a slot number, got {msg!r}")

    def _reclaim(self) -> None:
        """Hand back the slots whose copies have finished, oldest first."""
        while self._pending and self._events[self._pending[0]].query():
            self._give_back(self._pending.popleft())

    def _give_back(self, slot: int) -> None:
        try:
            send_message(self._inboxes[slot // self._per].fd, _BACK.pack(slot, int(self._buf.generation)))
        except OSError:
            pass  # the worker is gone; the next get() from it says so

    def qsize(self) -> int:
        """Workers with a batch ready now (each counted once)."""
        if self._closed:
            return 0
        return sum(1 for box, c in zip(self._inboxes, self._conns, strict=True) if box.has_frame() or c.poll(0))

    # -- shutdown --------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Stop the workers (closing their pipes; terminating stragglers), wait for the
        copies in flight, unpin and unmap the ring; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._inboxes = []  # their descriptors close with the pipes: nothing may write to a reused number
        for c in self._conns:
            c.close()
        for p in self._procs:
            p.join(_JOIN_S if timeout is None else min(timeout, _JOIN_S))
            if p.is_alive():
                p.terminate()
                p.join(_JOIN_S)
            if p.is_alive():
                p.kill()
                p.join()
        for slot in self._pending:
            self._events[slot].synchronize()
        self._pending.clear()
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)  # type: ignore[no-untyped-call]
            self._registered = None
        self._blocks = []
        self._cursors = []
        self._memory = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still alive somewhere: unmapped with it
                self._map.close()
        self._unlink()

    def _unlink(self) -> None:
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None


#: Modules the forkserver imports once; ``warm`` loads the kernels there, so that no
#: worker loads them itself. The forkserver ignores a name it cannot import.
PRELOAD = (__name__, f"{__package__}.warm")


def _context() -> Any:
    """``forkserver`` (workers fork from a server process that has imported this
    module once: ~0.1 s a worker instead of a fresh interpreter importing torch),
    else ``spawn``. Neither inherits CUDA state."""
    if "forkserver" in get_all_start_methods():
        ctx = get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        return ctx
    return get_context("spawn")


# -- the worker process ------------------------------------------------------------------------
def _work(spec: tuple[Any, ...], conn: Any) -> None:
    """A worker: map the ring, open the store, fill free slots until the pipe closes."""
    (path, sampler, size, names, layout, ring, slot_bytes, cursor_at, lanes, slots, seed, quota, generation, stack) = spec
    torch.set_num_threads(1)
    try:
        from ..opening import open as open_store

        with open(ring, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), 0)
        memory = torch.frombuffer(mapped, dtype=torch.uint8)
        blocks = {s: memory[s * slot_bytes : s * slot_bytes + layout.nbytes] for s in slots}
        cursors = {s: memory[s * slot_bytes + cursor_at : s * slot_bytes + cursor_at + 8 * lanes].view(torch.int64).numpy() for s in slots}
        buf = open_store(path, mode="r")
        fd = conn.fileno()
        inbox = Inbox(fd)  # a blocking descriptor here: take() waits for data
        send_message(fd, b"R")
        free = deque(slots)
        g = torch.Generator().manual_seed(seed)
        made = 0
        first = True
        while quota is None or made < quota:
            while not free or inbox.has_frame() or conn.poll(0):
                back = inbox.take()
                if not isinstance(back, bytes):  # part of a frame: the next read waits for the rest
                    continue
                slot, newest = _BACK.unpack(back)
                free.append(slot)
                if newest > generation:
                    generation = newest
                    buf.refresh()
            if made and made % REFRESH_EVERY == 0:
                buf.refresh()
            slot = free.popleft()
            if first:  # check the layout computed from the schema against a real batch
                batch = read_into(buf, sampler, size, names, g, stack=stack)
                if not layout.matches(batch):
                    raise errors.InvalidArgumentError(
                        f"processes: expected batches of layout {layout.entries}, got {BlockLayout.of(batch).entries}"
                    )
                layout.pack(batch, blocks[slot])
                first = False
            else:
                batch = read_into(buf, sampler, size, names, g, block=blocks[slot], layout=layout, stack=stack)
                if not isinstance(batch, PackedBatch):
                    raise errors.InvalidArgumentError(f"processes: expected items of shape {layout.rows_shape}, got {tuple(batch.indices.shape)}")
            cursors[slot][:] = batch.written_at
            send_number(fd, slot)
            made += 1
            del batch
        while True:  # quota made: wait until the main process closes the pipe
            inbox.take()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return
    except BaseException as exc:  # noqa: BLE001 - sent to the main process, re-raised there
        try:
            send_message(conn.fileno(), b"E" + json.dumps([type(exc).__name__, str(exc)]).encode())
        except OSError:
            pass

