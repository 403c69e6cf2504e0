"""Open files inside a store directory without following symbolic links.

A store is untrusted input (docs/design.md): nothing in it may make mmbuffer read or
write outside its directory. The store directory itself may be reached through a
link (the user's choice); every component *below* it is opened with
``O_NOFOLLOW`` (directories with ``O_DIRECTORY`` too), one at a time relative to
its parent's descriptor, so no link and no ``..`` can lead elsewhere, and only
regular files are accepted (a FIFO would block the open, a device be read).

>>> import tempfile, pathlib
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> (root / "a").mkdir(); _ = (root / "a" / "f.json").write_text("{}")
>>> read_bytes(root, "a/f.json")
b'{}'
>>> (root / "b").symlink_to(root / "a")
>>> read_bytes(root, "b/f.json")  # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
mmbuffer.errors.CorruptStoreError: .../b: expected a regular file or directory inside the store, got a symbolic link on the way (or not a directory)
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .. import errors

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse(root: Path, rel: str, exc: OSError) -> errors.CorruptStoreError:
    where = root / rel
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return errors.CorruptStoreError(
            f"{where}: expected a regular file or directory inside the store, "
            "got a symbolic link on the way (or not a directory)"
        )
    if exc.errno == errno.ENOENT:
        return errors.CorruptStoreError(f"{where}: missing file")
    return errors.CorruptStoreError(f"{where}: cannot be opened ({exc.strerror})")


def _parts(rel: str) -> list[str]:
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise errors.CorruptStoreError(f"{rel!r}: expected a relative path inside the store, got {rel!r}")
    return parts


def open_dir(root: Path, rel: str = "") -> int:
    """A descriptor of directory ``root/rel``; no component below ``root`` may be a link."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if not rel:
        return fd
    try:
        for part in _parts(rel):
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError as exc:
        os.close(fd)
        raise _refuse(root, rel, exc) from None
    return fd


def open_file(root: Path, rel: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A descriptor of regular file ``root/rel``, opened with ``flags`` and ``O_NOFOLLOW``."""
    parent, _, name = rel.rpartition("/")
    _parts(rel)
    dfd = open_dir(root, parent)
    try:
        # O_NONBLOCK: a FIFO planted in the store must not hang the open (refused below)
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dfd)
    except OSError as exc:
        raise _refuse(root, rel, exc) from None
    finally:
        os.close(dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise errors.CorruptStoreError(f"{root / rel}: expected a regular file, got another kind of file")
    os.set_blocking(fd, True)
    return fd


def read_bytes(root: Path, rel: str, limit: int = 1 << 30) -> bytes:
    """The content of regular file ``root/rel`` (at most ``limit`` bytes)."""
    fd = open_file(root, rel)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise errors.CorruptStoreError(f"{root / rel}: expected at most {limit} bytes, got {size}")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def lexists(root: Path, rel: str) -> bool:
    """Whether ``root/rel`` exists as a regular file; a link or another kind of
    file there (or a link on the way) raises ``CorruptStoreError``."""
    parent, _, name = rel.rpartition("/")
    _parts(rel)
    dfd = open_dir(root, parent)
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)
    if not stat.S_ISREG(st.st_mode):
        raise errors.CorruptStoreError(f"{root / rel}: expected a regular file, got a link or another kind of file")
    return True


def check_tree(root: Path, rel: str) -> None:
    """Refuse a link anywhere in directory ``root/rel`` or on the way to it.

    For arrays that zarr-python opens by path (compressed columns): zarr follows
    links, so the whole tree is checked before it is handed over. Depth first, a
    directory open only while its own entries are checked, so the descriptors held
    are the tree's depth, never a directory's width (a column of 1e9 rows has ~65,000
    chunk folders: a descriptor each went past the process's limit).
    """
    fd = open_dir(root, rel)
    try:
        _check_dir(root, fd, rel)
    finally:
        os.close(fd)


def _check_dir(root: Path, dfd: int, where: str) -> None:
    with os.scandir(dfd) as it:
        entries = list(it)
    for entry in entries:
        if entry.is_symlink() or not (entry.is_dir(follow_symlinks=False) or entry.is_file(follow_symlinks=False)):
            raise errors.CorruptStoreError(
                f"{root / where / entry.name}: expected a regular file or directory inside the store, "
                "got a symbolic link or another kind of file"
            )
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            try:
                sub = os.open(entry.name, _DIR_FLAGS, dir_fd=dfd)
            except OSError as exc:
                raise _refuse(root, f"{where}/{entry.name}", exc) from None
            try:
                _check_dir(root, sub, f"{where}/{entry.name}")
            finally:
                os.close(sub)
