"""Raw arrays in files: memory maps, ``pwrite``/``pread`` of row blocks, page-cache control.

A raw array (``_disk/format.py``: one shard, ``bytes`` codec, index at the end) starts
with its C-order rows, so it is mapped as a numpy array from the shard file's
descriptor (opened without following links) after its ``zarr.json`` is checked.
Everything here works on one mapped array and knows nothing of stores.

>>> import tempfile, numpy as np
>>> from pathlib import Path
>>> from mmbuffer._disk import format as fmt
>>> root = Path(tempfile.mkdtemp())
>>> fmt.create_raw(root, "x", 4, (), np.dtype("int32"))
>>> arr = open_raw(root, "x", writable=True)
>>> arr[1:3] = 7; flush_rows(arr, 0, 4); arr.tolist()
[0, 7, 7, 0]
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path
from typing import Final

import numpy as np

from . import files as _files, safe_io as _safe_io
from .. import errors
from . import format as fmt
from ..config import config

_MADV_POPULATE_READ: Final = 22  # Linux >= 5.14; Python 3.11's mmap module lacks it
PWRITE_MIN_BYTES: Final = 1 << 16


def open_raw_fd(
    root: Path, name: str, *, writable: bool, expect: fmt.Expect | None = None, private: bool = False
) -> tuple[np.ndarray, int]:
    """Memory-map the raw array ``root/name`` as ``[rows, *row_shape]``; also return
    the descriptor of its shard file (the caller closes it).

    ``zarr.json`` is checked against ``expect`` (:func:`check_array_meta`); every
    file is opened without following links and the map is made from that
    descriptor, never by path again. ``private=True`` maps it copy-on-write
    (``MAP_PRIVATE``): stores stay in this process's anonymous memory until
    :func:`write_private` writes them to the file (a writer) or :func:`drop_private`
    drops them (a reader that replayed the priority log: ``_ledger/store.py``).
    """
    meta = _files.read_json_in(root, f"{name}/zarr.json")
    shape, dtype, shard_rows = fmt.check_array_meta(root / name / "zarr.json", meta, expect, raw=True)
    dtype = dtype.newbyteorder("<")
    rel = "/".join([name, "c", *(["0"] * len(shape))])
    fd = _safe_io.open_file(root, rel, os.O_RDWR if writable else os.O_RDONLY)
    try:
        need = shard_rows * dtype.itemsize
        for s in shape[1:]:
            need *= s
        size = os.fstat(fd).st_size
        if size < need:
            raise errors.CorruptStoreError(
                f"{root / rel}: file seems not fully written: expected at least {need} bytes, got {size}"
            )
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        access = mmap.ACCESS_COPY if private else mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        handle = mmap.mmap(fd, nbytes, access=access)
    except BaseException:
        os.close(fd)
        raise
    if config.madvise_random and hasattr(mmap, "MADV_RANDOM"):
        handle.madvise(mmap.MADV_RANDOM)  # read-ahead wrecks cold random gathers
    # a plain ndarray over our own map (np.memmap's subclass hooks cost microseconds per access)
    return np.ndarray(shape, dtype=dtype, buffer=handle), fd


def open_raw(root: Path, name: str, *, writable: bool, expect: fmt.Expect | None = None) -> np.ndarray:
    """Memory-map the raw array ``root/name`` as ``[rows, *row_shape]`` (see :func:`open_raw_fd`)."""
    arr, fd = open_raw_fd(root, name, writable=writable, expect=expect)
    os.close(fd)
    return arr


def write_rows(fd: int, mm: np.ndarray, start: int, rows: np.ndarray) -> None:
    """Write ``rows`` at row ``start`` of the raw array mapped as ``mm``, with pwrite.

    The page cache is shared with every memory map of the file, so readers see the
    rows at once; a write() fills fresh pages 2-4x faster than stores through a
    map advised MADV_RANDOM (measured on this project's dev machine). Blocks under
    ``PWRITE_MIN_BYTES`` go through the map (:func:`stores_through_map`): there the
    syscall costs more.
    """
    if stores_through_map(mm, len(rows)):
        mm[start : start + len(rows)] = rows
        return
    pwrite_all(fd, np.ascontiguousarray(rows, dtype=mm.dtype).data.cast("B"), start * mm.strides[0])


def stores_through_map(mm: np.ndarray, count: int) -> bool:
    """Whether :func:`write_rows` stores a block of ``count`` rows of ``mm`` through the
    map (a few rows: cheaper than the syscall), not with pwrite.

    >>> m = np.zeros((10, 1024), np.float32); stores_through_map(m, 15), stores_through_map(m, 16)
    (True, False)
    """
    return count * mm.strides[0] < PWRITE_MIN_BYTES


def read_rows(fd: int, mm: np.ndarray, start: int, out: np.ndarray) -> None:
    """Fill ``out`` (C-contiguous) with the rows from row ``start`` of the raw array
    mapped as ``mm``, with pread: the mirror of :func:`write_rows`."""
    if out.dtype != mm.dtype or out.shape[1:] != mm.shape[1:] or not out.flags.c_contiguous:
        raise ValueError(f"read_rows: out must be C-contiguous {mm.dtype} rows of shape {mm.shape[1:]}")
    data = out.reshape(-1).view(np.uint8).data
    offset = start * mm.strides[0]
    got = pread_into(fd, data, offset)
    if got < len(data):
        raise errors.CorruptStoreError(f"read_rows: file ends before byte {offset + got}")


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> int:
    """Write all of ``data`` at byte ``offset`` of ``fd`` (pwrite until done); return its length."""
    view = memoryview(data).cast("B")
    total = len(view)
    while len(view):
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done
    return total


def pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from byte ``offset`` of ``fd`` (preadv until it is full or the file
    ends); return the bytes read."""
    got = 0
    while got < len(buf):
        done = os.preadv(fd, [buf[got:]], offset + got)
        if done == 0:
            break
        got += done
    return got


def drop_cache(fd: int, mm: np.ndarray, start: int, stop: int) -> None:
    """Start writing rows ``[start, stop)`` back and drop their clean pages from the
    page cache (``posix_fadvise(DONTNEED)``): dirty pages are written, never lost."""
    if stop > start and hasattr(os, "posix_fadvise"):
        row_bytes = mm.strides[0]
        os.posix_fadvise(fd, start * row_bytes, (stop - start) * row_bytes, os.POSIX_FADV_DONTNEED)


def flush_rows(mm: np.ndarray, start: int, stop: int) -> None:
    """msync the rows ``[start, stop)`` of a memory-mapped array (no-op otherwise)."""
    handle = _mmap_of(mm)
    if handle is None or stop <= start:
        return
    row_bytes = mm.strides[0] if mm.ndim else mm.itemsize
    lo = (start * row_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
    hi = min(stop * row_bytes, len(handle))
    handle.flush(lo, hi - lo)


def mmap_of(arr: np.ndarray) -> mmap.mmap | None:
    """The ``mmap`` an array's memory belongs to, or None."""
    return _mmap_of(arr)


def _mmap_of(arr: np.ndarray) -> mmap.mmap | None:
    base: object = arr
    while base is not None:
        if isinstance(base, mmap.mmap):
            return base
        base = getattr(base, "base", None)
    return None


def release(arr: np.ndarray) -> None:
    """Unmap this process's pages of a memory-mapped array (MADV_DONTNEED).

    The data stays in the page cache and in the file (a shared mapping's dirty
    pages stay dirty); the next access maps the page again.
    """
    handle = _mmap_of(arr)
    if handle is not None and hasattr(mmap, "MADV_DONTNEED"):
        handle.madvise(mmap.MADV_DONTNEED)


def populate(arr: np.ndarray, *, random: bool = True) -> None:
    """Read a memory-mapped array's pages in at sequential disk speed and map them.

    ``madvise(MADV_SEQUENTIAL)``, then ``MADV_POPULATE_READ`` (Linux 5.14+;
    elsewhere, or if refused, one byte per page is read in order) maps every
    page into this process, so later random reads take no page fault and the
    kernel sees the pages in use; then back to ``MADV_RANDOM`` (``random=True``,
    as :func:`open_raw` advises) or ``MADV_NORMAL``. Under ``MADV_RANDOM`` the
    same populate reads a 4 KiB page per disk read: 42 s instead of 1.2-2.3 s
    for a 2.5 GB priority tree (benchmarks/HISTORY.md). Calls ``madvise`` through ctypes,
    which releases the GIL: it can run in a background thread. An array in RAM
    is left as it is.
    """
    if arr.nbytes == 0 or not is_mapped(arr):
        return
    page = mmap.PAGESIZE
    start = arr.ctypes.data // page * page
    addr = ctypes.c_void_p(start)
    size = ctypes.c_size_t(arr.ctypes.data + arr.nbytes - start)
    madvise = ctypes.CDLL(None, use_errno=True).madvise if hasattr(mmap, "MADV_SEQUENTIAL") else None
    if madvise is not None:
        madvise(addr, size, mmap.MADV_SEQUENTIAL)
    if madvise is None or not sys.platform.startswith("linux") or madvise(addr, size, _MADV_POPULATE_READ):
        int(arr.reshape(-1).view(np.uint8)[::page].max())  # one read per page, in order
    if madvise is not None:
        madvise(addr, size, mmap.MADV_RANDOM if random else mmap.MADV_NORMAL)


def private_pages(mm: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Which of the ``candidates`` (page numbers from the start of ``mm``'s map, sorted,
    unique) this process holds a private copy of: the pages a store through a
    copy-on-write map (``open_raw_fd(private=True)``) changed, read from
    ``/proc/self/pagemap`` (present and not a file page, or swapped), one read per
    run of 512-page windows. Where pagemap cannot be read, every candidate."""
    handle = _mmap_of(mm)
    if handle is None or not len(candidates):
        return candidates[:0]
    page = mmap.PAGESIZE
    first = np.frombuffer(handle, dtype=np.uint8).ctypes.data // page  # the map's first page
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return candidates
    try:
        windows = np.unique(candidates >> 9)
        cut = np.flatnonzero(np.diff(windows) != 1) + 1
        flags = np.zeros(len(candidates), dtype=bool)
        for run in np.split(windows, cut):  # a read per run of windows: O(runs), not per page
            lo, hi = int(run[0]) << 9, min((int(run[-1]) + 1) << 9, -(-len(handle) // page))
            raw = np.frombuffer(os.pread(fd, 8 * (hi - lo), 8 * (first + lo)), dtype=np.uint64)
            private = ((raw >> np.uint64(63)) & 1).astype(bool) & ~((raw >> np.uint64(61)) & 1).astype(bool)
            private |= ((raw >> np.uint64(62)) & 1).astype(bool)
            a, b = np.searchsorted(candidates, [lo, hi]).tolist()
            flags[a:b] = private[candidates[a:b] - lo]
        return candidates[flags]
    finally:
        os.close(fd)


def write_private(fd: int, mm: np.ndarray, pages: np.ndarray) -> int:
    """``pwrite`` the ``pages`` (page numbers from the start of ``mm``'s map, sorted,
    unique) of a copy-on-write map to its file ``fd``, one call per run of
    consecutive pages (a ``pwrite``, never a store through a shared map: a full disk
    is an ``OSError``, not a SIGBUS); returns the bytes written. The private copies
    stay (:func:`drop_private` drops them)."""
    handle = _mmap_of(mm)
    if handle is None or not len(pages):
        return 0
    page, size = mmap.PAGESIZE, len(handle)
    view = memoryview(handle)
    cut = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], cut)).tolist()
    stops = np.concatenate((cut, [len(pages)])).tolist()
    first = pages.tolist()
    total = 0
    try:
        for a, b in zip(starts, stops):  # one syscall per run of pages
            lo, hi = first[a] * page, min((first[b - 1] + 1) * page, size)
            total += pwrite_all(fd, view[lo:hi], lo)
    finally:
        view.release()
    return total


def drop_private(mm: np.ndarray) -> None:
    """Drop a copy-on-write map's private pages (``MADV_DONTNEED``): the next access
    reads the file's page again. Only after their content was written to the file."""
    handle = _mmap_of(mm)
    if handle is not None and hasattr(mmap, "MADV_DONTNEED"):
        handle.madvise(mmap.MADV_DONTNEED)


def is_mapped(arr: object) -> bool:
    return isinstance(arr, np.ndarray) and _mmap_of(arr) is not None
