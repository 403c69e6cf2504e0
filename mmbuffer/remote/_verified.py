"""The zarr store a remote column reads through: every object checked against its snapshot.

zarr asks for keys (``zarr.json``, ``c/0/0``) relative to the column; this store maps
them to the snapshot's object table (:mod:`._objects`) and serves each object from the
host's cache (:mod:`._cache`), fetching it once per host and checking its size and
digest first. A key the table does not name is a chunk never written (zarr reads the
fill value) and is not requested at all; a named object that is missing, changed or
swapped is a ``CorruptStoreError`` naming it and its column (or ``StoreNotFoundError``
when a newer publish removed the snapshot).

Exact reads (``pool=None``) go through :class:`ChunkRows`: the chunks a read needs that
the host cache lacks are fetched together (:meth:`VerifiedStore.prefetch`: one batch of
concurrent ranged GETs with the snapshot's existence check in it), verified, kept, and
decoded without being read back from disk: a chunk in the codecs a publish writes (its
rows' bytes, zstd) with one ``zstd.decompress`` into where its rows go, any other through
zarr's codec pipeline. The chunk pool fetches its blocks through the same readers
(:meth:`ChunkRows.read_into`). ``gather`` first tells every
column of a batch which rows it will read (:meth:`ChunkRows.ahead`), so all of the
batch's columns are being fetched while the first one decodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

from .. import errors
from ._cache import Cache
from ._objects import FetchMany, Table, remote_errors

__all__ = ["ChunkRows", "VerifiedStore", "mapped_objects"]

_PIECE = 8 << 20  # bytes of decoded chunks fetched per batch of requests
#: pieces in flight ahead of the one decoded: a piece's requests overlap the previous one's
#: checks and cache writes, not only its decode (benchmarks/HISTORY.md: 1 -> 3 took a cold
#: exact read from 0.60 to 0.69 of a ranged GET on 16 cores, 16% less time on 2)
_DEPTH = 3
_FETCHERS = 4  # threads running them: two columns read at once keep two pieces each in flight
_AHEAD: list[tuple[int, ThreadPoolExecutor]] = []
_AHEAD_LOCK = threading.Lock()


def _ahead() -> ThreadPoolExecutor:
    """The threads that fetch the next pieces of a read while one is decoded (made on first
    use in each process: a forked child does not inherit its parent's threads)."""
    with _AHEAD_LOCK:
        if not _AHEAD or _AHEAD[0][0] != os.getpid():
            _AHEAD[:] = [(os.getpid(), ThreadPoolExecutor(max_workers=_FETCHERS, thread_name_prefix="mmbuffer-fetch"))]
        return _AHEAD[0][1]


class VerifiedStore(WrapperStore[Any]):
    """``store`` (a read-only ``FsspecStore`` of one column) with verified, cached reads."""

    def __init__(self, store: Any, *, prefix: str = "", table: Table | None = None, cache: Cache | None = None,
                 fetch: Callable[[str], bytes] | None = None, alive: Callable[[], None] | None = None,
                 fetch_many: FetchMany | None = None,
                 ready: dict[str, bytes] | None = None) -> None:
        super().__init__(store)
        self._prefix, self._table, self._cache, self._fetch, self._alive = prefix, table, cache, fetch, alive
        self._fetch_many = fetch_many  # a batch of objects at once (concurrent requests), or None
        self._ready = {} if ready is None else ready  # digest -> bytes fetched and verified by prefetch, not yet read

    def _with_store(self, store: Any) -> VerifiedStore:
        return VerifiedStore(store, prefix=self._prefix, table=self._table, cache=self._cache, fetch=self._fetch,
                             alive=self._alive, fetch_many=self._fetch_many, ready=self._ready)

    def prefetch(self, rels: Iterable[str], *, probe: bool = True) -> int:
        """Fetch the objects among ``rels`` (relative to the column) that the host cache lacks
        with one call of ``fetch_many`` (concurrent requests), verify and keep them, and hold
        them for the next read of each (no read back from disk); the number fetched. A
        missing object is ``CorruptStoreError`` (``StoreNotFoundError``: snapshot removed);
        ``probe``: check the snapshot's existence in the same batch."""
        if self._fetch_many is None:
            return 0
        assert self._table is not None and self._cache is not None
        table, many = self._table, self._fetch_many
        names: dict[str, str] = {}  # digest -> the first object with that content
        want: dict[str, int] = {}
        rels = list(rels)
        table.need(self._prefix + rel for rel in rels)  # the parts naming them, at once
        for rel in rels:
            entry = table.get(self._prefix + rel)
            if entry is not None and entry[1] not in names:
                names[entry[1]], want[entry[1]] = self._prefix + rel, entry[0]

        def fetch(keys: list[str]) -> dict[str, bytes]:
            got = many([names[k] for k in keys], probe)
            out = {}
            for key in keys:
                data = got.get(names[key])
                if data is None:
                    raise table.missing(names[key])
                out[key] = data
            return out

        fetched = self._cache.fetch_absent(want, fetch, lambda key, data: table.check(names[key], data))
        self._ready.update(fetched)
        return len(fetched)

    def chunk(self, key: str) -> bytes | None:
        """The verified object of the column's ``key`` (``c/0/0``), as zarr would get it."""
        return self.read_object(self._prefix + key)

    def forget(self, keys: Iterable[str] | None = None) -> None:
        """Drop what :meth:`prefetch` held for the column's ``keys`` (default: all) and no read took."""
        if keys is None:
            self._ready.clear()
            return
        assert self._table is not None
        for key in keys:
            if (entry := self._table.get(self._prefix + key)) is not None:
                self._ready.pop(entry[1], None)

    def read_object(self, rel: str) -> bytes | None:
        """The verified object ``rel`` (relative to the snapshot), or None if the table
        does not name it."""
        assert self._table is not None and self._cache is not None and self._fetch is not None
        entry = self._table.get(rel)
        if entry is None:
            return None  # not in the snapshot: a chunk never written
        ready = self._ready.pop(entry[1], None)
        if ready is not None:
            return ready  # fetched and verified by prefetch just before
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


def _plain_zstd(array: Any) -> bool:
    """Whether ``array``'s chunks are its rows' bytes in this machine's order, zstd-compressed
    (what a publish writes): then a chunk decodes into place with one ``zstd.decompress``."""
    from zarr.codecs import BytesCodec, Endian, ZstdCodec

    codecs = tuple(array.metadata.codecs)
    return (sys.byteorder == "little" and len(codecs) == 2 and isinstance(codecs[0], BytesCodec)
            and codecs[0].endian in (None, Endian.little) and isinstance(codecs[1], ZstdCodec)
            and np.dtype(array.dtype).byteorder in ("=", "|", "<"))


def zstd_content_size(blob: bytes) -> int:
    """The content size a zstd frame's header declares (RFC 8878, section 3.1.1.1), or -1."""
    if len(blob) < 6 or blob[:4] != b"\x28\xb5\x2f\xfd":
        return -1
    descriptor = blob[4]
    single = descriptor >> 5 & 1
    at = 5 + (1 - single) + (0, 1, 2, 4)[descriptor & 3]  # past the window descriptor and the dictionary id
    width = (single, 2, 4, 8)[descriptor >> 6]
    if width == 0 or len(blob) < at + width:
        return -1
    size = int.from_bytes(blob[at:at + width], "little")
    return size + 256 if width == 2 else size


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


class ChunkRows:
    """Rows of one remote column served from whole decoded chunks (exact reads, ``pool=None``).

    A read takes the chunks its rows lie in; those not held are fetched together
    (:meth:`VerifiedStore.prefetch`: one batch of concurrent requests, every object
    verified and kept in the host cache) and decoded (in place, or by zarr run by run) into a
    slab of about ``cache_bytes`` (least recently used chunks leave first; a read needing more
    chunks than that grows it); the rows are then gathered from the slab in one indexing.
    A ``RowSource`` of :class:`~mmbuffer._disk.columns.remote.RemoteArray`: rows outside
    the array are left to it (it raises ``IndexError``).

    >>> import tempfile, numpy as np, mmbuffer as mb
    >>> d = tempfile.mkdtemp()
    >>> with mb.create(d + "/s", {"x": ((), "float32")}, capacity=64, next_keys=()) as buf:
    ...     buf.extend({"x": np.arange(40), "terminated": np.arange(40) % 10 == 9})
    >>> _ = mb.convert.copy(d + "/s", "file://" + d + "/pub", progress=False)
    >>> ro = mb.open("file://" + d + "/pub", mode="r", cache_dir=d + "/c", pool=None)
    >>> n = ro.remote.files.downloads
    >>> ro.get(np.arange(3, 6))["x"].tolist(), ro.remote.files.downloads - n  # x's one chunk, fetched
    ([3.0, 4.0, 5.0], 1)
    >>> ro.get(np.arange(6))["x"].tolist()[:2], ro.remote.files.downloads - n  # held: nothing fetched
    ([0.0, 1.0], 1)
    >>> ro.close()
    """

    def __init__(self, array: Any, store: VerifiedStore, where: str, *, cache_bytes: int) -> None:
        self._array, self._store, self._where = array, store, where
        self._rows, self._cr = int(array.shape[0]), int(array.chunks[0])
        self._row_shape = tuple(int(n) for n in array.shape[1:])
        self._dtype = np.dtype(array.dtype)
        row_bytes = max(1, int(np.prod(self._row_shape, dtype=np.int64)) * self._dtype.itemsize)
        self._chunk_bytes = row_bytes * self._cr
        self._slots = max(1, cache_bytes // self._chunk_bytes)
        self._slab = np.empty((0, self._cr, *self._row_shape), dtype=self._dtype)
        self._slot_of = np.full(-(-self._rows // self._cr), -1, dtype=np.int64)  # chunk -> slot
        self._chunk_in = np.zeros(0, dtype=np.int64)  # slot -> chunk (-1: free)
        self._used = np.zeros(0, dtype=np.int64)  # slot -> last read that used it
        self._clock = 0
        self._lock = threading.Lock()
        self._coming: dict[int, Future[None]] = {}  # chunk -> the fetch started for it by ``ahead``
        self._direct = _plain_zstd(array)  # its chunks decoded straight into the slab, without zarr's pipeline

    @staticmethod
    def fits(array: Any) -> bool:
        """Whether ``array``'s chunks hold whole rows (what this reader assumes)."""
        return len(array.shape) >= 1 and int(array.shape[0]) > 0 and tuple(array.chunks[1:]) == tuple(array.shape[1:])

    def serve(self, name: str, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` at ``rows`` (those inside the array); return that mask."""
        flat = np.asarray(rows, dtype=np.int64)
        ok: np.ndarray = (flat >= 0) & (flat < self._rows)
        if not ok.any():
            return ok
        at = flat[ok]
        chunks = at // self._cr
        with self._lock:
            need = np.unique(chunks)
            self._hold(need)
            slots = self._slot_of[chunks]
            out[ok] = self._slab[slots, at - chunks * self._cr]
            self._clock += 1
            self._used[self._slot_of[need]] = self._clock
        return ok

    def ahead(self, rows: np.ndarray) -> None:
        """Start fetching (not decoding) the chunks of ``rows`` that are neither held nor
        being fetched, at most ``_DEPTH`` pieces, so that this column's requests run while
        the columns read before it decode (``gather`` calls this for each column first);
        the read of them waits for those fetches instead of asking again."""
        chunks = np.asarray(rows, dtype=np.int64) // self._cr
        with self._lock:  # clipped: a row outside the array names no object, so nothing is fetched for it
            absent = np.take(self._slot_of, chunks, mode="clip") < 0
            if not absent.any():  # all held: a warm read pays one indexing
                return
            self._coming = {c: f for c, f in self._coming.items() if not f.done()}
            want = np.unique(chunks[absent])
            want = want[[c not in self._coming for c in want.tolist()]] if self._coming else want
            for i, piece in enumerate(self._pieces(want)[:_DEPTH] if want.size else []):  # the first: with the check
                future = _ahead().submit(self._fetch, want[piece].tolist(), i == 0)
                self._coming.update(dict.fromkeys(want[piece].tolist(), future))

    def read_into(self, start: int, stop: int, out: np.ndarray) -> None:
        """Rows ``[start, stop)`` decoded into ``out`` (the chunk pool's block): their chunks
        fetched as one batch (or taken from :meth:`ahead`'s fetches) and decoded in place, not
        through the slab."""
        chunks, coming = self._claim(start, stop)
        try:
            for future in coming:
                future.result()
            self._fetch(chunks, True)  # what ``ahead`` did not fetch (held ones are not asked again)
            if not self._direct:
                out[...] = self._read(start, stop)
                return
            part = np.empty((self._cr, *self._row_shape), dtype=self._dtype)
            for chunk in chunks:
                first = chunk * self._cr
                if start <= first and first + self._cr <= stop:
                    self._decode(chunk, out[first - start:first + self._cr - start])
                else:  # a chunk the block holds part of (the array's last; a store's odd chunk rows)
                    self._decode(chunk, part)
                    lo, hi = max(start, first), min(stop, first + self._cr)
                    out[lo - start:hi - start] = part[lo - first:hi - first]
        finally:
            self._settle(chunks, coming)

    def abandon(self, start: int, stop: int) -> None:
        """Give up reading rows ``[start, stop)`` (a block read that failed before this column's
        turn): wait for the fetches :meth:`ahead` started for them and drop what they hold."""
        self._settle(*self._claim(start, stop))

    def _claim(self, start: int, stop: int) -> tuple[list[int], list[Future[None]]]:
        """The chunks of rows ``[start, stop)`` and the fetches ``ahead`` started for them (now this read's)."""
        chunks = list(range(start // self._cr, -(-stop // self._cr)))
        with self._lock:
            coming = {id(f): f for c in chunks if (f := self._coming.pop(c, None)) is not None}
        return chunks, list(coming.values())

    def _settle(self, chunks: list[int], coming: list[Future[None]]) -> None:
        """Wait for ``coming`` and drop what the fetches of ``chunks`` held and no read took
        (another block's are left alone)."""
        for future in coming:
            with contextlib.suppress(BaseException):
                future.result()
        self._store.forget(self._key(c) for c in chunks)

    def _fetch(self, chunks: list[int], probe: bool) -> None:
        """Fetch ``chunks`` (those the host cache lacks) as one batch of requests, held
        for the read that decodes them (``VerifiedStore.prefetch``)."""
        self._store.prefetch([self._key(c) for c in chunks], probe=probe)

    def _key(self, chunk: int) -> str:
        """The column's key of ``chunk`` (``c/7/0``)."""
        return str(self._array.metadata.encode_chunk_key((chunk, *(0,) * len(self._row_shape))))

    def release(self) -> None:
        """Drop the decoded chunks (the next read takes them from the host cache)."""
        with self._lock:
            self._slab = self._slab[:0]
            self._slot_of[:] = -1
            self._chunk_in, self._used = self._chunk_in[:0], self._used[:0]

    def _hold(self, need: np.ndarray) -> None:
        """Make every chunk of ``need`` (sorted) held: fetch, decode and place the others."""
        missing = need[self._slot_of[need] < 0]
        if missing.size == 0:
            return
        total = max(self._slots, len(need))
        if len(self._chunk_in) < total:  # first use, or a read wider than the slab
            slab = np.empty((total, self._cr, *self._row_shape), dtype=self._dtype)
            slab[: len(self._chunk_in)] = self._slab
            self._slab = slab
            self._chunk_in = np.concatenate([self._chunk_in, np.full(total - len(self._chunk_in), -1, np.int64)])
            self._used = np.concatenate([self._used, np.zeros(total - len(self._used), np.int64)])
        held = self._slot_of[need]
        free = np.setdiff1d(np.arange(len(self._chunk_in)), held[held >= 0])
        slots = free[np.argsort(self._used[free], kind="stable")][: len(missing)]
        gone = self._chunk_in[slots]
        self._slot_of[gone[gone >= 0]] = -1
        self._chunk_in[slots] = -1
        pieces = self._pieces(missing)
        coming = {c: f for c in missing.tolist() if (f := self._coming.pop(c, None)) is not None and not f.done()}

        def prefetch(piece: np.ndarray, probe: bool) -> None:
            chunks = missing[piece].tolist()
            for started in {id(f): f for c in chunks if (f := coming.get(c)) is not None}.values():
                started.result()  # fetched by ``ahead`` (submitted before: never waits on a later task)
            self._fetch([c for c in chunks if c not in coming], probe)

        # the first piece's requests carry the snapshot's check; piece i is decoded while the
        # next _DEPTH are fetched
        ahead: list[Future[None]] = [_ahead().submit(prefetch, piece, i == 0) for i, piece in enumerate(pieces[:_DEPTH])]
        try:
            for i, piece in enumerate(pieces):
                ahead[i].result()
                if i + _DEPTH < len(pieces):
                    ahead.append(_ahead().submit(prefetch, pieces[i + _DEPTH], False))
                if self._direct:
                    for chunk, slot in zip(missing[piece].tolist(), slots[piece].tolist(), strict=True):
                        self._decode(chunk, self._slab[slot])
                else:
                    self._place(int(missing[piece[0]]), slots[piece])
                self._slot_of[missing[piece]] = slots[piece]
                self._chunk_in[slots[piece]] = missing[piece]
        finally:
            for future in ahead:  # a failed read: the fetch ahead is awaited before its objects are dropped
                future.cancel()
                with contextlib.suppress(BaseException):
                    future.result()
            self._store.forget()

    def _place(self, first: int, slots: np.ndarray) -> None:
        """Decode chunks ``first, first + 1, ...`` with zarr into ``slots`` of the slab."""
        count = len(slots)
        values = self._read(first * self._cr, min((first + count) * self._cr, self._rows))
        whole = len(values) // self._cr
        if whole:
            self._slab[slots[:whole]] = values[: whole * self._cr].reshape(whole, self._cr, *self._row_shape)
        if whole < count:  # the array's last, partial chunk
            self._slab[slots[-1], : len(values) - whole * self._cr] = values[whole * self._cr:]

    def _decode(self, chunk: int, out: np.ndarray) -> None:
        """Decode ``chunk`` (verified zstd bytes; the fill value if the snapshot has none) into ``out``."""
        from numcodecs import zstd  # type: ignore[import-untyped]

        blob = self._store.chunk(self._key(chunk))
        if blob is None:  # a chunk never written: what zarr reads there
            out[...] = self._array.fill_value
            return
        flat = out.reshape(-1).view(np.uint8)
        size = zstd_content_size(blob)
        if size != flat.nbytes:
            raise errors.CorruptStoreError(f"{self._where}: chunk {chunk}: expected one zstd frame of {flat.nbytes} "
                                           f"bytes, got {'no frame size' if size < 0 else f'{size} bytes'}")
        try:
            zstd.decompress(blob, flat)
        except (ValueError, RuntimeError) as exc:
            raise errors.CorruptStoreError(f"{self._where}: chunk {chunk} cannot be decoded ({exc})") from None

    def _pieces(self, missing: np.ndarray) -> list[np.ndarray]:
        """Positions in ``missing`` grouped into runs of consecutive chunks of at most
        ``_PIECE`` bytes each (one zarr read and one batch of requests per piece)."""
        per = max(1, _PIECE // max(1, self._chunk_bytes))
        runs = np.split(np.arange(len(missing)), np.flatnonzero(np.diff(missing) != 1) + 1)
        return [run[i:i + per] for run in runs for i in range(0, len(run), per)]

    def _read(self, start: int, stop: int) -> np.ndarray:
        try:
            values: np.ndarray = np.asarray(self._array[start:stop])
        except errors.MMBufferError:
            raise
        except Exception as exc:  # noqa: BLE001 - a chunk that cannot be decoded
            raise errors.CorruptStoreError(f"{self._where}: a chunk cannot be read ({type(exc).__name__}: {exc})") from None
        return values
