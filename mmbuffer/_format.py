"""The on-disk format of an mmbuffer store, format version 2 (``FORMAT_VERSION``).

A store is one directory that is also a valid **Zarr v3 group**, so zarr-python,
tensorstore or xarray read it without mmbuffer. Nothing in it is a pickle::

    store/
      zarr.json            Zarr v3 group metadata; attributes["mmbuffer"] say which rows
                           and episodes are live, refreshed by each commit (zarr_view.py)
      manifest.json        the commit record (JSON, see below); replaced atomically
      columns/<name>/      one Zarr array per column, shape [capacity, *row_shape]
      final/<name>/        the observation after each episode's last row, for every
                           next-derived column, stored at that last row's id (sparse)
      index/ends/          int64 [num_streams * 2 * lane_size]: per lane, a ring of
                           episode ends (absolute, exclusive row counters)
      index/reserved/      int64 [num_streams]: rows the writer may have overwritten
                           past its last commit (see ``store.py``)
      priority/<level>/    priority tree arrays (``mmbuffer.tree``), when enabled
      sampler/<name>.json  persisted sampler state (``sampling.EpochSampler``)
      LOCK                 advisory lock file of the single writer (pid, host)

Raw arrays (the default, and always the index and the tree) hold a single shard
with the ``bytes`` codec and the shard index at the end. The first
``rows * row_bytes`` bytes of the shard file ``c/0[/0...]`` are then exactly a
C-order numpy array, which mmbuffer memory-maps (and writes large blocks into
with ``pwrite``), while a Zarr reader still makes
partial reads through the shard index (one entry per inner chunk of about
``config.chunk_bytes``). mmbuffer writes that index itself when it creates the file
(every inner chunk present, crc32c like zarr's default), and allocates the file
sparse, so an empty store of 3e9 rows costs no disk. One shard per array keeps a
column one memory map: a gather is one fancy-index, never a split by shard.

Compressed arrays (``compression="zstd"|"lz4"``) are ordinary chunked Zarr arrays
read and written through zarr-python; they are for archives (see ``mmbuffer copy``).

``manifest.json`` fields: ``format`` ("mmbuffer"), ``format_version``,
``generation`` (commit counter), ``capacity``, ``num_streams``, ``lane_size``,
``columns`` (name -> {shape, dtype}), ``next_keys``, ``compression``,
``priorities`` (null or {alpha, eps, max_priority}), ``lanes`` (per lane:
``written``, ``ep_head``, ``ep_tail``, ``first_start``; all int64 counters that
never wrap) and ``attrs`` (user metadata). Readers ignore every row past a lane's
committed ``written``; unknown top-level manifest fields are ignored (room for
additions that old readers may skip), everything named is checked (``_manifest.py``).

What a store may contain, and how it is opened: everything inside the directory
is opened without following symbolic links and must be a regular file or a
directory (``_safe_io.py``); every ``zarr.json`` must describe exactly the array
the manifest implies: an allowed dtype (bool, signed and unsigned integers,
floats), the shape, one shard of whole-row chunks with the index at the end for
raw arrays, and only ``bytes`` plus at most one ``zstd``/``blosc`` codec for
compressed ones. Counters are checked against each other and the index at open
(``_counters.py``). Anything else is ``CorruptStoreError``, never a repair.

Version history
---------------
1 (2026-11-22, first session)
    Priority tree: float32 leaves in blocks of 64 under a binary heap of float64
    block sums and float32 min/max. Refused with ``FormatVersionError``.
2 (2026-11-22, second session)
    Priority tree of float32 leaves in blocks of 64 under a 16-ary tree of float64
    sums and running sums and float32 min/max (``mmbuffer.tree``): 4.41 bytes per row,
    one gathered row per level per draw. No other change.
    Since then, without a version change (a store of either time reads the same):
    ``index/reserved`` is kept at a dead writer's value by recovery (readers of an
    older commit must keep away from the rows it may have rewritten) and stays
    within ``written + 2 * lane_size`` of the last commit (``extend`` commits before
    a lane's uncommitted rows exceed a lane); ``zarr.json`` files are checked as
    above on open.
    2026-11-23, additive, so no version change: every array's ``zarr.json`` names its
    dimensions (``dimension_names``, which xarray needs), and each commit refreshes
    the root group's ``"mmbuffer"`` attributes with the live rows and episodes
    (``zarr_view.py``). mmbuffer reads neither: stores without them open as before,
    and an older mmbuffer opens the new stores (it accepts ``dimension_names``).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import mmap
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any, Final

import numpy as np

from . import _safe_io, errors
from .config import config

FORMAT_NAME: Final = "mmbuffer"
FORMAT_VERSION: Final = 2
_MADV_POPULATE_READ: Final = 22  # Linux >= 5.14; Python 3.11's mmap module lacks it
MANIFEST: Final = "manifest.json"
LOCK: Final = "LOCK"
RESERVED_NAMES: Final = frozenset({"terminated", "truncated"})
COMPRESSIONS: Final = (None, "zstd", "lz4")
PWRITE_MIN_BYTES: Final = 1 << 16

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*$")


# -- validation ----------------------------------------------------------------------
def check_column_name(name: object) -> str:
    """Return ``name`` if it is a legal column name, else raise ``SchemaError``.

    Names are path-safe: letters, digits, ``_ . -``, and ``/`` only as a nesting
    separator between non-empty parts (``obs/pixels``, as Minari's dict spaces).
    """
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise errors.SchemaError(
            f"column name: expected letters, digits, '_', '.', '-' and '/' between parts, got {name!r}"
        )
    if name.startswith("next_"):
        raise errors.SchemaError(
            f"column {name!r}: names starting with 'next_' are reserved for derived next values"
        )
    return name


def check_dtype(name: str, dtype: object) -> np.dtype:
    try:
        dt: np.dtype = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as exc:
        raise errors.SchemaError(f"column {name!r}: expected a numpy dtype, got {dtype!r}") from exc
    if dt.kind not in "biuf" or dt.hasobject:
        raise errors.SchemaError(
            f"column {name!r}: expected a bool, integer or float dtype, got {dt}"
        )
    return dt.newbyteorder("=")


def check_shape(name: str, shape: object) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        out = tuple(int(s) for s in shape)  # type: ignore[attr-defined]
    except TypeError as exc:
        raise errors.SchemaError(f"column {name!r}: expected a shape tuple, got {shape!r}") from exc
    if any(s < 1 for s in out):
        raise errors.SchemaError(f"column {name!r}: expected positive dimensions, got {out}")
    return out


# -- raw (memory-mapped) arrays --------------------------------------------------------
def _chunk_rows(rows: int, row_bytes: int) -> int:
    """Rows per inner chunk: a power of two of about ``config.chunk_bytes``."""
    target = max(1, config.chunk_bytes // max(1, row_bytes))
    return int(min(1 << (target.bit_length() - 1), 1 << max(0, (rows - 1).bit_length())))


def _shard_file(array_dir: Path, ndim: int) -> Path:
    return array_dir.joinpath("c", *(["0"] * ndim))


def create_raw(
    root: Path, name: str, rows: int, row_shape: tuple[int, ...], dtype: np.dtype, *, allocate: bool = False
) -> None:
    """Create a raw single-shard Zarr array and its sparse shard file; ``allocate``
    reserves the disk blocks of every row at once (arrays written whole at creation)."""
    import google_crc32c  # creating needs zarr; opening a store (mmbuffer info) does not
    import zarr

    from .zarr_view import dimension_names  # what xarray needs; documented there

    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
    chunk = _chunk_rows(rows, row_bytes)
    shard_rows = -(-rows // chunk) * chunk
    zarr.create_array(
        str(root),
        name=name,
        shape=(rows, *row_shape),
        dtype=dtype,
        chunks=(chunk, *row_shape),
        shards=(shard_rows, *row_shape),
        compressors=None,
        filters=None,
        fill_value=0,
        zarr_format=3,
        write_data=False,
        dimension_names=dimension_names(name, len(row_shape)),
    )
    n_chunks = shard_rows // chunk
    chunk_bytes = chunk * row_bytes
    index = np.empty((n_chunks, 2), dtype="<u8")
    index[:, 0] = np.arange(n_chunks, dtype=np.uint64) * np.uint64(chunk_bytes)
    index[:, 1] = chunk_bytes
    blob = index.tobytes()
    blob += google_crc32c.value(blob).to_bytes(4, "little")
    path = _shard_file(root / name, 1 + len(row_shape))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(shard_rows * row_bytes)  # sparse: no block is allocated yet
        f.seek(shard_rows * row_bytes)
        f.write(blob)
        f.flush()
        if allocate:
            reserve_rows(f.fileno(), row_bytes, 0, shard_rows)


_BYTES_LE: Final = {"name": "bytes", "configuration": {"endian": "little"}}
_ARRAY_KEYS: Final = frozenset({
    "shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs",
    "attributes", "zarr_format", "node_type", "storage_transformers", "dimension_names",
})
_BLOSC_CNAMES: Final = ("lz4", "lz4hc", "blosclz", "zstd", "zlib")
_BLOSC_SHUFFLES: Final = ("noshuffle", "shuffle", "bitshuffle")
MAX_ROWS: Final = 1 << 48  # any larger shape or counter in a store is corruption
Expect = tuple[int, tuple[int, ...], np.dtype]


def _is_int(x: object, low: int = 0, high: int = MAX_ROWS) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def _bytes_codec_ok(codec: object, dtype: np.dtype) -> bool:
    if codec == _BYTES_LE:
        return True
    # zarr omits the endianness of one-byte types
    return dtype.itemsize == 1 and codec in ({"name": "bytes"}, {"name": "bytes", "configuration": {}})


def _compressor_ok(codec: object) -> bool:
    if not isinstance(codec, dict) or set(codec) - {"name", "configuration"}:
        return False
    conf = codec.get("configuration", {})
    if not isinstance(conf, dict):
        return False
    if codec.get("name") == "zstd":
        return set(conf) <= {"level", "checksum"} and _is_int(conf.get("level", 0), -131072, 22) and isinstance(
            conf.get("checksum", False), bool
        )
    if codec.get("name") == "blosc":
        return (
            set(conf) <= {"typesize", "cname", "clevel", "shuffle", "blocksize"}
            and conf.get("cname", "lz4") in _BLOSC_CNAMES
            and _is_int(conf.get("clevel", 5), 0, 9)
            and conf.get("shuffle", "shuffle") in _BLOSC_SHUFFLES
            and _is_int(conf.get("typesize", 1), 1, 1 << 16)
            and _is_int(conf.get("blocksize", 0), 0, 1 << 31)
        )
    return False


def check_array_meta(where: Path, meta: object, expect: Expect | None, *, raw: bool) -> tuple[tuple[int, ...], np.dtype, int]:
    """Check an array's ``zarr.json`` against what mmbuffer writes; return its shape,
    dtype and rows per shard (raw) or per chunk (compressed).

    ``expect``: ``(rows, row_shape, dtype)`` from the manifest, when known. A raw
    array must be one shard of whole-row inner chunks with the ``bytes`` codec
    (little-endian) and the index at the end, so that its file starts with the
    C-order array; a compressed one ``bytes`` then at most one of ``zstd``/``blosc``.
    Anything else raises ``CorruptStoreError`` naming the field, expected and got.
    """

    def bad(field: str, want: object, got: object) -> errors.CorruptStoreError:
        return errors.CorruptStoreError(f"{where}: {field}: expected {want}, got {got!r}")

    if not isinstance(meta, dict):
        raise bad("metadata", "a JSON object", type(meta).__name__)
    unknown = set(meta) - _ARRAY_KEYS
    if unknown:
        raise bad("keys", f"only {sorted(_ARRAY_KEYS)}", sorted(unknown))
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        raise bad("zarr_format/node_type", "3/'array'", (meta.get("zarr_format"), meta.get("node_type")))
    if meta.get("storage_transformers", []) != []:
        raise bad("storage_transformers", "[]", meta.get("storage_transformers"))
    shape = meta.get("shape")
    if not isinstance(shape, list) or not shape or not all(_is_int(s, 1) for s in shape):
        raise bad("shape", f"a non-empty list of integers in [1, {MAX_ROWS}]", shape)
    dims = meta.get("dimension_names")  # written since 2026-11-23; absent before
    if dims is not None and (not isinstance(dims, list) or len(dims) != len(shape) or not all(d is None or isinstance(d, str) for d in dims)):
        raise bad("dimension_names", f"absent or a list of {len(shape)} names", dims)
    name = meta.get("data_type")
    try:
        if not isinstance(name, str) or np.dtype(name).name != name:
            raise TypeError(name)
        dtype = check_dtype(str(where), name)
    except (TypeError, errors.SchemaError):
        raise bad("data_type", "one of bool, int8-64, uint8-64, float16-64", name) from None
    if expect is not None:
        rows, row_shape, want_dtype = expect
        if tuple(shape) != (rows, *row_shape):
            raise bad("shape", [rows, *row_shape], shape)
        if dtype != np.dtype(want_dtype):
            raise bad("data_type", f"{np.dtype(want_dtype).name} (as the manifest says)", name)
    if meta.get("chunk_key_encoding") != {"name": "default", "configuration": {"separator": "/"}}:
        raise bad("chunk_key_encoding", "default with separator '/'", meta.get("chunk_key_encoding"))
    grid = meta.get("chunk_grid")
    chunk = grid.get("configuration", {}).get("chunk_shape") if isinstance(grid, dict) and isinstance(grid.get("configuration"), dict) else None
    if (
        not isinstance(grid, dict)
        or grid.get("name") != "regular"
        or not isinstance(chunk, list)
        or len(chunk) != len(shape)
        or not _is_int(chunk[0], 1)
        or chunk[1:] != shape[1:]
    ):
        raise bad("chunk_grid", f"regular, chunk_shape [rows, {', '.join(map(str, shape[1:]))}]", grid)
    fill = meta.get("fill_value")
    if not isinstance(fill, (bool, int, float)) and fill not in ("NaN", "Infinity", "-Infinity"):
        raise bad("fill_value", "a number", fill)
    codecs = meta.get("codecs")
    if not raw:
        ok = (
            isinstance(codecs, list)
            and 1 <= len(codecs) <= 2
            and _bytes_codec_ok(codecs[0], dtype)
            and all(_compressor_ok(c) for c in codecs[1:])
        )
        if not ok:
            raise bad("codecs", "bytes, then at most one of zstd, blosc", codecs)
        return tuple(shape), dtype, int(chunk[0])
    shard_rows = int(chunk[0])
    conf = codecs[0].get("configuration") if isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict) else None
    inner = conf.get("chunk_shape") if isinstance(conf, dict) else None
    ok = (
        isinstance(conf, dict)
        and isinstance(codecs, list)
        and codecs[0] == {"name": "sharding_indexed", "configuration": conf}
        and set(conf) == {"chunk_shape", "codecs", "index_codecs", "index_location"}
        and isinstance(inner, list)
        and len(inner) == len(shape)
        and _is_int(inner[0], 1)
        and inner[1:] == shape[1:]
        and shard_rows % inner[0] == 0
        and shape[0] <= shard_rows < shape[0] + inner[0]
        and isinstance(conf["codecs"], list)
        and len(conf["codecs"]) == 1
        and _bytes_codec_ok(conf["codecs"][0], dtype)
        and conf["index_codecs"] == [_BYTES_LE, {"name": "crc32c"}]
        and conf["index_location"] == "end"
    )
    if not ok:
        raise bad(
            "codecs",
            "one shard of whole-row chunks (sharding_indexed, bytes little-endian, index crc32c at the end)",
            codecs,
        )
    return tuple(shape), dtype, shard_rows


def open_raw_fd(root: Path, name: str, *, writable: bool, expect: Expect | None = None) -> tuple[np.ndarray, int]:
    """Memory-map the raw array ``root/name`` as ``[rows, *row_shape]``; also return
    the descriptor of its shard file (the caller closes it).

    ``zarr.json`` is checked against ``expect`` (:func:`check_array_meta`); every
    file is opened without following links and the map is made from that
    descriptor, never by path again.
    """
    meta = read_json_in(root, f"{name}/zarr.json")
    shape, dtype, shard_rows = check_array_meta(root / name / "zarr.json", meta, expect, raw=True)
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
        handle = mmap.mmap(fd, nbytes, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    except BaseException:
        os.close(fd)
        raise
    if config.madvise_random and hasattr(mmap, "MADV_RANDOM"):
        handle.madvise(mmap.MADV_RANDOM)  # read-ahead wrecks cold random gathers
    # a plain ndarray over our own map (np.memmap's subclass hooks cost microseconds per access)
    return np.ndarray(shape, dtype=dtype, buffer=handle), fd


def open_raw(root: Path, name: str, *, writable: bool, expect: Expect | None = None) -> np.ndarray:
    """Memory-map the raw array ``root/name`` as ``[rows, *row_shape]`` (see :func:`open_raw_fd`)."""
    arr, fd = open_raw_fd(root, name, writable=writable, expect=expect)
    os.close(fd)
    return arr


def raw_file(root: Path, name: str) -> Path:
    """The shard file holding raw array ``root/name``'s rows from byte 0."""
    meta = read_json_in(root, f"{name}/zarr.json")
    shape, _, _ = check_array_meta(root / name / "zarr.json", meta, None, raw=True)
    return _shard_file(root / name, len(shape))


def write_rows(fd: int, mm: np.ndarray, start: int, rows: np.ndarray) -> None:
    """Write ``rows`` at row ``start`` of the raw array mapped as ``mm``, with pwrite.

    The page cache is shared with every memory map of the file, so readers see the
    rows at once; a write() fills fresh pages 2-4x faster than stores through a
    map advised MADV_RANDOM (measured on this project's dev machine). Blocks under
    ``PWRITE_MIN_BYTES`` go through the map: there the syscall costs more.
    """
    if rows.nbytes < PWRITE_MIN_BYTES:  # a few rows: a store through the map is cheaper
        mm[start : start + len(rows)] = rows
        return
    data = np.ascontiguousarray(rows, dtype=mm.dtype).data.cast("B")
    offset = start * mm.strides[0]
    while len(data):
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def read_rows(fd: int, mm: np.ndarray, start: int, out: np.ndarray) -> None:
    """Fill ``out`` (C-contiguous) with the rows from row ``start`` of the raw array
    mapped as ``mm``, with pread: the mirror of :func:`write_rows`."""
    if out.dtype != mm.dtype or out.shape[1:] != mm.shape[1:] or not out.flags.c_contiguous:
        raise ValueError(f"read_rows: out must be C-contiguous {mm.dtype} rows of shape {mm.shape[1:]}")
    data = out.reshape(-1).view(np.uint8).data
    offset = start * mm.strides[0]
    while len(data):
        done = os.preadv(fd, [data], offset)
        if done == 0:
            raise errors.CorruptStoreError(f"read_rows: file ends before byte {offset}")
        data, offset = data[done:], offset + done


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
    for a 2.5 GB priority tree (benchmarks/RESULTS.md). Calls ``madvise`` through ctypes,
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


def is_mapped(arr: object) -> bool:
    return isinstance(arr, np.ndarray) and _mmap_of(arr) is not None


# -- compressed arrays -----------------------------------------------------------------
def create_compressed(
    root: Path, name: str, rows: int, row_shape: tuple[int, ...], dtype: np.dtype, compression: str
) -> None:
    import zarr
    from zarr.codecs import BloscCodec, ZstdCodec

    from .zarr_view import dimension_names  # what xarray needs; documented there

    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
    compressor = ZstdCodec(level=3) if compression == "zstd" else BloscCodec(cname="lz4", clevel=5)
    zarr.create_array(
        str(root),
        name=name,
        shape=(rows, *row_shape),
        dtype=dtype,
        chunks=(_chunk_rows(rows, row_bytes), *row_shape),
        compressors=[compressor],
        filters=None,
        fill_value=0,
        zarr_format=3,
        dimension_names=dimension_names(name, len(row_shape)),
    )


# -- metadata ------------------------------------------------------------------------
def read_json_in(root: Path, rel: str) -> Any:
    """Parse JSON file ``root/rel`` of a store, opened without following links."""
    where = root / rel
    data = _safe_io.read_bytes(root, rel)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, absurd nesting
        raise errors.CorruptStoreError(f"{where}: not valid JSON ({exc})") from None


def read_json(path: Path) -> Any:
    """Parse JSON file ``path`` (its last component must not be a link)."""
    return read_json_in(path.parent, path.name)


def atomic_write_json(path: Path, obj: Any, *, durable: bool = True) -> None:
    """Write JSON to ``path.partial``, fsync, rename over ``path``, fsync the directory.

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
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of store ``path`` as a JSON object, format and version checked
    (the rest: ``_manifest.parse``)."""
    file = path / MANIFEST
    if not path.is_dir():
        raise errors.StoreNotFoundError(f"{path}: no such store directory")
    if not os.path.lexists(file):
        raise errors.StoreNotFoundError(f"{path}: not an mmbuffer store (no {MANIFEST})")
    manifest = read_json_in(path, MANIFEST)
    if not isinstance(manifest, dict):
        raise errors.CorruptStoreError(f"{file}: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT_NAME:
        raise errors.CorruptStoreError(
            f"{file}: expected format {FORMAT_NAME!r}, got {manifest.get('format')!r}"
        )
    version = manifest.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise errors.FormatVersionError(
            f"{file}: expected format_version {FORMAT_VERSION}, got {version!r}; "
            "this mmbuffer cannot read it"
        )
    return manifest


def lock_owner() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


# -- disk space and atomic placement ---------------------------------------------------
_AT_FDCWD: Final = -100
_RENAME_NOREPLACE: Final = 1


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


def reserve_raw(root: Path, name: str, start: int, stop: int) -> None:
    """:func:`reserve_rows` for rows ``[start, stop)`` of the raw array ``root/name``."""
    meta = read_json_in(root, f"{name}/zarr.json")
    shape, dtype, _ = check_array_meta(root / name / "zarr.json", meta, None, raw=True)
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    rel = "/".join([name, "c", *(["0"] * len(shape))])
    fd = _safe_io.open_file(root, rel, os.O_RDWR)
    try:
        reserve_rows(fd, row_bytes, start, stop)
    except OSError as exc:  # name the file: posix_fallocate's error does not
        raise OSError(exc.errno, exc.strerror, str(root / rel)) from None
    finally:
        os.close(fd)


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
