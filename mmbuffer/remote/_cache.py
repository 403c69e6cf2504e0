"""The local cache of remote stores: bounded, shared by the processes of a host, never mapped unreserved.

Under ``cache_dir``::

    objects/<2 hex>/<digest>   verified objects (chunks), named by their BLAKE2b-128 digest
    locks/<3 hex>              download locks (4096 stripes): one download per object per host
    locks/<snapshot>[.flags]   a mirror's, and its flags' fills (``_filled.py``): one per host at a time
    <url hash>/<snapshot>/     a snapshot's small parts (mirror), in use while ``<snapshot>.pin`` is locked;
                               ``<url hash>`` covers the mirror layout (``_snapshot.cache_root``)
    <url hash>/pool-*/         a reader's chunk pool (its ``.pin`` held while it lives)
    .usage                     the bytes held, updated under ``.lock``

An object is written to a temporary name and renamed into place once complete and
verified (atomic: a reader sees all of it or nothing), under its stripe's lock, so
concurrent readers of one host download it once. Content addressing makes objects
shared across snapshots: a refresh downloads only the chunks that changed. A cached
object is checked again on every read from this disk; one that changed here is fetched
anew.

``limit`` (``cache_limit``, bytes) bounds everything above: before writing ``n`` bytes
the cache takes ``.lock``, evicts least recently used objects and
unpinned mirrors (whole objects: chunk granularity; a mirror with its pin and lock
files, so nothing is left per snapshot seen) until they fit, and writes them; what cannot fit
(pinned mirrors and live pools take the rest) is a :class:`~mmbuffer.errors.CacheError`
naming ``cache_dir``, the limit and the bytes needed. A full disk is a
:class:`~mmbuffer.errors.DiskFullError` naming them too; a pool file is reserved
with ``posix_fallocate`` before it is mapped, so a full disk never truncates a map
(never SIGBUS).

>>> import tempfile
>>> from mmbuffer.remote._objects import digest
>>> cache = Cache(Path(tempfile.mkdtemp()), limit=10)
>>> obj = lambda data: cache.object(digest(data), len(data), lambda: data, lambda got: None)
>>> obj(b"123456"), obj(b"abcdef"), cache.downloads  # the second evicts the first
(b'123456', b'abcdef', 2)
>>> cache.used() <= 10, obj(b"abcdef"), cache.downloads  # a hit: no download
(True, b'abcdef', 2)
>>> obj(b"far too large")
Traceback (most recent call last):
...
mmbuffer.errors.CacheError: [Errno 28] cache_dir ...: expected room for 13 more bytes within cache_limit=10, got 10 free after evicting everything not in use; raise cache_limit
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

from .. import errors

__all__ = ["Cache", "disk_bytes", "disk_errors", "write_file"]

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_ID = re.compile(r"^[0-9]{10}-[0-9a-f]{12}$")


@contextlib.contextmanager
def disk_errors(base: Path, need: int) -> Iterator[None]:
    """An ``OSError`` writing under ``base`` as a typed error naming ``cache_dir`` and ``need``."""
    try:
        yield
    except errors.MMBufferError:
        raise
    except OSError as exc:
        if exc.errno in _NO_SPACE:
            raise errors.DiskFullError(
                exc.errno, f"cache_dir {base}: expected room for {need} more bytes, got {exc.strerror}; "
                "free space there, pass another cache_dir, or a smaller cache_limit") from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise errors.CacheError(
                exc.errno, f"cache_dir {base}: expected a writable directory for {need} bytes, got {exc.strerror}") from None
        raise


def disk_bytes(st: os.stat_result) -> int:
    """The bytes a file takes on disk: its size, less its holes (a rebuilt index is sparse)."""
    return min(st.st_size, st.st_blocks * 512) if st.st_blocks else st.st_size


def _size(path: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes of the files under ``path``, each inode once (mirrors share unchanged files
    with the mirror before them by hard link)."""
    seen = set() if seen is None else seen
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, f))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += disk_bytes(st)
    return total


