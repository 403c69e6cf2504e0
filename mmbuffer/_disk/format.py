"""The on-disk format of an mmbuffer store, format version 5 (``FORMAT_VERSION``).

A store is one directory that is also a valid **Zarr v3 group**, so zarr-python,
tensorstore or xarray read it without mmbuffer. Nothing in it is a pickle::

    store/
      zarr.json            Zarr v3 group metadata; attributes["mmbuffer"] say which rows
                           and episodes are live, refreshed by each commit (zarr_view.py)
      manifest.json        the commit record (JSON, see below); replaced atomically
      columns/<name>/      one Zarr array per column, shape [capacity, *row_shape]
      final/<name>/        the observation after each episode's last row, for every
                           next-derived column: per lane a ring of ``lane_size``
                           slots, episode ``k`` of lane ``l`` at row ``l * lane_size
                           + k % lane_size`` (``_ledger/finals.py``); sparse, only the
                           slots of live episodes take disk (version 3: at the
                           episode's last row id)
      index/ends/          int64 [num_streams * 2 * lane_size]: per lane, a ring of
                           episode ends (absolute, exclusive row counters)
      index/reserved/      int64 [num_streams]: rows the writer may have overwritten
                           past its last commit (see ``writer.py``)
      index/progress/      int64 [2 + num_streams]: boot id, then how far the writer
                           really wrote, per lane (``_ledger/progress.py``)
      priority/<level>/    priority tree arrays (``mmbuffer.tree``), when enabled
      priority/touched/    uint8 [ceil(capacity / 64)]: the tree blocks a checkpoint
                           is writing (``_ledger/touched.py``)
      priority/log-<c>     the priority log since checkpoint ``c`` (``prilog.py``)
      sampler/<name>.json  persisted sampler state (``samplers/epoch.py``)
      LOCK                 advisory lock file of the single writer (pid, host)

Raw arrays (the default, and always the index and the tree) hold a single shard
with the ``bytes`` codec and the shard index at the end. The first
``rows * row_bytes`` bytes of the shard file ``c/0[/0...]`` are then exactly a
C-order numpy array, which mmbuffer memory-maps (and writes large blocks into
with ``pwrite``), while a Zarr reader still makes
partial reads through the shard index (one entry per inner chunk of about
``config.chunk_bytes``), which mmbuffer writes at creation (crc32c, as zarr's
default) in a sparse file: an empty store of 3e9 rows costs no disk.

Compressed arrays (``compression="zstd"|"lz4"``) are ordinary chunked Zarr arrays
read and written through zarr-python; they are for archives (see ``mmbuffer copy``).
A column with a codec (``mb.Column(..., codec="zstd")``) is a sharded Zarr array of
small zstd chunks plus a raw staging area (``columns/sharding.py``, docs/format.md).

``manifest.json`` fields: ``format`` ("mmbuffer"), ``format_version``,
``generation`` (commit counter), ``capacity``, ``num_streams``, ``lane_size``,
``columns`` (name -> {shape, dtype}, plus ``codec`` for a column with one),
``next_keys``, ``compression``, ``store_id`` (drawn at creation),
``priorities`` (null or {alpha, eps, max_priority}), ``lanes`` (per lane:
``written``, ``ep_head``, ``ep_tail``, ``first_start``; all int64 counters that
never wrap) and ``attrs`` (user metadata). Readers ignore every row past a lane's
committed ``written``; unknown top-level manifest fields are ignored (room for
additions that old readers may skip), everything named is checked (``_ledger/manifest.py``).

What a store may contain, and how it is opened: everything inside the directory
is opened without following symbolic links and must be a regular file or a
directory (``safe_io.py``); every ``zarr.json`` must describe exactly the array
the manifest implies: an allowed dtype (bool, signed and unsigned integers,
floats), the shape, one shard of whole-row chunks with the index at the end for
raw arrays, and only ``bytes`` plus at most one ``zstd``/``blosc`` codec for
compressed ones. Counters are checked against each other and the index at open
(``_ledger/counters.py``). Anything else is ``CorruptStoreError``, never a repair.

This module is the spec and its checks (names, dtypes, shapes, ``zarr.json``,
the manifest's format and version) and creates arrays (``create_raw``,
``create_compressed``). The bytes are read and written elsewhere: raw arrays by
``rawio.py`` (maps, ``pwrite``/``pread``, page cache) behind ``columns/``, JSON
files, atomic placement and disk room by ``files.py``.

Version history
---------------
1 (2026-11-22, first session)
    Priority tree: float32 leaves in blocks of 64 under a binary heap of float64
    block sums and float32 min/max. Refused with ``FormatVersionError``.
2 (2026-11-22, second session)
    Priority tree of float32 leaves in blocks of 64 under a 16-ary tree of float64
    sums and running sums and float32 min/max (``mmbuffer.tree``): 4.41 bytes per row,
    one gathered row per level per draw. No other change.
    Since then, without a version change: ``index/reserved`` is kept at a dead
    writer's value by recovery and stays within ``written + 2 * lane_size`` of the
    last commit; ``zarr.json`` files are checked as above on open.
3 (2026-11-23, issue 12)
    Priority tree as two arrays, ``priority/leaves`` (float32, as before) and
    ``priority/nodes`` (float64 [R, 32]: per row of 16 slots their float64 sums,
    uint32 min codes ``0x7F800000 - bits(min)`` and float32 maxs, 256 bytes, so
    16 rows per page), replacing ``sums``, ``prefix``, ``mins`` and ``maxs``: every
    empty value is zero bytes, so the files are created sparse and untouched
    regions cost no disk; 4.27 bytes per row. Version 2 stores are refused with
    ``FormatVersionError``. Also new with version 3, and additive (mmbuffer reads
    neither; an older reader accepts both): every array's ``zarr.json`` names its
    dimensions (``dimension_names``, which xarray needs), and each commit refreshes
    the root group's ``"mmbuffer"`` attributes with the live rows and episodes
    (``zarr_view.py``, docs/format.md).
    Since then, without a version change: ``index/progress`` and ``priority/touched``
    (issue 22), which only the writer reads (it creates them in a store without them).
    Also without a version change (issue 23, 2026-11-25): a column may name its codec
    (``columns[name].codec``, ``"zstd"``, ``"zstd:<level>"`` or ``"lz4"``); such a column is a sharded
    Zarr array with a staging area (``staging/<name>/rows`` and ``tags``). A store without
    one is written and read exactly as before; a reader from before this change refuses a
    manifest that names a codec (``CorruptStoreError``: it checks every column's keys); also the lossy ``"jpeg[:<quality>]"`` (``columns/jpeg.py``), which older readers refuse.
4 (2026-11-25, issue 23)
    Final observations addressed by episode, not by row: ``final/<col>`` keeps, per
    lane, a ring of ``lane_size`` slots, episode ``k``'s final observation in slot
    ``k % lane_size`` (its sequence number in ``index/ends``), written in episode
    order and sparse: a store's disk is its rows plus one final observation per live
    episode (version 3 kept them at the episode's last row id, in a capacity-sized
    array that became as large as the observations once the ring had come round).
    The array keeps its shape; in a store created with ``compression`` it is a
    compressed array like the columns (a published snapshot then ships only the
    chunks of used slots). Version 3 stores open, read and write as before (their
    manifest keeps ``format_version`` 3; ``mmbuffer copy`` makes a version 4 store of
    one); other versions are refused with ``FormatVersionError``.
5 (2026-11-26, issue 26)
    The priority log (``prilog.py``): a commit appends the changed leaf values to
    ``priority/log-<c>`` and the manifest's ``priority_log`` ({checkpoint, bytes})
    says how much of it counts; only a checkpoint writes the tree's pages. The tree
    is the file's plus the log replayed, so version 4 code refuses it by the version.
    A version 4 store opens and becomes version 5 at its first commit; a version 3
    store stays 3 and writes no log (every commit writes the pages).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Final

import numpy as np

from . import files as _files
from .. import errors
from ..config import config

FORMAT_NAME: Final = "mmbuffer"
FORMAT_VERSION: Final = 5
#: the versions this mmbuffer opens: 3 (final observations at rows), 4 (by episode),
#: 5 (and a priority log: ``prilog.py``)
READABLE_VERSIONS: Final = (3, 4, 5)
#: the first version whose manifest may name a priority log (``prilog.py``); a writer
#: migrates a version 4 store to it at its first commit
PRIORITY_LOG: Final = 5
#: the first version whose final observations are addressed by episode
FINALS_BY_EPISODE: Final = 4
MANIFEST: Final = "manifest.json"
LOCK: Final = "LOCK"
RESERVED_NAMES: Final = frozenset({"terminated", "truncated"})
COMPRESSIONS: Final = (None, "zstd", "lz4")
CODECS: Final = ("zstd", "zstd:<level 1-22>", "lz4", "jpeg", "jpeg:<quality 1-100>")  # a column's codec (columns/sharding.py)
#: lossy codecs: only ever chosen by the user, by name (``copy`` keeps one, never picks one)
LOSSY: Final = frozenset({"jpeg"})
JPEG_QUALITY: Final = 95  # ``"jpeg"`` alone

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


def parse_codec(name: str, codec: object) -> tuple[str, int]:
    """A column's codec as (kind, level): ``"zstd"`` (level 3), ``"zstd:<level>"``
    (1-22), ``"lz4"`` (blosc-lz4, level 5), or the lossy ``"jpeg"`` (quality
    ``JPEG_QUALITY``) and ``"jpeg:<quality>"`` (1-100); anything else raises
    ``SchemaError`` naming the column.

    >>> parse_codec("pixels", "zstd:5"), parse_codec("pixels", "zstd"), parse_codec("cam", "jpeg:90")
    (('zstd', 5), ('zstd', 3), ('jpeg', 90))
    """
    if isinstance(codec, str):
        kind, _, level = codec.partition(":")
        if codec == "lz4":
            return "lz4", 5
        top = {"zstd": 22, "jpeg": 100}.get(kind)
        if top is not None and (not level or (level.isdigit() and 1 <= int(level) <= top and level == str(int(level)))):
            return kind, int(level) if level else (3 if kind == "zstd" else JPEG_QUALITY)
    raise errors.SchemaError(f"column {name!r}: codec: expected None (raw) or one of {CODECS}, got {codec!r}")


def check_codec(name: str, codec: object, shape: tuple[int, ...], dtype: np.dtype) -> tuple[str, int]:
    """``parse_codec``, and for the lossy image codec ``jpeg`` the column it may take:
    ``uint8`` frames of shape ``(H, W)``, ``(H, W, 1)`` or ``(H, W, 3)`` (one JPEG
    image per row); anything else raises ``SchemaError`` naming the column, the
    expected and the received shape and dtype.

    >>> check_codec("cam", "jpeg", (224, 224, 3), np.dtype("uint8"))
    ('jpeg', 95)
    >>> check_codec("cam", "jpeg", (3, 224, 224), np.dtype("uint8"))
    Traceback (most recent call last):
        ...
    mmbuffer.errors.SchemaError: column 'cam': codec 'jpeg': expected uint8 frames of shape (H, W), (H, W, 1) or (H, W, 3), got shape (3, 224, 224) and dtype uint8
    """
    kind, level = parse_codec(name, codec)
    if kind == "jpeg" and not (np.dtype(dtype) == np.uint8 and len(shape) in (2, 3) and shape[2:] in ((), (1,), (3,))):
        raise errors.SchemaError(
            f"column {name!r}: codec {codec!r}: expected uint8 frames of shape (H, W), (H, W, 1) or (H, W, 3), "
            f"got shape {tuple(shape)} and dtype {np.dtype(dtype)}"
        )
    return kind, level


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
            _files.reserve_rows(f.fileno(), row_bytes, 0, shard_rows)


_BYTES_LE: Final = {"name": "bytes", "configuration": {"endian": "little"}}
BYTES_LE: Final = _BYTES_LE
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


bytes_codec_ok = _bytes_codec_ok  # the sharded columns' check (columns/sharding.py) shares it


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


# -- compressed arrays -----------------------------------------------------------------
def create_compressed(
    root: Path, name: str, rows: int, row_shape: tuple[int, ...], dtype: np.dtype, compression: str
) -> None:
    import zarr
    from zarr.codecs import BloscCodec, ZstdCodec

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


# -- the manifest ----------------------------------------------------------------------
def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of store ``path`` as a JSON object, format and version checked
    (the rest: ``_manifest.parse``)."""
    file = path / MANIFEST
    if not path.is_dir():
        raise errors.StoreNotFoundError(f"{path}: no such store directory")
    if not os.path.lexists(file):
        raise errors.StoreNotFoundError(f"{path}: not an mmbuffer store (no {MANIFEST})")
    manifest = _files.read_json_in(path, MANIFEST)
    if not isinstance(manifest, dict):
        raise errors.CorruptStoreError(f"{file}: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT_NAME:
        raise errors.CorruptStoreError(
            f"{file}: expected format {FORMAT_NAME!r}, got {manifest.get('format')!r}"
        )
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise errors.FormatVersionError(
            f"{file}: expected format_version {' or '.join(map(str, READABLE_VERSIONS))}, got {version!r}; "
            "this mmbuffer cannot read it"
        )
    return manifest


def dimension_names(name: str, row_ndim: int) -> list[str]:
    """The ``dimension_names`` of array ``name`` (``"columns/obs"``) with ``row_ndim``
    dimensions after the first.

    Arrays with one entry per store row (``columns/*``, ``final/*``) share the
    first dimension ``"row"``; the others name it after themselves (``"ends"``).
    Trailing dimensions are ``<leaf>_1``, ``<leaf>_2``, ... (``obs_1``).

    >>> dimension_names("columns/obs/pixels", 3), dimension_names("index/ends", 0)
    (['row', 'pixels_1', 'pixels_2', 'pixels_3'], ['ends'])
    """
    leaf = name.rsplit("/", 1)[-1]
    first = "row" if name.split("/", 1)[0] in ("columns", "final") else leaf
    return [first, *(f"{leaf}_{i}" for i in range(1, row_ndim + 1))]
