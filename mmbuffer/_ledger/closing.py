"""Writers still open at interpreter exit are closed as ``close()`` closes them.

A script that ends without ``with`` or ``close()`` (normally, by ``sys.exit``, or
by an uncaught exception) would otherwise leave its store as a crash does: the
rows extended since the last commit lost, and the next open recovering. So every
writer registers here (:func:`register`, a weak reference: a buffer that was
garbage-collected is never kept alive, and its writer has released its lock) and
one ``atexit`` handler closes those still open: it commits what changed, lowers
the reservation and releases the lock, so the next open has nothing to recover.
When rows (or priorities) were committed this way it says so on stderr, naming the
store: a ``ResourceWarning`` would be hidden by Python's default filters, and a
commit the program did not ask for is something its user should see.

Only the process that opened a writer closes it (a forked child inherits the
object, not the right to commit). A writer whose lock another thread holds at exit
(a daemon thread in the middle of a sample) gets ``EXIT_WAIT_S`` to let go; if it
does not, the writer is left as a crash leaves it, and stderr says so.

Signals: no handler is installed. SIGKILL cannot be caught, and SIGTERM's default
action ends the process without running ``atexit`` handlers; either leaves the
store as a crash does, which loses only what was not committed (``writer.py``,
"Recovery"). A program that wants SIGTERM to commit can turn it into a normal exit,
``signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))``; mmbuffer does not do
it for the program, because replacing a handler the program or its framework
(a launcher, a job scheduler's wrapper) installed is not a library's call.
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from pathlib import Path
from collections.abc import Callable
from typing import Any, Final, Protocol


class Writer(Protocol):
    """What closing needs of ``writer.Writer`` (named here: writer imports this module)."""

    path: Path
    store: Any

    @property
    def is_open(self) -> bool: ...

    def has_changes(self) -> bool: ...

    def close(self) -> None: ...

    def release(self) -> None: ...


EXIT_WAIT_S: Final = 10.0  # how long exit waits for a thread holding a writer's lock
_open: weakref.WeakKeyDictionary[Writer, int] = weakref.WeakKeyDictionary()  # writer -> the pid that opened it
#: owner -> (what to call before any writer closes, the pid that registered it)
_first: weakref.WeakKeyDictionary[Any, tuple[Callable[[], None], int]] = weakref.WeakKeyDictionary()
_registered = False


def _at_exit() -> None:
    global _registered
    if not _registered:
        atexit.register(close_open_writers)
        _registered = True


def register(writer: Writer) -> None:
    """Close ``writer`` at interpreter exit if it is still open then (weakly held)."""
    _at_exit()
    _open[writer] = os.getpid()


def close_first(owner: Any, close: Callable[[], None]) -> None:
    """At interpreter exit, while ``owner`` lives, call ``close`` before any writer is
    closed: an integration that holds steps in memory (``mmbuffer.sb3``) writes them
    through its writer while it is still open. ``close`` must not refer to ``owner``."""
    _at_exit()
    _first[owner] = (close, os.getpid())


def close_open_writers() -> None:
    """Close every registered writer of this process that is still open (the
    ``atexit`` handler; never raises), after the :func:`close_first` callbacks."""
    for owner, (close, pid) in list(_first.items()):
        if pid == os.getpid():
            try:
                close()
            except BaseException as exc:  # noqa: BLE001 - exit goes on; say what happened
                _say(f"closing {type(owner).__name__} at interpreter exit failed ({type(exc).__name__}: {exc})")
    for writer, pid in list(_open.items()):
        if pid == os.getpid():
            _close(writer)


def _close(writer: Writer) -> None:
    lock = writer.store.lock
    if not lock.acquire(timeout=EXIT_WAIT_S):
        _say(f"{writer.path}: not closed at interpreter exit: another thread held it for {EXIT_WAIT_S:g} s; "
             "the rows extended since the last commit are lost (the next open recovers)")
        return
    try:
        if not writer.is_open:
            return
        ledger = writer.store.ledger
        rows = sum(now.written - was.written for now, was in zip(ledger.lanes, ledger.committed))
        changed = writer.has_changes()
        writer.close()
        if changed:
            _say(f"{writer.path}: the writer was not closed; closing it at interpreter exit committed "
                 f"{rows} extended rows (generation {writer.store.generation}). Call close() or use `with`.")
    except BaseException as exc:  # noqa: BLE001 - exit goes on; say what happened
        writer.release()
        _say(f"{writer.path}: closing at interpreter exit failed ({type(exc).__name__}: {exc}); "
             "the rows extended since the last commit are lost (the next open recovers)")
    finally:
        lock.release()


def _say(message: str) -> None:
    try:
        sys.stderr.write(f"mmbuffer: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # stderr closed or gone at exit
        pass
