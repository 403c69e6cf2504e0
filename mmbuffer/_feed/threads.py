"""Background producer threads: run an iterator (or N workers) a bounded number of items ahead.

Both :mod:`mmbuffer._feed.stream` (sample and gather batches while the caller trains)
and the converters (read and checksum the source while the store is written)
overlap a producer with a consumer the same way; this module is that one way.
:class:`Pool` is the same with several threads whose items are numbered and
delivered in number order (the stream's parallel workers).

* The thread pulls items from ``source`` and puts them on a queue of ``depth``
  items, so the producer runs at most ``depth + 1`` items ahead.
* Before each item it looks at the stop event; a put blocked on a full queue
  looks at it every ``POLL_S`` seconds.
* An exception raised by the source is handed to the consumer and re-raised by
  :meth:`Producer.get`; the end of the source makes ``get`` raise
  :class:`StopIteration`.
* :meth:`Producer.close` sets the stop event, drops what is queued, joins the
  thread (unless called from it, or while the interpreter shuts down) and then
  closes the source (``source.close()``, a generator's ``GeneratorExit``) once
  the thread has left it.
* The thread holds references to the producer's queue, stop event and source
  only, never to the object that owns the :class:`Producer`, so that owner can
  be garbage collected (and close the producer) while the thread runs.

>>> p = Producer(iter(range(3)), depth=2, name="example")
>>> p.start()
>>> [p.get() for _ in range(3)]
[0, 1, 2]
>>> p.get()
Traceback (most recent call last):
    ...
StopIteration
>>> p.close()
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["POLL_S", "Exhausted", "Pool", "Producer"]

T = TypeVar("T")

#: How often a blocked producer or consumer looks at the stop event (seconds).
POLL_S = 0.05
_END = object()


class Producer(Generic[T]):
    """A daemon thread that runs ``source`` up to ``depth`` items ahead of :meth:`get`.

    Parameters
    ----------
    source
        The iterator to run in the thread (its ``close``, if any, is called by
        :meth:`close` once the thread has stopped).
    depth
        Items queued at most (``>= 1``).
    name
        The thread's name.
    """

    def __init__(self, source: Iterator[T], *, depth: int, name: str) -> None:
        self._source = source
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._closed = False
        #: Whether :meth:`get` has re-raised an exception of the source.
        self.failed = False
        self._thread = threading.Thread(
            target=_run, args=(source, self._queue, self._stop), name=name, daemon=True
        )

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def get(self) -> T:
        """The next item; re-raises the source's exception; ``StopIteration`` at its end.

        Also ``StopIteration`` when the thread is gone with nothing queued (it
        was stopped).
        """
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise StopIteration from None
        if item is _END:
            raise StopIteration
        exc, value = item
        if exc is not None:
            self.failed = True
            raise exc
        return value  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[T]:
        while True:
            try:
                item = self.get()
            except StopIteration:
                return
            yield item

    def qsize(self) -> int:
        """Items queued now."""
        return self._queue.qsize()

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread and wait for it (at most ``timeout`` seconds); idempotent.

        Items not yet taken are dropped. The source is closed only if the
        thread has left it (it is never closed while another thread runs it).
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        _drain(self._queue)
        thread = self._thread
        if thread.ident is not None and thread is not threading.current_thread() and not sys.is_finalizing():
            thread.join(timeout)
        _drain(self._queue)
        if not thread.is_alive():
            close = getattr(self._source, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> Producer[T]:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run(source: Iterator[Any], q: queue.Queue[Any], stop: threading.Event) -> None:
    """The thread: fill ``q`` with ``(None, item)``, then ``_END`` or ``(exc, None)``."""
    try:
        while not stop.is_set():
            try:
                item = next(source)
            except StopIteration:
                _put(q, _END, stop)
                return
            if not _put(q, (None, item), stop):
                return
            del item  # hold no reference while the next one is made
    except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
        _put(q, (exc, None), stop)


def _put(q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _drain(q: queue.Queue[Any]) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


class Exhausted(Exception):
    """Raised by a :class:`Pool`'s ``ticket()`` once ``limit`` numbers were handed out."""


