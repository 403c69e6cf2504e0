"""Files of a store that are not arrays: JSON read without following links, written
atomically (``.partial``, fsync, rename, fsync the directory), a store directory
renamed into place without replacing anything, and disk blocks reserved before a
memory map writes into them (a full disk is then an ``OSError``, never a SIGBUS).

>>> import tempfile
>>> from pathlib import Path
>>> d = Path(tempfile.mkdtemp())
>>> atomic_write_json(d / "x.json", {"a": 1})
>>> read_json_in(d, "x.json")
{'a': 1}
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import mmap
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from . import safe_io as _safe_io
from .. import errors

_AT_FDCWD: Final = -100
_RENAME_NOREPLACE: Final = 1


def read_json_in(root: Path, rel: str) -> Any:
    """Parse JSON file ``root/rel`` of a store, opened without following links."""
    return parse_json(_safe_io.read_bytes(root, rel), root / rel)


def parse_json(data: bytes, where: object, limit: int | None = None) -> Any:
    """JSON from untrusted bytes; ``CorruptStoreError`` naming ``where`` when there are
    more than ``limit`` bytes, or they are not valid JSON (bad UTF-8, absurd nesting)."""
    if limit is not None and len(data) > limit:
        raise errors.CorruptStoreError(f"{where}: expected at most {limit} bytes, got more")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise errors.CorruptStoreError(f"{where}: not valid JSON ({exc})") from None


def atomic_write_json(path: Path, obj: Any, *, durable: bool = True, before_rename: Callable[[], object] | None = None) -> None:
    """Write JSON to ``path.partial``, fsync, rename over ``path``, fsync the directory.
    ``before_rename`` runs between the fsync and the rename (a commit's last durable
    writes: a full disk has refused the JSON by then, before anything else changed).

    The ``.partial`` file is created afresh (``O_EXCL | O_NOFOLLOW``, after
    unlinking whatever was there), so a link planted under that name is replaced,
    never written through; it is removed again if the write fails (disk full),
    and an ``OSError`` that names no file is raised again naming ``path``.
    """
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    tmp = path.name + ".partial"
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise errors.CorruptStoreError(f"{path.parent / tmp}: expected a file or nothing, cannot remove it ({exc.strerror})") from None
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if before_rename is not None:
                before_rename()
            os.rename(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException as exc:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            if type(exc) is OSError and exc.filename is None:  # os.write names no file
                raise OSError(exc.errno, exc.strerror, str(path)) from exc
            raise
        if durable:
            os.fsync(dfd)
    finally:
        os.close(dfd)


def fsync_dir(path: Path) -> None:
    """fsync directory ``path``: the names created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_in(root: Path, rel: str) -> None:
    """fsync file ``root/rel`` (opened without following links) if it exists: what
    zarr-python wrote there is durable once its directories are synced too (a file
    zarr removed, a chunk equal to the fill value, needs only those)."""
    if _safe_io.lexists(root, rel):
        fd = _safe_io.open_file(root, rel, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (links are not followed), deepest
    first, ``root`` last: a directory built in place (``create``) is durable before it
    is renamed into view. O(files); sparse files cost only their written blocks."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def lock_owner() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def reserve_rows(fd: int, row_bytes: int, start: int, stop: int) -> None:
    """Allocate the disk blocks under rows ``[start, stop)`` of the raw array file ``fd``.

    A store through a memory map into a hole of a sparse file needs a block at
    page-fault time; on a full disk the kernel can only answer with SIGBUS.
    ``posix_fallocate`` reserves the blocks first, and a full disk is then an
    ``OSError(ENOSPC)`` here. Whole pages are reserved (a store dirties its whole
    page), never past the end of the file (the shard index lies there). Data is
    unchanged. Filesystems without fallocate support are left to allocate on write.
    """
    page = mmap.PAGESIZE
    lo = start * row_bytes // page * page
    hi = min(-(-stop * row_bytes // page) * page, os.fstat(fd).st_size)
    if hi <= lo or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, lo, hi - lo)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


_FALLOC_FL_KEEP_SIZE: Final = 1
_FALLOC_FL_PUNCH_HOLE: Final = 2


@functools.cache
def _fallocate() -> Any:
    try:
        func = ctypes.CDLL(None, use_errno=True).fallocate
    except AttributeError:  # not Linux
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return func


def free_rows(fd: int, row_bytes: int, start: int, stop: int) -> bool:
    """Give back the disk blocks under rows ``[start, stop)`` of the raw array file
    ``fd`` (``fallocate(FALLOC_FL_PUNCH_HOLE)``): they read as zeros afterwards, the
    file keeps its size, a block shared with a row outside the range keeps its data
    (only its part inside the range is zeroed). Returns False where the filesystem
    cannot (nothing changed); other failures raise ``OSError``."""
    func = _fallocate()
    lo, hi = start * row_bytes, min(stop * row_bytes, os.fstat(fd).st_size)
    if func is None or hi <= lo:
        return False
    if func(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, lo, hi - lo) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


@functools.cache
def _renameat2() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:  # libc without renameat2 (glibc < 2.28, not Linux)
        return None


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``, or raise ``FileExistsError`` if ``dst`` exists.

    ``os.rename`` of a directory onto an existing *empty* directory succeeds on
    Linux, so two processes renaming into one path would both "win". Linux's
    ``renameat2(RENAME_NOREPLACE)`` refuses any existing ``dst`` atomically.
    Where it is missing (or the filesystem refuses the flag) ``dst`` is checked
    first, which leaves a window only against a directory that is empty: a
    rename onto a non-empty one fails by itself.
    """
    func = _renameat2()
    if func is not None:
        if func(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(src), None, str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(src), None, str(dst))
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno == errno.ENOTEMPTY:  # a non-empty directory appeared at dst meanwhile
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(src), None, str(dst)) from None
        raise
