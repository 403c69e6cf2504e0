"""Remote columns: a Zarr array on object storage, read through zarr's store layer (fsspec).

A random row read from object storage is a request per chunk, so this backend
never reads less than a chunk: :meth:`RemoteArray.read` serves rows from a
:class:`RowSource` attached to it (the chunk pool of :mod:`mmbuffer.remote`) where
it holds them, and fetches the chunks of the other rows whole (one zarr call: the
chunks are fetched concurrently and decoded) into a small LRU cache of decoded
chunks. That is the exact, on-demand mode; the pool is the fast one.

zarr reads a missing chunk as the fill value. A snapshot deleted while it is read
would therefore read as zeros: after every fetch through this backend it calls
``alive()``, which raises if the snapshot is gone (``mmbuffer.remote``; its exact
reader, ``ChunkRows``, sends that check with the fetch's own requests).

Writable too (zarr writes whole chunks), so the conformance suite of
``tests/disk/test_columns.py`` runs on it; mmbuffer itself only reads remote columns.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .. import format as fmt
from ... import errors
from .base import ColumnArray

__all__ = ["RemoteArray", "RowSource"]


class RowSource(Protocol):
    """Rows held locally (the chunk pool, or exact reads' decoded chunks): fills ``out``
    where it can, returns that mask; ``ahead`` may start fetching rows about to be read;
    ``release`` drops what it holds in process memory."""

    def serve(self, name: str, rows: np.ndarray, out: np.ndarray) -> np.ndarray: ...

    def ahead(self, rows: np.ndarray) -> None: ...

    def release(self) -> None: ...


class RemoteArray(ColumnArray):
    """A column of a store on object storage (any fsspec URL)."""

    def __init__(self, array: Any, where: str, *, cache_bytes: int, alive: Callable[[], None] | None) -> None:
        self._array = array
        self._where = where
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)
        self.chunk_rows = int(array.chunks[0])
        self._row_bytes = max(1, int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_chunks = max(1, cache_bytes // (self._row_bytes * self.chunk_rows))
        self._alive = alive
        self._source: RowSource | None = None
        self._name = where.rstrip("/").rsplit("/", 1)[-1]
        self._lock = threading.Lock()

    @classmethod
    def open(
        cls, root: str, name: str, *, writable: bool, expect: fmt.Expect | None = None,
        storage_options: Mapping[str, Any] | None = None, cache_bytes: int = 64 << 20,
        alive: Callable[[], None] | None = None, wrap: Callable[[Any], Any] | None = None,
    ) -> RemoteArray:
        """Open ``root/name`` (``root`` a URL), checking its ``zarr.json`` like a local array.

        ``wrap`` (``mmbuffer.remote``) wraps the zarr store every read goes through
        (there: verified against the snapshot's checksums, cached on the host)."""
        import zarr
        from zarr.storage import FsspecStore

        from ..urls import filesystem, join, options_for

        url = f"{root.rstrip('/')}/{name}"
        fs, path = filesystem(url, storage_options)
        try:
            meta = json.loads(fs.cat_file(join(path, "zarr.json"), start=0, end=1 << 20))
        except FileNotFoundError:
            raise errors.CorruptStoreError(f"{url}/zarr.json: expected the array's metadata, found nothing") from None
        except ValueError as exc:
            raise errors.CorruptStoreError(f"{url}/zarr.json: not valid JSON ({exc})") from None
        raw = isinstance(meta, dict) and isinstance(meta.get("codecs"), list) and bool(meta["codecs"]) \
            and isinstance(meta["codecs"][0], dict) and meta["codecs"][0].get("name") == "sharding_indexed"
        try:
            shape, dtype, _ = fmt.check_array_meta(Path(name), meta, expect, raw=raw)
        except errors.CorruptStoreError as exc:
            raise errors.CorruptStoreError(f"{root.rstrip('/')}/{exc}") from None
        store = FsspecStore.from_url(url, storage_options=options_for(url, storage_options), read_only=not writable)
        if wrap is not None:
            store = wrap(store)
        try:
            array = zarr.open_array(store=store, mode="r+" if writable else "r")
        except Exception as exc:  # noqa: BLE001 - zarr's errors are untyped for us
            raise errors.CorruptStoreError(f"{url}: zarr cannot open the array ({type(exc).__name__}: {exc})") from None
        if tuple(array.shape) != shape or np.dtype(array.dtype) != dtype:
            raise errors.CorruptStoreError(f"{url}: expected shape {shape} and {dtype} (as checked), got {array.shape} {array.dtype}")
        return cls(array, url, cache_bytes=cache_bytes, alive=alive)

    def ahead(self, rows: np.ndarray) -> None:
        if self._source is not None:
            self._source.ahead(rows)

    def attach(self, source: RowSource | None) -> None:
        """Serve rows from ``source`` first (the chunk pool), or stop (None)."""
        self._source = source

    def _fetch(self, read: Callable[[], Any]) -> np.ndarray:
        try:
            values = np.asarray(read())
        except (IndexError, errors.MMBufferError):
            raise
        except Exception as exc:  # noqa: BLE001 - a chunk that cannot be fetched or decoded
            raise errors.CorruptStoreError(f"{self._where}: a chunk cannot be read ({type(exc).__name__}: {exc})") from None
        if self._alive is not None:
            self._alive()
        return values

    def read_block(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` fetched now, bypassing pool and cache (the pool's refill)."""
        return self._fetch(lambda: self._array[start:stop])

    def read(self, rows: np.ndarray) -> np.ndarray:
        idx = np.asarray(rows, dtype=np.int64)
        flat = idx.reshape(-1)
        out = np.empty((flat.size, *self.row_shape), dtype=self.dtype)
        served = self._source.serve(self._name, flat, out) if self._source is not None else np.zeros(flat.size, bool)
        if not served.all():
            rest = ~served
            out[rest] = self._from_chunks(flat[rest])
        return out.reshape(idx.shape + self.row_shape)

    def _from_chunks(self, rows: np.ndarray) -> np.ndarray:
        cr = self.chunk_rows
        if ((rows < 0) | (rows >= self.shape[0])).any():
            raise IndexError(f"{self._where}: row ids must lie in [0, {self.shape[0]})")
        chunks, inverse = np.unique(rows // cr, return_inverse=True)
        with self._lock:
            missing = [int(c) for c in chunks if int(c) not in self._cache]
            if missing:
                spans = [np.arange(c * cr, min((c + 1) * cr, self.shape[0])) for c in missing]
                values = self._fetch(lambda: self._array.oindex[np.concatenate(spans)])
                at = 0
                for c, span in zip(missing, spans, strict=True):
                    self._cache[c] = values[at : at + len(span)]
                    at += len(span)
            parts = []
            for c in chunks:
                self._cache.move_to_end(int(c))
                parts.append(self._cache[int(c)])
            while len(self._cache) > max(self._cache_chunks, len(chunks)):
                self._cache.popitem(last=False)
        offsets = np.cumsum([0] + [len(p) for p in parts[:-1]])
        stacked = np.concatenate(parts)
        picked: np.ndarray = stacked[offsets[inverse] + rows % cr]
        return picked

    def write_range(self, start: int, values: np.ndarray) -> None:
        if self._array.read_only:
            self.refuse_write(self._where, "write_range")
        with self._lock:
            self._cache.clear()
            self._array[start : start + len(values)] = values

    def write_at(self, rows: np.ndarray, values: np.ndarray) -> None:
        if self._array.read_only:
            self.refuse_write(self._where, "write_at")
        with self._lock:
            self._cache.clear()
            self._array.oindex[np.asarray(rows, dtype=np.int64)] = values

    def flush(self, start: int, stop: int) -> None:
        """zarr writes each chunk object whole when it is set: nothing is pending."""

    def release(self) -> None:
        with self._lock:
            self._cache.clear()
        if self._source is not None:
            self._source.release()
