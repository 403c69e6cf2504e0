"""The layout of a column with a codec (``mb.Column(..., codec="zstd")``): Zarr v3 shards.

A column with a codec is a Zarr v3 array with the sharding codec::

    columns/<name>/zarr.json    shape [capacity, *row], chunk_grid [shard_rows, *row],
                                codecs [sharding_indexed: chunk_shape [inner_rows, *row],
                                        codecs [bytes, zstd {level} | blosc lz4, crc32c],
                                        index_codecs [bytes, crc32c], index_location end]
    columns/<name>/c/<s>/0...   one file per complete shard: a 16-byte header (b"MMBSHRD1",
                                then the absolute shard number it holds, int64 LE; bytes no
                                index entry names, so Zarr readers skip them), the inner
                                chunks (zstd frame + crc32c each), the index + its crc32c
    staging/<name>/rows/        raw [num_streams * 2 * shard_rows, *row]: per lane two halves,
                                the rows of the shard being filled and of the one before
    staging/<name>/tags/        raw int64 [num_streams * 2]: the absolute shard number each
                                half holds

zarr-python and tensorstore read every complete shard unchanged (crc32c checked per
chunk and per index); the rows of a lane's shard still being filled are in its
staging half (also a Zarr array). Shards never straddle lanes (``shard_rows``
divides the lane size), so a shard file holds rows of one pass through one lane.

Inner chunks are ``INNER_BYTES`` of rows (a power of two of rows, or the largest
number below it that divides the lane size): the inner-chunk size trades disk for sample time (the measured curve is in
``benchmarks/HISTORY.md``, 2026-11-25). A shard holds up to ``SHARD_CHUNKS`` chunks.

>>> shard_geometry(7056, 1000), shard_geometry(7056, 999)  # 84x84 uint8 rows
((8, 200), (3, 111))
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from ... import errors
from .. import files as _files, format as fmt
from .jpeg import meta as jpeg_meta
from .raw import RawArray

INNER_BYTES = 1 << 16  # bytes of rows per inner chunk (8 rows of 84x84 uint8: the measured curve)
SHARD_CHUNKS = 64  # inner chunks per shard, at most
_CRC: Final = {"name": "crc32c"}


def shard_geometry(row_bytes: int, lane_size: int, inner_bytes: int | None = None) -> tuple[int, int]:
    """Rows per inner chunk and per shard for rows of ``row_bytes`` in lanes of ``lane_size``
    (``inner_bytes``: default ``INNER_BYTES``, read at each call; 1: one row per chunk,
    as the JPEG codec stores one image per chunk)."""
    want = max(1, (INNER_BYTES if inner_bytes is None else inner_bytes) // max(1, row_bytes))
    want = min(1 << (want.bit_length() - 1), lane_size)  # a power of two of rows, when the lane allows
    inner = next(d for d in range(want, 0, -1) if lane_size % d == 0)
    per_lane = lane_size // inner
    chunks = max(d for d in range(1, min(SHARD_CHUNKS, per_lane) + 1) if per_lane % d == 0)
    return inner, inner * chunks


def shard_header(data: bytes) -> int | None:
    """The absolute shard number a shard file's 16-byte header names (None: not a header)."""
    if len(data) < 16 or data[:8] != b"MMBSHRD1":
        return None
    return int.from_bytes(data[8:16], "little", signed=True)


def compressor_meta(codec: str, dtype: np.dtype) -> dict[str, Any]:
    """The ``zarr.json`` entry of ``codec``'s compressor (``fmt.parse_codec``'s names)."""
    kind, level = fmt.parse_codec("codec", codec)
    if kind == "jpeg":
        return jpeg_meta(level)
    if kind == "zstd":
        return {"name": "zstd", "configuration": {"level": level, "checksum": False}}
    shuffle = "noshuffle" if dtype.itemsize == 1 else "shuffle"
    return {"name": "blosc", "configuration": {"typesize": dtype.itemsize, "cname": "lz4", "clevel": level,
                                                "shuffle": shuffle, "blocksize": 0}}


def compressors(codec: str, dtype: np.dtype) -> list[Any]:
    """The zarr codecs after ``bytes`` for ``codec``: its compressor, then ``crc32c``."""
    from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

    conf = compressor_meta(codec, dtype)["configuration"]
    first = ZstdCodec(**conf) if "level" in conf else BloscCodec(**conf)
    return [first, Crc32cCodec()]


