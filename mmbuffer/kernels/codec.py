"""Codec kernels: encode whole shards and decode the inner chunks a batch needs, compiled, GIL-free.

A compressed column (``mmbuffer._disk.columns.sharded``) keeps Zarr v3 shards whose
inner chunks are ``zstd`` frames followed by their ``crc32c`` (Zarr's ``crc32c``
codec: 4 bytes, little-endian). The kernels here call the zstd library that
numcodecs (a dependency of zarr) already loaded, by address (``libzstd()``), so a
batch is one compiled call per column: look every chunk up in the decoded-chunk
cache, verify and decode the missing ones into it, copy the rows out. No Python
runs per row or per chunk, and the GIL is released for the whole call.

The decoded-chunk cache is set-associative (``WAYS`` slots per set, a chunk's set is
its id modulo the number of sets), least recently used within a set: a cache
bounded in bytes that needs no allocation and no deletion. A chunk is keyed by its
global id and its version (the absolute shard number it was written as), so a
chunk rewritten by a later pass through the ring is never served stale.

>>> import numpy as np
>>> crc32c(np.frombuffer(b"123456789", np.uint8))  # the check value of CRC-32C
3808858755
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Any

import numba
import numpy as np
from numba import types
from numba.core import cgutils as _cgutils
from numba.extending import intrinsic

from .intrinsics import address as _address, memcpy as _memcpy, pointer as _pointer

cgutils: Any = _cgutils
ir: Any = cgutils.ir

__all__ = ["WAYS", "Cache", "crc32c", "decode_rows", "encode_shard", "libzstd", "shard_bound"]

WAYS = 4  # slots per cache set
HEADER = 16  # bytes before a shard's first chunk: magic (8) + version (int64, little-endian)
MAGIC = np.frombuffer(b"MMBSHRD1", np.uint8)


def _table() -> np.ndarray:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), slicing-by-8 tables."""
    t = np.zeros((8, 256), np.uint32)
    c = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        c = np.where(c & 1, (c >> 1) ^ np.uint32(0x82F63B78), c >> 1).astype(np.uint32)
    t[0] = c
    for k in range(1, 8):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 0xFF]
    return t


_TABLE = _table()
TABLE = _TABLE  # the tables, for the other shard kernels (images.py)


@numba.njit(nogil=True, cache=True)
def _crc(buf: Any, start: int, n: int, table: Any) -> int:
    crc = np.uint32(0xFFFFFFFF)
    i = start
    end = start + n
    while i + 8 <= end:
        lo = crc ^ (np.uint32(buf[i]) | (np.uint32(buf[i + 1]) << 8) | (np.uint32(buf[i + 2]) << 16) | (np.uint32(buf[i + 3]) << 24))
        crc = (table[7, lo & 0xFF] ^ table[6, (lo >> 8) & 0xFF] ^ table[5, (lo >> 16) & 0xFF] ^ table[4, lo >> 24]
               ^ table[3, buf[i + 4]] ^ table[2, buf[i + 5]] ^ table[1, buf[i + 6]] ^ table[0, buf[i + 7]])
        i += 8
    while i < end:
        crc = table[0, (crc ^ buf[i]) & 0xFF] ^ (crc >> 8)
        i += 1
    return int(crc ^ np.uint32(0xFFFFFFFF))



@numba.njit(nogil=True, cache=True)
def _checked_chunk(buf: Any, size: int, index_at: int, ci: int, table: Any) -> tuple[int, int, int]:
    """Inner chunk ``ci`` of the shard in ``buf`` (``size`` bytes, its index at
    ``index_at``): ``(offset, bytes without the crc32c, 0)``, or ``(0, 0, why)`` when the
    shard is too short (1), its index entry is out of bounds (2) or the chunk's crc32c
    differs (3)."""
    if index_at < HEADER:
        return 0, 0, 1
    off = np.int64(0)
    nb = np.int64(0)
    for b in range(7, -1, -1):
        off = (off << 8) | np.int64(buf[index_at + 16 * ci + b])
        nb = (nb << 8) | np.int64(buf[index_at + 16 * ci + 8 + b])
    if off < HEADER or nb < 5 or off > index_at or nb > index_at - off:
        return 0, 0, 2
    stored = (np.int64(buf[off + nb - 4]) | (np.int64(buf[off + nb - 3]) << 8) | (np.int64(buf[off + nb - 2]) << 16)
              | (np.int64(buf[off + nb - 1]) << 24))
    if _crc(buf, int(off), int(nb - 4), table) != stored:
        return 0, 0, 3
    return int(off), int(nb - 4), 0


