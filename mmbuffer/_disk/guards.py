"""Guards of the store's methods: the object lock, the writer's file lock, and the
``OSError`` of a full or read-only filesystem turned into typed errors."""

from __future__ import annotations

import errno
import fcntl
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from . import files as _files, safe_io as _safe_io
from .. import errors
from . import format as fmt

_F = TypeVar("_F", bound=Callable[..., Any])


class Closed:
    """What a closed object holds in place of its store: nothing mapped is kept; ``len()``
    and the names kept answer what the store held at close, any other use is an
    ``InvalidArgumentError`` naming the store (as a closed file's; setting one: ``ReadOnlyError``).

    >>> c = Closed.keeping("store /tmp/s", [1, 2, 3], ("count",))
    >>> len(c)
    3
    >>> c.index(2)
    Traceback (most recent call last):
    mmbuffer.errors.InvalidArgumentError: store /tmp/s is closed: expected an open buffer (open it again), got a call of index after close()
    """

    __slots__ = ("_kept", "_what")

    def __init__(self, what: str, kept: dict[str, Any] | None = None) -> None:
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_kept", kept or {})

    @classmethod
    def keeping(cls, what: str, store: Any, names: tuple[str, ...]) -> Closed:
        """A stand-in for ``store`` keeping ``len(store)`` and its ``names`` as they are now
        (none if the store cannot say: they raise then, as everything else)."""
        try:
            return cls(what, {"len": len(store), **{n: getattr(store, n) for n in names}})
        except Exception:  # noqa: BLE001 - a store broken by the failure its close reports
            return cls(what)

    def __getattr__(self, name: str) -> Any:
        if name in self._kept:
            return self._kept[name]
        raise errors.InvalidArgumentError(f"{self._what} is closed: expected an open buffer (open it again), got a call of {name} after close()")

    def __setattr__(self, name: str, value: Any) -> NoReturn:  # a write, as ``extend`` after close
        raise errors.ReadOnlyError(f"{name}: {self._what} is closed")

    def __len__(self) -> int:
        return int(self.__getattr__("len"))
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def locked(method: _F) -> _F:
    """Run a method under the object's re-entrant lock (samplers in a prefetch
    thread and writes in the training thread must not interleave)."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return guarded  # type: ignore[return-value]


def locked_write(what: str) -> Callable[[_F], _F]:
    """``locked``, and the ``OSError`` of a full or read-only filesystem raised as
    ``DiskFullError`` / ``ReadOnlyError`` naming the store (``_raise_typed``)."""

    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                try:
                    return method(self, *args, **kwargs)
                except OSError as exc:
                    raise_typed(exc, what, self.path)
                    raise

        return guarded  # type: ignore[return-value]

    return wrap


def acquire_lock(path: Path) -> int:
    fd = _safe_io.open_file(path, fmt.LOCK, os.O_RDWR | os.O_CREAT)  # never through a link
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise errors.LockedError(
            f"{path}: expected no other writer, got the lock held by {holder}; open with mode='r' to read"
        ) from None
    try:  # the owner's name is informative only, but a failure must not keep the lock
        os.ftruncate(fd, 0)
        os.pwrite(fd, _files.lock_owner().encode(), 0)
    except BaseException:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        raise
    return fd




def raise_typed(
    exc: OSError, what: str, path: Path, *, read_only_hint: str = "a store there can only be read: open it with mode='r'"
) -> None:
    """Raise ``exc`` as a ``DiskFullError`` or ``ReadOnlyError`` when it is one; else return
    (the caller re-raises it as it is)."""
    # a read-only mount can also reach us as another error (_safe_io's refusals name no errno)
    read_only = exc.errno in _READ_ONLY or (exc.errno is None and on_read_only_fs(path))
    if isinstance(exc, errors.MMBufferError) and not read_only:
        return
    where = f"{exc.strerror} ({exc.filename})" if exc.filename else str(exc.strerror or exc)
    if exc.errno in _NO_SPACE:
        raise errors.DiskFullError(
            exc.errno,
            f"{what}: store {path}: expected free disk space, got {where}; the store keeps its last "
            "state: free space and call it again",
        ) from exc
    if read_only:
        raise errors.ReadOnlyError(
            exc.errno or errno.EROFS,
            f"{what}: store {path}: expected a writable filesystem, got {where}; {read_only_hint}",
        ) from exc


def on_read_only_fs(path: Path) -> bool:
    """Whether ``path`` (or its nearest existing parent) is on a read-only mount."""
    for p in (path, *path.parents):
        try:
            return bool(os.statvfs(p).f_flag & os.ST_RDONLY)
        except OSError:
            continue
    return False
