"""The zarr store a remote column reads through: every object checked against its snapshot.

zarr asks for keys (``zarr.json``, ``c/0/0``) relative to the column; this store maps
them to the snapshot's object table (:mod:`._objects`) and serves each object from the
host's cache (:mod:`._cache`), fetching it once per host and checking its size and
digest first. A key the table does not name is a chunk never written (zarr reads the
fill value) and is not requested at all; a named object that is missing, changed or
swapped is a ``CorruptStoreError`` naming it and its column (or ``StoreNotFoundError``
when a newer publish removed the snapshot).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

from ._cache import Cache
from ._objects import Table, remote_errors

__all__ = ["VerifiedStore", "mapped_objects"]


class VerifiedStore(WrapperStore[Any]):
    """``store`` (a read-only ``FsspecStore`` of one column) with verified, cached reads."""

    def __init__(self, store: Any, *, prefix: str = "", table: Table | None = None, cache: Cache | None = None,
                 fetch: Callable[[str], bytes] | None = None, alive: Callable[[], None] | None = None) -> None:
        super().__init__(store)
        self._prefix, self._table, self._cache, self._fetch, self._alive = prefix, table, cache, fetch, alive

    def _with_store(self, store: Any) -> VerifiedStore:
        return VerifiedStore(store, prefix=self._prefix, table=self._table, cache=self._cache, fetch=self._fetch,
                             alive=self._alive)

    def read_object(self, rel: str) -> bytes | None:
        """The verified object ``rel`` (relative to the snapshot), or None if the table
        does not name it."""
        assert self._table is not None and self._cache is not None and self._fetch is not None
        entry = self._table.get(rel)
        if entry is None:
            return None  # not in the snapshot: a chunk never written
        table = self._table
        return self._cache.object(entry[1], entry[0], _download(table, self._fetch, self._alive, rel),
                                  lambda data: table.check(rel, data))

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        data = await asyncio.to_thread(self.read_object, self._prefix + key)
        if data is None:
            return None
        if isinstance(byte_range, RangeByteRequest):
            data = data[byte_range.start:byte_range.end]
        elif isinstance(byte_range, OffsetByteRequest):
            data = data[byte_range.offset:]
        elif isinstance(byte_range, SuffixByteRequest):
            data = data[-byte_range.suffix:] if byte_range.suffix else b""
        return prototype.buffer.from_bytes(data)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        assert self._table is not None
        return self._table.get(self._prefix + key) is not None


def mapped_objects(table: Table, cache: Cache, fetch: Callable[[str], bytes],
                   alive: Callable[[], None] | None) -> Callable[[str], np.ndarray | None]:
    """``rel -> `` the verified object ``rel`` mapped read-only from the host's cache (a
    shard a compiled decoder reads in place), or None if ``table`` does not name it."""

    def mapped(rel: str) -> np.ndarray | None:
        entry = table.get(rel)
        if entry is None:
            return None
        return cache.mapped(entry[1], entry[0], _download(table, fetch, alive, rel), lambda data: table.check(rel, data))

    return mapped


def _download(table: Table, fetch: Callable[[str], bytes], alive: Callable[[], None] | None, rel: str) -> Callable[[], bytes]:
    def download() -> bytes:
        try:
            with remote_errors(table.url):
                return fetch(rel)
        except FileNotFoundError:
            if alive is not None:
                alive()  # removed by a newer publish: StoreNotFoundError
            raise table.missing(rel) from None

    return download