checked_chunk = _checked_chunk  # for the other shard kernels (images.py)


def crc32c(data: np.ndarray) -> int:
    """CRC-32C of a flat ``uint8`` array (what Zarr's ``crc32c`` codec appends)."""
    return int(_crc(np.ascontiguousarray(data).view(np.uint8).reshape(-1), 0, data.nbytes, _TABLE))


# -- calling C by address ------------------------------------------------------------
def _call_typing(typingctx: Any, fn: Any, a: Any, b: Any, c: Any, d: Any, e: Any, f: Any) -> Any:
    """``size_t fn(void*, void*, size_t, void*, size_t, int)`` called at address ``fn``
    (a zstd entry point; pointers and sizes given as int64). Six arguments: the last
    is the compression level, ignored by the decoder's five-argument function."""
    sig = types.int64(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64, i32, p8 = ir.IntType(64), ir.IntType(32), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i64, [p8, p8, i64, p8, i64, i32])
        ptr = builder.inttoptr(args[0], fnty.as_pointer())
        conv = [builder.inttoptr(args[1], p8), builder.inttoptr(args[2], p8), args[3], builder.inttoptr(args[4], p8),
                args[5], builder.trunc(args[6], i32)]
        return builder.call(ptr, conv)

    return sig, codegen


def _blosc_typing(typingctx: Any, fn: Any, src: Any, dst: Any, size: Any) -> Any:
    """``int blosc_decompress_ctx(const void*, void*, size_t, int nthreads=1)`` at address ``fn``."""
    sig = types.int64(types.int64, types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64, i32, p8 = ir.IntType(64), ir.IntType(32), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i32, [p8, p8, i64, i32])
        ptr = builder.inttoptr(args[0], fnty.as_pointer())
        got = builder.call(ptr, [builder.inttoptr(args[1], p8), builder.inttoptr(args[2], p8), args[3], i32(1)])
        return builder.sext(got, i64)

    return sig, codegen


def _validate_typing(typingctx: Any, fn: Any, src: Any, cbytes: Any, nbytes_at: Any) -> Any:
    """``int blosc_cbuffer_validate(const void*, size_t cbytes, size_t* nbytes)`` at address ``fn``:
    the header's sizes checked against the bytes given, before anything is decoded."""
    sig = types.int64(types.int64, types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64, i32, p8 = ir.IntType(64), ir.IntType(32), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i32, [p8, i64, i64.as_pointer()])
        ptr = builder.inttoptr(args[0], fnty.as_pointer())
        got = builder.call(ptr, [builder.inttoptr(args[1], p8), args[2], builder.inttoptr(args[3], i64.as_pointer())])
        return builder.sext(got, i64)

    return sig, codegen


_blosc: Any = intrinsic(_blosc_typing)
_validate: Any = intrinsic(_validate_typing)