def create(root: Path, name: str, rows: int, row_shape: tuple[int, ...], dtype: np.dtype, codec: str,
           lane_size: int, *, inner_bytes: int | None = None, starts: Sequence[int] = ()) -> None:
    """Create the sharded array ``root/columns/<name>`` (no shard file yet) and its staging;
    ``starts``: the absolute row each lane's writing begins at (default 0), whose shard's
    staging half is then taken (the rows before it in that shard are no one's)."""
    import zarr

    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
    lossy = fmt.parse_codec(name, codec)[0] == "jpeg"
    inner, shard = shard_geometry(row_bytes, lane_size, 1 if lossy else inner_bytes)  # JPEG: one image per chunk
    meant = min(shard_geometry(row_bytes, 1 << 62, inner_bytes)[0], lane_size)  # without the divisor rule
    if not lossy and inner * 4 <= meant:
        warnings.warn(
            f"column {name!r}: lanes of {lane_size} rows have no divisor near {meant}, so its {codec} chunks hold "
            f"{inner} row(s) each (compression and one-row extends suffer); choose a capacity whose lanes "
            f"(capacity // num_streams) are a multiple of {meant} rows",
            UserWarning, stacklevel=4,  # the caller of mb.create
        )
    zarr.create_array(
        str(root), name=f"columns/{name}", shape=(rows, *row_shape), dtype=dtype,
        chunks=(inner, *row_shape), shards=(shard, *row_shape), compressors=compressors("zstd" if lossy else codec, dtype),
        filters=None, fill_value=0, zarr_format=3, write_data=False,
        dimension_names=fmt.dimension_names(f"columns/{name}", len(row_shape)),
    )
    if lossy:  # the inner codecs become [jpeg, crc32c] (JPEG is an array -> bytes codec: no "bytes" before it)
        rel = f"columns/{name}/zarr.json"
        meta = _files.read_json_in(root, rel)
        meta["codecs"][0]["configuration"]["codecs"] = [compressor_meta(codec, dtype), _CRC]
        _files.atomic_write_json(root / rel, meta)
    streams = rows // lane_size
    fmt.create_raw(root, f"staging/{name}/rows", streams * 2 * shard, row_shape, dtype, allocate=True)
    fmt.create_raw(root, f"staging/{name}/tags", streams * 2, (), np.dtype(np.int64), allocate=True)
    taken = {lane * 2 + (w // shard) % 2: w // shard for lane, w in enumerate(starts) if w % shard}
    if taken:
        tags = RawArray.open(root, f"staging/{name}/tags", writable=True)
        tags.write_at(np.array(list(taken), np.int64), np.array(list(taken.values()), np.int64))
        tags.close()


def check_meta(where: Path, meta: object, expect: fmt.Expect, codec: str) -> tuple[int, int]:
    """Check a sharded column's ``zarr.json`` (what ``create`` writes for ``codec``); return
    its rows per inner chunk and per shard, or raise ``CorruptStoreError``."""
    rows, row_shape, dtype = expect
    # the generic checks: keys, dtype, shape against the manifest, grid, key encoding
    generic = {**meta, "codecs": [fmt.BYTES_LE]} if isinstance(meta, dict) else meta
    fmt.check_array_meta(where, generic, expect, raw=False)
    assert isinstance(meta, dict)
    shape = meta["shape"]
    shard = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    codecs: Any = meta.get("codecs")
    conf: Any = codecs[0].get("configuration") if isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict) else None
    inner: Any = conf.get("chunk_shape") if isinstance(conf, dict) else None
    lossy = fmt.parse_codec("codec", codec)[0] == "jpeg"
    want_inner: list[dict[str, Any]] = [compressor_meta(codec, dtype), _CRC] if lossy else [fmt.BYTES_LE, compressor_meta(codec, dtype), _CRC]
    ok = (
        isinstance(conf, dict)
        and codecs[0] == {"name": "sharding_indexed", "configuration": conf}
        and set(conf) == {"chunk_shape", "codecs", "index_codecs", "index_location"}
        and isinstance(inner, list) and len(inner) == len(shape) and inner[1:] == shape[1:]
        and isinstance(inner[0], int) and not isinstance(inner[0], bool) and 1 <= inner[0] <= shard
        and shard % inner[0] == 0 and rows % shard == 0 and (inner[0] == 1 or not lossy)
        and _same_codecs(conf["codecs"], want_inner, dtype)
        and conf["index_codecs"] == [fmt.BYTES_LE, _CRC]
        and conf["index_location"] == "end"
    )
    if not ok:
        raise errors.CorruptStoreError(
            f"{where}: codecs: expected sharding_indexed of whole-row inner chunks [bytes, {codec}, crc32c], "
            f"index [bytes, crc32c] at the end, got {codecs!r}"
        )
    return int(inner[0]), shard


def _same_codecs(got: object, want: list[dict[str, Any]], dtype: np.dtype) -> bool:
    if not isinstance(got, list) or len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if not isinstance(g, dict) or g.get("name") != w["name"]:
            return False
        if w["name"] == "bytes":
            if not fmt.bytes_codec_ok(g, dtype):
                return False
        elif g.get("configuration", {}) != w.get("configuration", {}):
            return False
    return True
