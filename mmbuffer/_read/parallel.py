"""Helper threads for one gather: run the same GIL-free kernel over parts of a batch.

A batch of slices is thousands of short runs scattered over the store; one thread
waits on each run's first cache miss in turn, and a second thread copying other runs
can overlap those waits where its core brings memory parallelism of its own (on the
2-core dev VM it brought none: ``benchmarks/HISTORY.md``). ``share``
offers a call to helper threads; the kernel (``kernels/split.py``) hands out its
runs a chunk at a time to whichever thread asks next, so a helper that wakes late
on a loaded machine takes only what is left, and the caller never waits for a
helper that has not begun. Whether a call is offered at all is learnt from the
times of the last calls of its size (``Chooser``): where a helper does not make
the call faster (other cores busy, or memory shared) it only adds its hand-off, and
the gather stays on one thread.

How many threads a gather uses (``threads``): ``MMBUFFER_GATHER_THREADS`` (default
2), never more than ``torch.get_num_threads()`` or ``NUMBA_NUM_THREADS`` when set,
so a process that asked torch or numba for one thread (a ``DataLoader`` worker, an
``mb.stream`` process) gathers on one. ``MMBUFFER_GATHER_THREADS=1`` turns it off.

The helper threads are daemons started on first use, one set per process (a forked
child starts its own), serving the calls of every thread in turn.

>>> out = np.zeros(10, np.int64)
>>> def fill(out, shared, chunk):  # claims chunks as the compiled kernels do (atomically; this sketch alone)
...     while (k := int(shared[0])) * chunk < len(out):
...         shared[0] += 1
...         out[k * chunk : (k + 1) * chunk] = 1
>>> share(fill, (out,), 0, 10, 80)
>>> out.tolist()
[1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..kernels import load

__all__ = ["CHOOSER", "Chooser", "share", "threads"]


def _env_threads(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


_MAX = _env_threads("MMBUFFER_GATHER_THREADS", 2)
_NUMBA = _env_threads("NUMBA_NUM_THREADS", _MAX)


def threads() -> int:
    """Threads one gather may use now (see the module's docstring)."""
    return min(_MAX, _NUMBA, torch.get_num_threads())


class _Job:
    """One call offered to the helpers: each that enters it puts one item on ``done``."""

    __slots__ = ("args", "done", "errors", "kernel", "shared")

    def __init__(self, kernel: Callable[..., Any], args: tuple[Any, ...], shared: np.ndarray) -> None:
        self.kernel, self.args, self.shared = kernel, args, shared
        self.done: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.errors: list[BaseException] = []


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    split = load("split")
    while True:
        job = jobs.get()
        if not split.enter(job.shared):  # the caller has finished: nothing left
            continue
        try:
            job.kernel(*job.args)
        except BaseException as e:  # raised again in the caller
            job.errors.append(e)
        finally:
            job.done.put(None)


_JOBS: dict[int, tuple[queue.SimpleQueue[_Job], list[threading.Thread]]] = {}  # by process id (a forked child has no threads)


def _helpers(count: int) -> queue.SimpleQueue[_Job]:
    pid = os.getpid()
    found = _JOBS.get(pid)
    if found is None:
        _JOBS.clear()
        found = _JOBS[pid] = (queue.SimpleQueue(), [])
    jobs, threads_ = found
    while len(threads_) < count:
        thread = threading.Thread(target=_serve, args=(jobs,), name=f"mmbuffer-gather-{len(threads_) + 1}", daemon=True)
        thread.start()
        threads_.append(thread)
    return jobs


class Chooser:
    """Whether to offer a call to the helpers, learnt from the calls' times: per size
    class (bytes to a power of two), the median seconds per byte of the last
    ``keep`` calls on one thread and offered to helpers; the faster is used, and
    every ``probe``-th call of a class tries the other, so a machine that gets busy
    (its other cores taken: a helper then only adds its wake-up and a wait) or
    quiet again is followed within a few dozen calls. The result does not depend on
    the choice (``kernels/split.py``); only the time does.

    >>> c = Chooser(keep=4, probe=8)
    >>> [c.offer(1 << 20) for _ in range(2)]  # no times yet: each way in turn
    [True, False]
    >>> for _ in range(4):
    ...     c.record(1 << 20, True, 1e-3); c.record(1 << 20, False, 2e-3)
    >>> c.offer(1 << 20)
    True
    """

    def __init__(self, keep: int = 7, probe: int = 64) -> None:
        self.keep, self.probe = keep, probe
        self._times: dict[tuple[int, bool], list[float]] = {}
        self._calls: dict[int, int] = {}

    def offer(self, nbytes: int) -> bool:
        size = nbytes.bit_length()
        calls = self._calls[size] = self._calls.get(size, 0) + 1
        shared, alone = self._times.get((size, True), ()), self._times.get((size, False), ())
        if len(shared) < 3 or len(alone) < 3:  # too few times yet: each way in turn
            return calls % 2 == 1
        faster = sorted(shared)[len(shared) // 2] < sorted(alone)[len(alone) // 2]
        return faster != (calls % self.probe == 0)

    def record(self, nbytes: int, offered: bool, seconds: float) -> None:
        times = self._times.setdefault((nbytes.bit_length(), offered), [])
        times.append(seconds / max(nbytes, 1))
        if len(times) > self.keep:
            del times[0]


CHOOSER = Chooser()


def share(kernel: Callable[..., Any], args: tuple[Any, ...], helpers: int, count: int, nbytes: int) -> None:
    """``kernel(*args, shared, chunk)`` on this thread, offered to ``helpers`` helper
    threads too when ``CHOOSER`` finds that pays for calls of ``nbytes``: the kernel
    claims chunks of ``count`` items through ``shared`` (a chunk an eighth of a
    thread's share when offered, all at once when not) and returns when none is left
    (``kernels/split.py``). Returns once every helper that entered has finished; a
    helper's exception is raised here."""
    shared = np.zeros(2, np.int64)
    if helpers <= 0:
        kernel(*args, shared, max(count, 1))
        return
    offered = CHOOSER.offer(nbytes)
    start = time.perf_counter()
    if not offered:
        kernel(*args, shared, max(count, 1))
        CHOOSER.record(nbytes, False, time.perf_counter() - start)
        return
    chunk = max(1, -(-count // (8 * (helpers + 1))))
    job = _Job(kernel, (*args, shared, chunk), shared)
    jobs = _helpers(helpers)
    for _ in range(helpers):
        jobs.put(job)
    try:
        kernel(*args, shared, chunk)
    finally:
        for _ in range(load("split").close(shared)):
            job.done.get()
    CHOOSER.record(nbytes, True, time.perf_counter() - start)
    if job.errors:
        raise job.errors[0]
