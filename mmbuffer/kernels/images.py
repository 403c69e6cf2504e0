"""JPEG shards (the lossy ``"jpeg"`` codec): encode a shard's frames, decode the frames a batch needs.

A column with the ``jpeg`` codec (``mmbuffer._disk.columns.sharded``, ``jpeg.py``)
keeps one JPEG image per inner chunk, followed by its crc32c, in shards laid out as
the zstd ones (``codec.py``: header, chunks, index, index crc32c). Reading a batch is
three steps, none of them a Python call per row:

1. ``_plan`` (compiled, GIL released): the batch's distinct frames are looked up in
   the decoded-chunk cache (``codec.Cache``, keyed by row and shard version); each
   missing one has its index entry and crc32c checked and is listed to decode.
2. The listed frames are decoded by libjpeg-turbo (imagecodecs ``jpeg8_decode``, which
   releases the GIL while it decodes) straight into a scratch block, split over a small
   thread pool (``THREADS``) when there are enough of them: one C call per frame, the
   only per-frame Python left (a call costs ~1 us against ~450 us of decoding).
3. ``_finish`` (compiled): rows are copied out from the cache or the scratch, and the
   decoded frames enter the cache.

Decoding is deterministic: the same stored bytes give the same pixels on every read
path (``get``, ``sample``, stacks, ``stream``).

>>> import numpy as np
>>> frames = np.zeros((2, 16, 16, 3), np.uint8); frames[1] = 200
>>> blob = encode_shard(95, frames, 7)
>>> bytes(blob[:8]), int(np.frombuffer(blob[8:16], "<i8")[0])
(b'MMBSHRD1', 7)
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np

from .codec import HEADER, MAGIC, TABLE, checked_chunk as _checked_chunk, crc32c
from .intrinsics import pointer as _ptr

_carray: Any = numba.carray  # type: ignore[attr-defined]

__all__ = ["THREADS", "decode_rows", "encode_frame", "encode_shard", "roundtrip"]

THREADS = max(1, min(4, os.cpu_count() or 1))  # decoding threads per batch (the caller's is one of them)
_POOL: dict[int, ThreadPoolExecutor] = {}  # by process id: a forked child (DataLoader workers) starts its own


def _pool() -> ThreadPoolExecutor:
    pid = os.getpid()
    pool = _POOL.get(pid)
    if pool is None:  # a pool inherited through fork has no threads: never submit to it
        _POOL.clear()
        pool = _POOL[pid] = ThreadPoolExecutor(max_workers=max(1, THREADS - 1), thread_name_prefix="mmbuffer-jpeg")
    return pool


def _as_libjpeg(frame: np.ndarray) -> np.ndarray:
    """``frame`` as libjpeg takes and gives it: ``(H, W)`` for one channel, else ``(H, W, 3)``."""
    return frame.reshape(frame.shape[:2]) if frame.ndim == 3 and frame.shape[2] == 1 else frame


def encode_frame(frame: np.ndarray, quality: int) -> bytes:
    """One ``uint8`` frame (``(H, W)``, ``(H, W, 1)`` or ``(H, W, 3)``) as a JPEG image at
    ``quality``: what a shard stores for it, and what the zarr codec writes."""
    import imagecodecs

    return bytes(imagecodecs.jpeg8_encode(np.ascontiguousarray(_as_libjpeg(frame)), level=quality))


def roundtrip(frames: np.ndarray, quality: int) -> np.ndarray:
    """``frames`` (``[n, *row]`` uint8) encoded as a shard stores them and decoded as a
    read returns them (both deterministic), on the pool."""
    import imagecodecs

    out = np.empty_like(frames)

    def work(start: int, stop: int, step: int) -> None:
        for i in range(start, stop, step):
            out[i] = np.asarray(imagecodecs.jpeg8_decode(encode_frame(frames[i], quality))).reshape(frames.shape[1:])

    _spread(work, len(frames))
    return out


def _spread(work: Any, n: int) -> None:
    """``work(start, stop, step)`` over ``range(n)``: on this thread alone for a few items,
    else split over the pool and this thread (each part strided, so costs even out)."""
    parts = min(THREADS, max(1, n // 4))
    if parts == 1:
        work(0, n, 1)
        return
    futures = [_pool().submit(work, p, n, parts) for p in range(1, parts)]
    try:
        work(0, n, parts)
    finally:
        errors_ = [f.exception() for f in futures]
    for exc in errors_:
        if exc is not None:
            raise exc


def encode_shard(quality: int, frames: np.ndarray, version: int) -> bytes:
    """One shard file of ``frames`` (``[chunks, *row]`` uint8): the header (magic,
    ``version``), each frame as a JPEG image at ``quality`` plus its crc32c, the index
    (offset, bytes per chunk) and its crc32c. Frames are encoded on the pool."""
    n = len(frames)
    blobs: list[bytes] = [b""] * n

    def work(start: int, stop: int, step: int) -> None:
        for i in range(start, stop, step):
            blob = encode_frame(frames[i], quality)
            blobs[i] = blob + crc32c(np.frombuffer(blob, np.uint8)).to_bytes(4, "little")

    _spread(work, n)
    index = np.empty((n, 2), "<u8")
    sizes = np.array([len(b) for b in blobs], np.int64)
    index[:, 0] = HEADER + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    index[:, 1] = sizes
    raw = index.tobytes()
    head = MAGIC.tobytes() + int(version).to_bytes(8, "little")
    return head + b"".join(blobs) + raw + crc32c(np.frombuffer(raw, np.uint8)).to_bytes(4, "little")


@numba.njit(nogil=True, cache=True)
def _plan(rows: Any, versions: Any, positions: Any, shard_rows: int, file_addr: Any, file_size: Any, chunk: Any,
          version: Any, used: Any, stats: Any, table: Any, src: Any, todo: Any, fail: Any) -> int:
    """Per row, where its frame is: a cache slot (``src >= 0``) or decode job ``-1 - src``;
    each job (``todo``: row, version, shard file, offset, bytes, the position in ``out`` it
    is decoded to: its row's first) checked against its crc32c. Returns the number of
    jobs, or -1 (``fail``: shard file, chunk, reason)."""
    n = rows.shape[0]
    slots = chunk.shape[0]
    sets = slots // 4
    order = np.argsort(rows)
    m = 0
    i = 0
    while i < n:
        r = rows[order[i]]
        v = versions[order[i]]
        j = i + 1
        while j < n and rows[order[j]] == r:
            j += 1
        base = (r % sets) * 4
        where = -1
        for w in range(base, base + 4):
            if chunk[w] == r and version[w] == v:
                where = w
                break
        if where >= 0:
            stats[0] += 1
            used[slots] += 1
            used[where] = used[slots]
        else:
            stats[1] += 1
            f = r // shard_rows
            ci = r % shard_rows
            size = file_size[f]
            if file_addr[f] == 0:
                fail[0], fail[1], fail[2] = f, ci, 1
                return -1
            off, nb, why = _checked_chunk(_carray(_ptr(file_addr[f]), size), size, size - 16 * shard_rows - 4, ci, table)
            if why:
                fail[0], fail[1], fail[2] = f, ci, why
                return -1
            todo[m, 0], todo[m, 1], todo[m, 2], todo[m, 3], todo[m, 4] = r, v, f, off, nb
            todo[m, 5] = positions[order[i]]
            where = -1 - m
            m += 1
        for q in range(i, j):
            src[order[q]] = where
        i = j
    return m


@numba.njit(nogil=True, cache=True)
def _finish(src: Any, positions: Any, row_bytes: int, todo: Any, m: int, data: Any, chunk: Any,
            version: Any, used: Any, out: Any) -> None:
    """Copy every other row out (cached ones first, before a new frame can take their
    slot; a frame asked for twice from where it was decoded), then put the decoded frames
    in the cache."""
    n = src.shape[0]
    slots = chunk.shape[0]
    sets = slots // 4
    for k in range(n):
        d = positions[k] * row_bytes
        if d < 0 or d + row_bytes > out.shape[0]:
            raise ValueError("decode_rows: a position outside out")
        s = src[k]
        if s >= 0:
            out[d : d + row_bytes] = data[s * row_bytes : (s + 1) * row_bytes]
        elif todo[-1 - s, 5] != positions[k]:
            t = todo[-1 - s, 5] * row_bytes
            out[d : d + row_bytes] = out[t : t + row_bytes]
    for i in range(m):
        r = todo[i, 0]
        base = (r % sets) * 4
        oldest = base
        for w in range(base, base + 4):
            if used[w] < used[oldest]:
                oldest = w
        used[slots] += 1
        used[oldest] = used[slots]
        chunk[oldest] = r
        version[oldest] = todo[i, 1]
        t = todo[i, 5] * row_bytes
        data[oldest * row_bytes : (oldest + 1) * row_bytes] = out[t : t + row_bytes]


REASONS = {1: "its shard file is missing or too short", 2: "its entry in the shard index points outside the file",
           3: "crc32c mismatch", 4: "libjpeg cannot decode it to the column's frame"}


def decode_rows(rows: np.ndarray, versions: np.ndarray, positions: np.ndarray, shard_rows: int, row_shape: tuple[int, ...],
                file_addr: np.ndarray, file_size: np.ndarray, maps: list[Any], cache: Any, out: np.ndarray) -> tuple[int, int, str] | None:
    """Copy rows ``rows`` (global ids, one frame each; ``versions``: the absolute shard
    each was written as) into ``out`` (flat bytes) at row positions ``positions``,
    decoding through ``cache`` (``codec.Cache`` of one-frame chunks) the frames it lacks
    from the mapped shard files (``maps``, ``file_addr``, ``file_size`` per shard).
    Returns None, or (shard, chunk, reason) of the first frame that fails its checks
    (nothing is cached from it)."""
    import imagecodecs

    row_bytes = int(np.prod(row_shape, dtype=np.int64))
    n = len(rows)
    src = np.empty(n, np.int64)
    todo = np.empty((n, 6), np.int64)
    fail = np.zeros(3, np.int64)
    m = int(_plan(rows, versions, positions, shard_rows, file_addr, file_size, cache.chunk, cache.version, cache.used,
                  cache.stats, TABLE, src, todo, fail))
    if m < 0:
        return int(fail[0]), int(fail[1]), REASONS[int(fail[2])]
    if n and (positions.min() < 0 or (positions.max() + 1) * row_bytes > out.shape[0]):
        raise ValueError("decode_rows: a position outside out")
    frames = out[: out.shape[0] // row_bytes * row_bytes].reshape(-1, *row_shape)  # decoded in place, row by row
    bad = np.full(1, -1, np.int64)

    def work(start: int, stop: int, step: int) -> None:
        for i in range(start, stop, step):
            f, off, nb = int(todo[i, 2]), int(todo[i, 3]), int(todo[i, 4])
            dst = _as_libjpeg(frames[int(todo[i, 5])])
            try:
                got = imagecodecs.jpeg8_decode(maps[f][off : off + nb], out=dst)
            except Exception:  # noqa: BLE001 - any refusal of libjpeg (a hostile but crc-valid chunk)
                got = None
            if got is None or got.shape != dst.shape or got.dtype != np.uint8 or got.ctypes.data != dst.ctypes.data:
                bad[0] = i

    _spread(work, m)
    if bad[0] >= 0:
        i = int(bad[0])
        return int(todo[i, 2]), int(todo[i, 0] % shard_rows), REASONS[4]
    _finish(src, positions, row_bytes, todo, m, cache.data, cache.chunk, cache.version, cache.used, out)
    return None
