"""A refresh beside sampling: prepare the newer snapshot without the reader's lock, swap it in briefly.

A :class:`Refresher` runs one *prepare* at a time (fetch the pointer, mirror what
changed, open the new store: seconds) and *adopts* its result in a short swap under
the reader's lock, so samples read the old snapshot until the new one is ready.
``refresh(wait=True)`` prepares in the caller's thread (or waits for the prepare
running) and adopts; ``refresh(wait=False)`` starts the prepare in a background
thread and returns False at once; a later call adopts it (True) once ready. An
error of a background prepare is raised, as it was, by the next ``refresh`` call
(never lost); whatever it opened is closed. Two threads never both adopt one
prepare, and a prepare never overlaps another or an adoption. A prepare never takes the reader's lock
(so a thread holding it may wait for one). :meth:`close` waits for a running prepare,
closes its result and joins its thread.

>>> done = []
>>> r = Refresher(lambda: "v2", done.append, lambda v: None)
>>> r.refresh(wait=False), r.refresh(wait=True), done
(False, True, ['v2'])
>>> r.close()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .. import errors

__all__ = ["Refresher"]

P = TypeVar("P")
_RUNNING, _READY, _TAKEN = range(3)


class _Job(Generic[P]):
    """One prepare: its state, its value (None: nothing newer) or error, its thread."""

    def __init__(self) -> None:
        self.state = _RUNNING
        self.value: P | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None


class Refresher(Generic[P]):
    """Prepare with ``prepare() -> P | None`` (None: nothing newer), adopt with
    ``adopt(P)`` (it takes the reader's lock), close an unadopted one with ``discard(P)``."""

    def __init__(self, prepare: Callable[[], P | None], adopt: Callable[[P], None],
                 discard: Callable[[P], None]) -> None:
        self._prepare, self._adopt, self._discard = prepare, adopt, discard
        self._cond = threading.Condition()
        self._job: _Job[P] | None = None
        self._closed = False

    @property
    def busy(self) -> bool:
        """Whether a prepare is running or waits to be adopted."""
        return self._job is not None

    def refresh(self, wait: bool = True) -> bool:
        """Adopt a newer snapshot; return whether one was adopted (module docstring)."""
        if not isinstance(wait, bool):
            raise errors.InvalidArgumentError(f"wait: expected True or False, got {wait!r}")
        while True:
            with self._cond:
                if self._closed:
                    return False
                job, mine = self._job, self._job is None
                if job is None:
                    job = self._job = _Job()
                    if not wait:
                        job.thread = threading.Thread(target=self._run, args=(job,), name="mmbuffer-refresh",
                                                      daemon=True)
                        try:
                            job.thread.start()
                        except BaseException:
                            self._job = None  # no thread: nothing to wait for
                            raise
                        return False
            if mine:
                self._run(job)
            with self._cond:
                if not wait and job.state == _RUNNING:
                    return False
                while job.state == _RUNNING or (job.state == _TAKEN and self._job is job):
                    self._cond.wait()
                taken = job.state == _TAKEN or self._closed  # by another caller, or by close
                job.state = _TAKEN
            moved = False if taken else self._finish(job)
            if moved or mine:
                return moved
            # that prepare began before this call, or found nothing: look again now (wait=False: in the background)

    def _run(self, job: _Job[P]) -> None:
        try:
            job.value = self._prepare()
        except BaseException as exc:  # noqa: BLE001 - raised by the next refresh call
            job.error = exc
        with self._cond:
            job.state = _READY
            self._cond.notify_all()

    def _finish(self, job: _Job[P]) -> bool:
        """Adopt ``job``'s value, or raise its error (the caller took it)."""
        try:
            if job.error is not None:
                raise job.error
            if job.value is None:
                return False
            try:
                self._adopt(job.value)
            except BaseException:
                self._discard(job.value)
                raise
            return True
        finally:
            job.value = job.error = None
            with self._cond:
                self._job = None
                self._cond.notify_all()
            if job.thread is not None:
                job.thread.join()

    def close(self) -> None:
        """Wait for a running prepare, close its result, join its thread; later calls adopt nothing."""
        with self._cond:
            self._closed = True
            while self._job is not None and (self._job.state == _RUNNING or self._job.state == _TAKEN):
                self._cond.wait()
            job, self._job = self._job, None
            if job is not None:
                job.state = _TAKEN
            self._cond.notify_all()
        if job is None:
            return
        if job.thread is not None:
            job.thread.join()
        if job.value is not None:
            self._discard(job.value)
        job.value = job.error = None
