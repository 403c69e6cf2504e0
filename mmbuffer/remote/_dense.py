"""Raw arrays published as compressed chunks, rebuilt bit for bit on the reader.

A store's raw arrays that a reader mirrors (the episode index and the priority tree
whole, the done flags chunk by chunk as read: one shard file each, sized by capacity,
mostly zeros in a young store)
would be one object each, and every publish would send the whole file again when a few
slots changed (at 1e6 rows, 17 of the 22 MB of a publish after 1% new rows was
``index/ends``). A publish sends each such array instead as an ordinary Zarr array of the
same shape and dtype with one zstd chunk per inner chunk of the shard (a chunk of zeros,
the fill value, is not sent: zarr reads it as zeros), so only the chunks whose digest
changed are sent again, and zarr reads the array without mmbuffer.

The object table records, per packed array, the original ``zarr.json`` text and the size
and digest of its shard file (:class:`Packed`). The reader checks every chunk against the
table, decodes it into at most the chunk's size, appends the shard index (the one
``fmt.create_raw`` writes: every inner chunk present, crc32c) and checks the rebuilt file
against the recorded digest before the store code opens it: a wrong chunk, a wrong
record or a wrong rebuild is a :class:`~mmbuffer.errors.CorruptStoreError` naming the
array. An array whose file is not exactly that layout is sent whole, as before.

The digest is over the chunks' digests (``chunked``, object table version 3): the
BLAKE2b-128 of the BLAKE2b-128 digests of every inner chunk's bytes, then of the shard
index. A chunk of zeros has one digest, computed once, so checking a rebuilt file costs
the chunks that hold something, not the array's capacity (the episode index is 16 bytes
a row of capacity, mostly zeros: hashing it whole was most of a new reader's open at
1e7 rows). Tables of version 2 record the digest of the file's bytes; they still read.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> d = Path(tempfile.mkdtemp())
>>> with mb.create(d / "s", {"x": ((), "float32")}, capacity=64, next_keys=()) as buf:
...     buf.extend({"x": np.arange(40), "terminated": np.arange(40) % 10 == 9})
>>> rels = [p.relative_to(d / "s").as_posix() for p in (d / "s").rglob("*") if p.is_file()]
>>> sent, packed, replaced = pack(d / "s", rels)
>>> "index/ends/c/0" in replaced, sorted(packed)[:2]
(True, ['columns/terminated', 'columns/truncated'])
>>> out = io.BytesIO()
>>> rebuild("index/ends", packed["index/ends"], sent, sent.get, out)
>>> out.getvalue() == (d / "s" / "index/ends/c/0").read_bytes()
True
"""

from __future__ import annotations

import hashlib
import io  # noqa: F401 - the doctest
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .. import errors
from .._disk import format as fmt

__all__ = ["Layout", "Packed", "chunk_rels", "decode_chunk", "held_bytes", "layout_of", "pack", "rebuild", "shard_rel",
           "shard_tail"]

_ZSTD = {"name": "zstd", "configuration": {"level": 3, "checksum": False}}
_DATA = re.compile(r"^columns/([^/]+)/")


@dataclass(frozen=True, slots=True)
class Packed:
    """What the table records of one packed array: the original ``zarr.json`` text and
    the size and BLAKE2b-128 digest of its shard file ``c/0[/0...]``; ``chunked``: the
    digest of its chunks' digests (module docstring), else of its bytes (table version 2)."""

    meta: str
    size: int
    digest: str
    chunked: bool = True

    def to_json(self) -> list[Any]:
        return [self.meta, self.size, self.digest]

    @staticmethod
    def from_json(where: str, value: object, chunked: bool = True) -> Packed:
        if (not isinstance(value, list) or len(value) != 3 or not isinstance(value[0], str)
                or not isinstance(value[1], int) or isinstance(value[1], bool) or value[1] < 0
                or not isinstance(value[2], str) or not re.match(r"^[0-9a-f]{32}$", value[2])):
            raise errors.CorruptStoreError(f"{where}: expected [zarr.json text, size, digest], got {str(value)[:200]!r}")
        return Packed(value[0], value[1], value[2], chunked)


@dataclass(frozen=True, slots=True)
class Layout:
    """The shard layout of a packed array: its shape, rows per inner chunk (a published
    chunk each), the chunks in the shard, the bytes a row, whether zeros are its fill."""

    shape: tuple[int, ...]
    inner: int  # rows per inner chunk: rows per published chunk
    chunks: int  # inner chunks in the shard
    row_bytes: int
    fill: bool  # the published meta's fill value is zero bytes

    @property
    def chunk_bytes(self) -> int:
        return self.inner * self.row_bytes