class Pool(Generic[T]):
    """``workers`` daemon threads making numbered items; :meth:`get` returns them in number order.

    Each thread loops: wait until fewer than ``depth`` items are made or being
    made ahead of :meth:`get`, then call ``make(ticket, stop)``. ``make`` calls
    ``ticket()`` once, at the moment that fixes the item's place in the sequence
    (inside whatever lock orders its random draws), and returns the item; the
    item then gets that number. Items come out of :meth:`get` in number order,
    so several threads give the sequence one thread would.

    * ``ticket()`` raises :class:`Exhausted` once ``limit`` numbers were handed
      out; the thread then ends. :meth:`get` raises ``StopIteration`` after item
      ``limit - 1`` (or, with no limit, when every thread has ended).
    * An exception raised by ``make`` after its ticket is re-raised by the
      :meth:`get` that would have returned that item; one raised before (no
      number) by the next :meth:`get`. The thread that raised ends.
    * ``stop`` is set by :meth:`close`; ``make`` should look at it while it waits
      on anything but the lock its draws take. Exceptions raised once it is set
      are dropped.
    * Threads hold references to the shared state and to ``make`` only, never to
      the object that owns the :class:`Pool`.

    >>> import threading
    >>> order = threading.Lock()
    >>> def make(ticket, stop):
    ...     with order:
    ...         n = ticket()
    ...     return n * n
    >>> p = Pool(make, workers=3, depth=4, limit=5, name="example")
    >>> p.start()
    >>> [p.get() for _ in range(5)]
    [0, 1, 4, 9, 16]
    >>> p.get()
    Traceback (most recent call last):
        ...
    StopIteration
    >>> p.close()
    """

    def __init__(
        self,
        make: Callable[[Callable[[], int], threading.Event], T],
        *,
        workers: int,
        depth: int,
        limit: int | None,
        name: str,
    ) -> None:
        self._state = _PoolState(workers, depth, limit)
        self._closed = False
        #: Whether :meth:`get` has re-raised an exception of ``make``.
        self.failed = False
        self._threads = [
            threading.Thread(target=_work, args=(make, self._state), name=name, daemon=True) for _ in range(workers)
        ]

    def start(self) -> None:
        """Start the threads."""
        for t in self._threads:
            t.start()

    def get(self) -> T:
        """The next item in number order (blocks); see the class docstring for errors."""
        s = self._state
        with s.cond:
            while True:
                if s.limit is not None and s.delivered >= s.limit:
                    raise StopIteration
                if s.delivered in s.results:
                    exc, value = s.results.pop(s.delivered)
                    s.delivered += 1
                    s.credits.release()
                    if exc is not None:
                        self.failed = True
                        raise exc
                    return value  # type: ignore[no-any-return]
                if s.fatal is not None:
                    self.failed = True
                    raise s.fatal
                if s.running == 0:
                    raise StopIteration
                s.cond.wait(POLL_S)

    def qsize(self) -> int:
        """Items made and not yet taken."""
        with self._state.cond:
            return len(self._state.results)

    def close(self, timeout: float | None = None) -> None:
        """Stop the threads and wait for each (at most ``timeout`` seconds); idempotent.

        Items not yet taken are dropped."""
        if self._closed:
            return
        self._closed = True
        s = self._state
        s.stop.set()
        for t in self._threads:
            if t.ident is not None and t is not threading.current_thread() and not sys.is_finalizing():
                t.join(timeout)
        with s.cond:
            s.results.clear()


class _PoolState:
    def __init__(self, workers: int, depth: int, limit: int | None) -> None:
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.credits = threading.Semaphore(depth)
        self.limit = limit
        self.results: dict[int, tuple[BaseException | None, Any]] = {}
        self.issued = 0
        self.delivered = 0
        self.running = workers
        self.fatal: BaseException | None = None

    def ticket(self) -> int:
        with self.cond:
            if self.limit is not None and self.issued >= self.limit:
                raise Exhausted
            self.issued += 1
            return self.issued - 1


def _work(make: Callable[[Callable[[], int], threading.Event], Any], s: _PoolState) -> None:
    """A pool thread: make items until stopped, exhausted or failed."""
    try:
        while not s.stop.is_set():
            if not s.credits.acquire(timeout=POLL_S):
                continue
            number: list[int] = []

            def ticket() -> int:
                number.append(s.ticket())
                return number[0]

            try:
                item = make(ticket, s.stop)
            except Exhausted:
                return
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                if not s.stop.is_set():
                    with s.cond:
                        if number:
                            s.results[number[0]] = (exc, None)
                        elif s.fatal is None:
                            s.fatal = exc
                        s.cond.notify_all()
                return
            if not number:
                with s.cond:
                    s.fatal = s.fatal or RuntimeError("Pool: make() returned without taking a ticket")
                return
            with s.cond:
                if not s.stop.is_set():
                    s.results[number[0]] = (None, item)
                    s.cond.notify_all()
            del item  # hold no reference while the next one is made
    finally:
        with s.cond:
            s.running -= 1
            s.cond.notify_all()