def _own_bytes(path: Path) -> int:
    """Bytes that removing ``path`` frees: its files no other link keeps."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, f))
                total += disk_bytes(st) if st.st_nlink == 1 else 0
    return total


class Cache:
    """The cache directory ``base`` bounded to ``limit`` bytes (None: unbounded)."""

    def __init__(self, base: Path, limit: int | None) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise errors.InvalidArgumentError(f"cache_limit: expected a number of bytes >= 1 or None, got {limit!r}")
        self.base = base
        self.limit = limit
        self.downloads = 0  # objects this process fetched from object storage
        self.mirror_bytes = 0  # bytes of snapshots' small parts this process fetched
        with disk_errors(base, 0):
            (base / "objects").mkdir(parents=True, exist_ok=True)
            (base / "locks").mkdir(exist_ok=True)
            if not os.access(base, os.W_OK):
                raise PermissionError(errno.EACCES, "not writable")

    # -- accounting ------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self, name: str, kind: int = fcntl.LOCK_EX) -> Iterator[int]:
        """Hold the lock file ``cache_dir/name`` (every process of the host sees it)."""
        fd = self._flocked(self.base / name, kind)
        try:
            yield fd
        finally:
            os.close(fd)

    def _flocked(self, path: Path, kind: int) -> int:
        """An fd of the lock file ``path`` (created if need be) holding ``kind``. Eviction
        removes a dropped mirror's lock files while it holds them: a lock taken on a file
        removed meanwhile is let go and taken again on the file now at ``path``."""
        while True:
            with disk_errors(self.base, 0):
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, kind)
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(path).st_ino == os.fstat(fd).st_ino:
                        return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def admit(self, need: int, write: Callable[[], None]) -> None:
        """Run ``write`` (which adds ``need`` bytes) once they fit ``limit``, evicting what
        it takes. Under ``.lock``, so a scan never sees a write half done."""
        with disk_errors(self.base, need), self.locked(".lock"):
            used = self._read_usage() if self.limit is not None else 0
            if self.limit is not None and (used is None or used + need > self.limit):
                used = self._evict(need)
            write()
            if self.limit is not None:
                self._write_usage((used or 0) + need)

    def remove(self, drop: Callable[[], None], freed: int) -> None:
        """Run ``drop`` (which removes ``freed`` bytes) and account for it."""
        with self.locked(".lock"):
            drop()
            if self.limit is not None and freed:
                self._write_usage(max(0, (self._read_usage() or 0) - freed))

    def used(self) -> int:
        """The bytes under ``cache_dir`` now (a scan)."""
        return _size(self.base)

    def _read_usage(self) -> int | None:
        try:
            return int((self.base / ".usage").read_text())
        except (OSError, ValueError):
            return None

    def _write_usage(self, used: int) -> None:
        tmp = self.base / f".usage.{os.getpid()}"
        tmp.write_text(str(used))
        os.replace(tmp, self.base / ".usage")

    def _evict(self, need: int) -> int:
        """Scan, then drop LRU objects and unpinned mirrors until ``need`` more fits."""
        assert self.limit is not None
        items: list[tuple[float, int, Path, Path | None]] = []  # (last use, bytes, path, pin)
        used = 0
        seen: set[tuple[int, int]] = set()
        for sub in sorted(self.base.iterdir()):
            if sub.name in ("objects", "locks") or not sub.is_dir():
                continue
            for entry in sub.iterdir():
                if entry.is_dir() and _ID.match(entry.name):
                    size = _size(entry, seen)
                    pin = sub / f"{entry.name}.pin"
                    items.append((pin.stat().st_mtime if pin.exists() else 0.0, size, entry, pin))
                elif entry.is_dir():  # pools and partial mirrors: held by their process
                    size = _size(entry, seen)
                    pin = entry / ".pin"
                    if pin.exists() and entry.name.startswith("pool-"):
                        items.append((float("-inf"), size, entry, pin))  # an orphan goes first
                    used += size
                    continue
                else:
                    continue
                used += size
        with os.scandir(self.base / "objects") as shards:
            for shard in shards:
                with os.scandir(shard.path) as files:
                    for f in files:
                        st = f.stat()
                        used += st.st_size
                        if not f.name.startswith("."):
                            items.append((st.st_mtime, st.st_size, Path(f.path), None))
        items.sort(key=lambda t: t[0])
        for _, size, path, lock in items:
            if used + need <= self.limit:
                break
            if lock is None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                used -= size
            else:
                used -= self._drop_unpinned(path, lock)
        if used + need > self.limit:
            raise errors.CacheError(
                errno.ENOSPC, f"cache_dir {self.base}: expected room for {need} more bytes within cache_limit="
                f"{self.limit}, got {self.limit - used} free after evicting everything not in use; raise cache_limit")
        return used

    def _drop_unpinned(self, path: Path, pin: Path) -> int:
        """Remove ``path`` unless a reader pins it: the bytes freed. A mirror goes with its
        pin and lock files (``locks/<snapshot>[.flags]``, taken only under the pin), so a
        reader refreshing for weeks leaves no file per snapshot behind; removed while the
        pin is held, the pin last (:meth:`_flocked` takes a removed one again)."""
        try:
            fd = os.open(pin, os.O_RDWR)
        except FileNotFoundError:
            return 0
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0  # in use by a reader
            freed = _own_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            if pin.parent == path.parent:  # a mirror (a pool's pin is inside its folder)
                for name in (path.name, f"{path.name}.flags"):
                    (self.base / "locks" / name).unlink(missing_ok=True)
                pin.unlink(missing_ok=True)
            return freed
        finally:
            os.close(fd)

    # -- pins ------------------------------------------------------------------------------
    def pin(self, path: Path, *, exclusive: bool = False) -> int:
        """Hold ``path`` (a lock file) so eviction leaves what it guards; close the fd to let go."""
        with disk_errors(self.base, 0):
            path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._flocked(path, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        os.utime(fd)
        return fd

    # -- objects ---------------------------------------------------------------------------
    def object(self, key: str, size: int, fetch: Callable[[], bytes], check: Callable[[bytes], None]) -> bytes:
        """The object of digest ``key``: from the cache, or fetched (once per host), checked, kept."""
        path = self.base / "objects" / key[:2] / key
        data = self._read(path, size, check)
        if data is not None:
            return data
        with self.locked(f"locks/{key[:3]}"):
            data = self._read(path, size, check)
            if data is not None:
                return data
            data = fetch()
            self.downloads += 1
            check(data)
            self.admit(size, lambda: write_file(path, data, self.base))
        return data

    def fetch_absent(self, want: Mapping[str, int], fetch: Callable[[list[str]], Mapping[str, bytes]],
                     check: Callable[[str, bytes], None]) -> dict[str, bytes]:
        """The objects of ``want`` (digest -> size) that the cache lacks, fetched with one call
        of ``fetch`` (digests -> bytes: concurrent requests), each checked, then kept; under
        their stripes' locks (taken in order), so each is downloaded once per host. Returns
        what this call fetched, for the caller to use without reading it back."""
        absent = [k for k, size in want.items() if not self._holds(k, size)]
        if not absent:
            return {}
        with contextlib.ExitStack() as held:
            for stripe in sorted({k[:3] for k in absent}):
                held.enter_context(self.locked(f"locks/{stripe}"))
            absent = [k for k in absent if not self._holds(k, want[k])]  # another process's, meanwhile
            got = dict(fetch(absent)) if absent else {}
            for key in absent:
                check(key, got[key])
            self.downloads += len(got)
            for key, data in got.items():  # one at a time: a limit below the batch evicts its first ones
                path = self.base / "objects" / key[:2] / key
                self.admit(len(data), lambda: write_file(path, data, self.base))  # noqa: B023 - called at once
        return got

    def _holds(self, key: str, size: int) -> bool:
        try:
            return (self.base / "objects" / key[:2] / key).stat().st_size == size
        except OSError:
            return False

    def mapped(self, key: str, size: int, fetch: Callable[[], bytes],
               check: Callable[[bytes | memoryview], None]) -> np.ndarray:
        """:meth:`object` as read-only bytes mapped from the cache (checked once, when mapped):
        the page cache holds them once for every process of the host. A mapped object
        that eviction unlinks stays readable until it is let go (files here are only
        ever replaced whole, never truncated: no SIGBUS)."""
        path = self.base / "objects" / key[:2] / key
        got = self._map(path, size, check)
        if got is None:
            data = self.object(key, size, fetch, check)
            got = self._map(path, size, check)
            if got is None:  # evicted at once (a limit below the object): served from memory
                got = np.frombuffer(data, np.uint8)
        return got

    @staticmethod
    def _map(path: Path, size: int, check: Callable[[bytes | memoryview], None]) -> np.ndarray | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # absent, unreadable or a link: fetched (and rewritten) through ``object``
            return None
        try:
            if os.fstat(fd).st_size != size or size == 0:
                return None
            handle = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            with contextlib.suppress(OSError):
                os.utime(fd)  # last use, for LRU (another user's file keeps its time)
        finally:
            os.close(fd)
        data = np.frombuffer(handle, np.uint8)
        try:
            check(memoryview(handle))
        except errors.CorruptStoreError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return None
        return data

    @staticmethod
    def _read(path: Path, size: int, check: Callable[[bytes], None]) -> bytes | None:
        """The cached object, checked again (a file changed on this disk is fetched anew)."""
        try:
            with open(path, "rb") as f:
                data = f.read()
                os.utime(f.fileno())  # last use, for LRU
            check(data)
        except (FileNotFoundError, PermissionError):
            return None
        except errors.CorruptStoreError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return None
        return data


def write_file(path: Path, data: bytes | memoryview, base: Path) -> None:
    """Write ``data`` to ``path`` whole, through a temporary name and one rename."""
    with disk_errors(base, len(data)):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.close(fd)
            fd = -1
            os.rename(tmp, path)
        finally:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def reserved_file(path: Path, nbytes: int, base: Path) -> None:
    """Create ``path`` with ``nbytes`` allocated on disk (``posix_fallocate``): a map of it
    can never fault on a full disk."""
    with disk_errors(base, nbytes):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