def _layout(where: str, meta: object) -> Layout:
    """The shard layout of a raw array's ``zarr.json`` (checked as the store code checks it)."""
    shape, dtype, shard_rows = fmt.check_array_meta(Path(where), meta, None, raw=True)
    assert isinstance(meta, dict)
    inner = int(meta["codecs"][0]["configuration"]["chunk_shape"][0])
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    return Layout(shape, inner, shard_rows // inner, row_bytes, meta.get("fill_value") in (0, False, 0.0))


def layout_of(array: str, record: Packed) -> Layout:
    """The checked layout of a packed array's record, its size included (``CorruptStoreError``)."""
    where = f"{array} (rebuilt from its chunks)"
    try:
        meta = json.loads(record.meta)
    except (ValueError, RecursionError):
        raise errors.CorruptStoreError(f"{where}: zarr.json: not valid JSON") from None
    layout = _layout(array, meta)
    if record.size != layout.chunks * layout.chunk_bytes + len(shard_tail(layout)):
        raise errors.CorruptStoreError(f"{where}: expected a shard of {layout.chunks * layout.chunk_bytes} bytes "
                                       f"and its index, the table says {record.size}")
    return layout


def decode_chunk(rel: str, blob: bytes, layout: Layout, out: np.ndarray) -> np.ndarray:
    """The published chunk ``rel`` (verified zstd bytes) decoded into ``out`` (uint8, one
    chunk's bytes; never more), zeros past what it holds."""
    out[:] = 0
    try:
        _zstd().decode(blob, out=out)
    except (ValueError, RuntimeError) as exc:
        raise errors.CorruptStoreError(f"{rel}: expected a zstd chunk of {layout.chunk_bytes} bytes ({exc})") from None
    return out


def shard_tail(layout: Layout) -> bytes:
    """The index ``fmt.create_raw`` writes at the end of a shard: every inner chunk present."""
    import google_crc32c

    index = np.empty((layout.chunks, 2), dtype="<u8")
    index[:, 0] = np.arange(layout.chunks, dtype=np.uint64) * np.uint64(layout.chunk_bytes)
    index[:, 1] = layout.chunk_bytes
    blob = index.tobytes()
    return blob + int(google_crc32c.value(blob)).to_bytes(4, "little")


def shard_rel(array: str, record: Packed) -> str:
    """The shard file of a packed array (``array/c/0[/0...]``, one ``0`` per dimension)."""
    try:
        shape = json.loads(record.meta).get("shape")
    except (ValueError, RecursionError, AttributeError):
        shape = None
    if not isinstance(shape, list) or not 1 <= len(shape) <= 32:
        raise errors.CorruptStoreError(f"{array} (packed): zarr.json: expected an array's metadata with a shape")
    return chunk_rels(array, 0, len(shape))


def held_bytes(array: str, record: Packed, chunks: int) -> int:
    """The disk a rebuilt shard of ``chunks`` chunks that hold something takes (the
    chunks of zeros are holes): what the host cache counts for it."""
    try:
        layout = _layout(array, json.loads(record.meta))
    except (ValueError, RecursionError):
        return record.size  # refused by rebuild, before anything is written
    return min(record.size, chunks * layout.chunk_bytes + len(shard_tail(layout)))


def _chunk_digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def chunk_rels(array: str, k: int, ndim: int) -> str:
    """The key of published chunk ``k`` of ``array`` (``array/c/k[/0...]``)."""
    return f"{array}/c/{k}" + "/0" * (ndim - 1)


def _published_meta(meta: Mapping[str, Any]) -> bytes:
    """The ``zarr.json`` a packed array is published with: the same array, chunked, zstd."""
    inner = meta["codecs"][0]["configuration"]
    out: dict[str, Any] = {
        "shape": meta["shape"], "data_type": meta["data_type"],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": inner["chunk_shape"]}},
        "chunk_key_encoding": meta["chunk_key_encoding"], "fill_value": meta["fill_value"],
        "codecs": [inner["codecs"][0], _ZSTD], "attributes": meta.get("attributes", {}),
        "zarr_format": 3, "node_type": "array", "storage_transformers": []}
    if "dimension_names" in meta:
        out["dimension_names"] = meta["dimension_names"]
    return json.dumps(out, indent=2).encode()


def _zstd() -> Any:
    from numcodecs import Zstd  # type: ignore[import-untyped]

    return Zstd(level=3)


def pack(store: Path, rels: list[str]) -> tuple[dict[str, bytes], dict[str, Packed], set[str]]:
    """Pack the mirrored raw arrays among ``rels`` (the store's files): the objects to
    publish for them (``zarr.json`` and the chunks that are not all zeros), the record of
    each packed array, and the original files they replace."""
    sent: dict[str, bytes] = {}
    packed: dict[str, Packed] = {}
    replaced: set[str] = set()
    have = set(rels)
    codec = None
    for rel in sorted(rels):
        if not rel.endswith("/zarr.json"):
            continue
        array = rel[: -len("/zarr.json")]
        m = _DATA.match(rel)
        if m and m.group(1) not in fmt.RESERVED_NAMES:
            continue  # a data column: read remotely, chunk by chunk
        text = (store / rel).read_text()
        meta = json.loads(text)
        if not isinstance(meta, dict) or meta.get("node_type") != "array":
            continue
        try:
            layout = _layout(array, meta)
        except errors.CorruptStoreError:
            continue  # compressed, or not mmbuffer's raw layout: sent as it is
        shard = chunk_rels(array, 0, len(layout.shape))
        tail = shard_tail(layout)
        path = store / shard
        if not layout.fill or shard not in have or path.stat().st_size != layout.chunks * layout.chunk_bytes + len(tail):
            continue
        h = hashlib.blake2b(digest_size=16)
        zero = _chunk_digest(bytes(layout.chunk_bytes))  # a chunk of zeros is hashed once, as rebuild does
        chunks: dict[str, bytes] = {}
        with open(path, "rb") as f:
            for k in range(layout.chunks):
                data = f.read(layout.chunk_bytes)
                if np.frombuffer(data, np.uint8).any():
                    h.update(_chunk_digest(data))
                    codec = codec or _zstd()
                    chunks[chunk_rels(array, k, len(layout.shape))] = bytes(codec.encode(data))
                else:
                    h.update(zero)
            end = f.read()
        if end != tail:
            continue  # not the index mmbuffer writes: the file goes whole
        h.update(_chunk_digest(end))
        sent[rel] = _published_meta(meta)
        sent.update(chunks)
        packed[array] = Packed(text, path.stat().st_size, h.hexdigest())
        replaced.update((rel, shard))
    return sent, packed, replaced


def rebuild(array: str, record: Packed, entries: Mapping[str, Any], get: Callable[[str], bytes | None],
            out: BinaryIO, *, old: BinaryIO | None = None, same: frozenset[str] = frozenset()) -> None:
    """Write the shard file of ``array`` to ``out``, rebuilt from its published chunks one
    at a time (chunks of zeros are skipped: a sparse file), and check it against ``record``.
    ``entries``: the snapshot's objects (a chunk not there is zeros); ``get``: a chunk's
    verified bytes (compressed). ``old``: the file rebuilt before from the same
    ``zarr.json`` (a refresh), whose chunks named in ``same`` (unchanged) are copied, not fetched."""
    where = f"{array} (rebuilt from its chunks)"
    layout = layout_of(array, record)
    tail = shard_tail(layout)
    h = hashlib.blake2b(digest_size=16)
    zeros = bytes(layout.chunk_bytes)
    fold: Callable[[bytes], bytes] = _chunk_digest if record.chunked else (lambda data: data)
    zero = fold(zeros)
    part = np.empty(layout.chunk_bytes, np.uint8)
    for k in range(layout.chunks):
        rel = chunk_rels(array, k, len(layout.shape))
        data: bytes | None = None
        if rel in entries and old is not None and rel in same:
            old.seek(k * layout.chunk_bytes)
            data = old.read(layout.chunk_bytes)
            if len(data) != layout.chunk_bytes:
                raise errors.CorruptStoreError(f"{where}: the previous mirror's file is short; remove the cache")
        elif rel in entries:
            blob = get(rel)
            if blob is None:
                raise errors.CorruptStoreError(f"{rel}: expected the chunk the snapshot names, found nothing")
            data = decode_chunk(rel, blob, layout, part).tobytes()
        if data is None:  # all zeros: a hole
            h.update(zero)
            out.seek(layout.chunk_bytes, 1)
        else:
            h.update(fold(data))
            out.write(data)
    h.update(fold(tail))
    out.write(tail)
    if h.hexdigest() != record.digest:
        raise errors.CorruptStoreError(f"{where}: expected BLAKE2b-128 {record.digest} ({record.size} bytes), "
                                       f"got {h.hexdigest()}")