def _stream_typing(typingctx: Any, dst: Any, doff: Any, src: Any, soff: Any, nbytes: Any) -> Any:
    """Copy ``nbytes`` (a multiple of 8) with non-temporal stores, then a fence: the
    destination's lines are written without being read first (a decoded chunk going
    into the cache's cold memory)."""
    sig = types.void(dst, types.intp, src, types.intp, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d, doff, s_, soff, n = args
        i64 = ir.IntType(64)
        dptr = builder.bitcast(builder.gep(cgutils.create_struct_proxy(signature.args[0])(context, builder, value=d).data, [doff]), i64.as_pointer())
        sptr = builder.bitcast(builder.gep(cgutils.create_struct_proxy(signature.args[2])(context, builder, value=s_).data, [soff]), i64.as_pointer())
        count = builder.udiv(n, i64(8))
        nt = builder.module.add_metadata([ir.IntType(32)(1)])
        with cgutils.for_range(builder, count) as loop:
            v = builder.load(builder.gep(sptr, [loop.index]))
            st = builder.store(v, builder.gep(dptr, [loop.index]))
            st.set_metadata("nontemporal", nt)
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


_stream: Any = intrinsic(_stream_typing)
_call: Any = intrinsic(_call_typing)
_carray: Any = numba.carray  # type: ignore[attr-defined]


class _Zstd:
    """zstd's entry points, by address, from the library numcodecs loaded (or the system's)."""

    def __init__(self) -> None:
        lib = None
        try:
            import numcodecs.zstd as nz  # type: ignore[import-untyped]

            cand = ctypes.CDLL(nz.__file__)
            cand.ZSTD_decompressDCtx  # noqa: B018 - exported by numcodecs' wheels
            lib = cand
        except (ImportError, OSError, AttributeError):
            found = ctypes.util.find_library("zstd")
            if found is not None:
                lib = ctypes.CDLL(found)
        if lib is None:
            raise ImportError("mmbuffer: no zstd library found (numcodecs' or the system's libzstd)")
        self.lib = lib
        for name, res, args in (
            ("ZSTD_createDCtx", ctypes.c_void_p, []), ("ZSTD_createCCtx", ctypes.c_void_p, []),
            ("ZSTD_freeDCtx", ctypes.c_size_t, [ctypes.c_void_p]), ("ZSTD_freeCCtx", ctypes.c_size_t, [ctypes.c_void_p]),
            ("ZSTD_compressBound", ctypes.c_size_t, [ctypes.c_size_t]),
        ):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.decompress = ctypes.cast(lib.ZSTD_decompressDCtx, ctypes.c_void_p).value or 0
        self.compress = ctypes.cast(lib.ZSTD_compressCCtx, ctypes.c_void_p).value or 0


_ZSTD: _Zstd | None = None
_ZSTD_LOCK = threading.Lock()


def libzstd() -> _Zstd:
    """zstd's entry points (loaded once)."""
    global _ZSTD
    with _ZSTD_LOCK:
        if _ZSTD is None:
            _ZSTD = _Zstd()
        return _ZSTD


class Context:
    """A codec's entry points: a zstd compression or decompression context (not thread-safe:
    one user at a time), or blosc-lz4's decoder (``kind`` 1; its contexts are per call)."""

    def __init__(self, compress: bool, kind: str = "zstd") -> None:
        self._compress = compress
        self.kind = 0 if kind == "zstd" else 1
        self.ptr: int = 0
        self.check = 0
        if self.kind == 1:
            import numcodecs.blosc as nb  # type: ignore[import-untyped]

            lib = ctypes.CDLL(nb.__file__)  # numcodecs' wheels export c-blosc's entry points
            self.fn = ctypes.cast(lib.blosc_decompress_ctx, ctypes.c_void_p).value or 0
            self.check = ctypes.cast(lib.blosc_cbuffer_validate, ctypes.c_void_p).value or 0
            return
        self._z = libzstd()
        self.fn = self._z.compress if compress else self._z.decompress
        ptr = self._z.lib.ZSTD_createCCtx() if compress else self._z.lib.ZSTD_createDCtx()
        if not ptr:
            raise MemoryError("zstd: cannot create a context")
        self.ptr = int(ptr)

    def close(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            (self._z.lib.ZSTD_freeCCtx if self._compress else self._z.lib.ZSTD_freeDCtx)(ptr)

    def __del__(self) -> None:
        self.close()


# -- encoding a shard ------------------------------------------------------------------
def shard_bound(chunks: int, chunk_bytes: int) -> int:
    """Bytes a shard of ``chunks`` inner chunks of ``chunk_bytes`` may take encoded."""
    bound = int(libzstd().lib.ZSTD_compressBound(chunk_bytes))
    return HEADER + chunks * (bound + 4) + chunks * 16 + 4


@numba.njit(nogil=True, cache=True)
def _encode(fn: int, cctx: int, level: int, src: Any, chunks: int, chunk_bytes: int, version: int, out: Any, table: Any) -> int:
    if src.shape[0] != chunks * chunk_bytes:
        raise ValueError("encode_shard: source of the wrong size")
    for i in range(8):
        out[i] = MAGIC[i]
    v = version
    for i in range(8):
        out[8 + i] = v & 0xFF
        v >>= 8
    at = HEADER
    index = np.empty(2 * chunks, np.uint64)
    bound = (out.shape[0] - HEADER - 16 * chunks - 4) // chunks - 4
    src_at = _address(src)
    out_at = _address(out)
    for c in range(chunks):
        n = _call(fn, cctx, out_at + at, bound, src_at + c * chunk_bytes, chunk_bytes, level)
        if n < 0 or n > bound:
            return -1
        crc = _crc(out, at, n, table)
        for i in range(4):
            out[at + n + i] = (crc >> (8 * i)) & 0xFF
        index[2 * c] = at
        index[2 * c + 1] = n + 4
        at += n + 4
    start = at
    for j in range(2 * chunks):
        v = index[j]
        for i in range(8):
            out[at] = v & 0xFF
            v >>= 8
            at += 1
    crc = _crc(out, start, 16 * chunks, table)
    for i in range(4):
        out[at + i] = (crc >> (8 * i)) & 0xFF
    return at + 4


def encode_shard(ctx: Context, level: int, src: np.ndarray, chunks: int, chunk_bytes: int, version: int, out: np.ndarray) -> int:
    """Encode ``src`` (``chunks * chunk_bytes`` bytes) as one shard file into ``out``
    (``shard_bound`` bytes): the header (magic, ``version``), each inner chunk as a
    zstd frame plus its crc32c, then the shard index (offset, bytes per chunk) and its
    crc32c. Returns the bytes used."""
    n = int(_encode(ctx.fn, ctx.ptr, level, src, chunks, chunk_bytes, version, out, _TABLE))
    if n < 0:
        raise RuntimeError("zstd: compressing a chunk failed")
    return n


def encode_shard_lz4(itemsize: int, src: np.ndarray, chunks: int, chunk_bytes: int, version: int) -> bytes:
    """``encode_shard`` for blosc-lz4 inner chunks (encoded by numcodecs, one call per chunk:
    a write-time cost, once per chunk)."""
    from numcodecs import Blosc

    blosc = Blosc(cname="lz4", clevel=5, shuffle=Blosc.NOSHUFFLE if itemsize == 1 else Blosc.SHUFFLE, blocksize=0)
    parts = [MAGIC.tobytes() + int(version).to_bytes(8, "little")]
    index = np.empty((chunks, 2), "<u8")
    at = HEADER
    for c in range(chunks):
        blob = bytes(blosc.encode(src[c * chunk_bytes : (c + 1) * chunk_bytes].view(f"u{itemsize}" if itemsize in (1, 2, 4, 8) else "u1")))
        blob += crc32c(np.frombuffer(blob, np.uint8)).to_bytes(4, "little")
        parts.append(blob)
        index[c] = at, len(blob)
        at += len(blob)
    raw = index.tobytes()
    return b"".join(parts) + raw + crc32c(np.frombuffer(raw, np.uint8)).to_bytes(4, "little")


# -- the decoded-chunk cache -------------------------------------------------------------
def _anonymous(nbytes: int) -> np.ndarray:
    """Zeroed anonymous memory of ``nbytes``, backed by transparent huge pages where the
    kernel allows (``MADV_HUGEPAGE``): slots scattered over hundreds of MiB otherwise
    cost a TLB miss per page touched (a cold decode ran ~30% slower, measured)."""
    import mmap

    size = max(nbytes, 1)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(region, np.uint8, count=nbytes)


class Cache:
    """Decoded chunks of one column: ``slots`` of ``chunk_bytes``, grouped in sets of
    ``WAYS``; the chunk id and version held by each slot (-1: empty) and when it was
    last used."""

    def __init__(self, chunk_bytes: int, cache_bytes: int) -> None:
        sets = max(1, cache_bytes // (chunk_bytes * WAYS))
        self.chunk_bytes = chunk_bytes
        self.data = _anonymous(sets * WAYS * chunk_bytes)  # pages are touched only when used
        self.chunk = np.full(sets * WAYS, -1, np.int64)
        self.version = np.full(sets * WAYS, -1, np.int64)
        self.used = np.zeros(sets * WAYS + 1, np.int64)  # the last entry is the clock
        self.stats = np.zeros(2, np.int64)  # chunks served from the cache, chunks decoded

    def clear(self) -> None:
        self.chunk[:] = -1


@numba.njit(nogil=True, cache=True)
def _decode_rows(
    kind: int, fn: int, dctx: int, check: int, rows: Any, versions: Any, positions: Any, inner: int, shard_rows: int, row_bytes: int,
    file_addr: Any, file_size: Any, data: Any, chunk: Any, version: Any, used: Any, stats: Any, out: Any, table: Any,
    fail: Any,
) -> int:
    n = rows.shape[0]
    chunk_bytes = inner * row_bytes
    slots = chunk.shape[0]
    sets = slots // 4
    per_shard = shard_rows // inner
    order = np.argsort(rows // inner)
    nbytes = np.zeros(1, np.int64)
    nbytes_at = _address(nbytes)
    scratch = np.empty(chunk_bytes + 64, np.uint8)  # a cold chunk is decoded here (hot), then streamed to its slot
    scratch_at = _address(scratch)
    data_at = _address(data)
    i = 0
    while i < n:
        r0 = rows[order[i]]
        c = r0 // inner
        v = versions[order[i]]
        j = i + 1
        while j < n and rows[order[j]] // inner == c:
            j += 1
        base = (c % sets) * 4
        slot = -1
        fresh = False  # decoded now: its rows are copied from the scratch, still in the CPU's cache
        oldest = base
        for w in range(base, base + 4):
            if chunk[w] == c and version[w] == v:
                slot = w
                break
            if used[w] < used[oldest]:
                oldest = w
        if slot >= 0:
            stats[0] += 1
        else:
            stats[1] += 1
            slot = oldest
            chunk[slot] = -1
            f = (c * inner) // shard_rows
            ci = c % per_shard
            size = file_size[f]
            if file_addr[f] == 0:
                fail[0], fail[1], fail[2] = f, ci, 1
                return -1
            off, nb, why = _checked_chunk(_carray(_pointer(file_addr[f]), size), size, size - 16 * per_shard - 4, ci, table)
            if why:
                fail[0], fail[1], fail[2] = f, ci, why
                return -1
            if kind == 0:
                got = _call(fn, dctx, scratch_at, chunk_bytes, file_addr[f] + off, nb, 0)
            elif _validate(check, file_addr[f] + off, nb, nbytes_at) != 0 or nbytes[0] != chunk_bytes:
                got = -1
            else:
                got = _blosc(fn, file_addr[f] + off, scratch_at, chunk_bytes)
            if got != chunk_bytes:
                fail[0], fail[1], fail[2] = f, ci, 4
                return -1
            if chunk_bytes % 8 == 0:
                _stream(data, slot * chunk_bytes, scratch, 0, chunk_bytes)
            else:
                _memcpy(data, slot * chunk_bytes, scratch, 0, chunk_bytes)
            chunk[slot] = c
            version[slot] = v
            fresh = True
        used[slots] += 1
        used[slot] = used[slots]
        src = 0 if fresh else slot * chunk_bytes
        for q in range(i, j):
            k = order[q]
            s = src + (rows[k] % inner) * row_bytes
            d = positions[k] * row_bytes
            if d < 0 or d + row_bytes > out.shape[0]:
                raise ValueError("decode_rows: a position outside out")
            if fresh:
                _memcpy(out, d, scratch, s, row_bytes)
            else:
                _memcpy(out, d, data, s, row_bytes)
        i = j
    return 0


REASONS = {1: "its shard file is missing or too short", 2: "its entry in the shard index points outside the file",
           3: "crc32c mismatch", 4: "the codec cannot decode it to the chunk's size"}


def decode_rows(
    ctx: Context, rows: np.ndarray, versions: np.ndarray, positions: np.ndarray, inner: int, shard_rows: int,
    row_bytes: int, file_addr: np.ndarray, file_size: np.ndarray, cache: Cache, out: np.ndarray,
) -> tuple[int, int, str] | None:
    """Copy rows ``rows`` (global ids; ``versions``: the absolute shard each was written
    as) into ``out`` (flat bytes) at row positions ``positions``, decoding through
    ``cache`` the inner chunks it lacks from the mapped shard files (``file_addr``,
    ``file_size`` per shard; each mapping checked to hold the version wanted).
    Returns None, or (shard, inner chunk, reason) of the first chunk that fails its
    checks (nothing is cached from it)."""
    fail = np.zeros(3, np.int64)
    if _decode_rows(ctx.kind, ctx.fn, ctx.ptr, ctx.check, rows, versions, positions, inner, shard_rows, row_bytes, file_addr, file_size,
                    cache.data, cache.chunk, cache.version, cache.used, cache.stats, out, _TABLE, fail) < 0:
        return int(fail[0]), int(fail[1]), REASONS[int(fail[2])]
    return None
