"""Stores on object storage: publish a store to a URL, open it read-only, sample from a chunk pool.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> d = tempfile.mkdtemp()
>>> with mb.create(d + "/local", {"x": ((), "float32")}, capacity=64, next_keys=()) as buf:
...     buf.extend({"x": np.arange(40), "terminated": np.arange(40) % 10 == 9})
>>> url = "file://" + d + "/published"
>>> mb.convert.copy(d + "/local", url, compression="zstd", progress=False)["sequence"]
1
>>> ro = mb.open(url, mode="r", cache_dir=d + "/cache")
>>> ro.num_episodes, ro.sample(8).data["x"].shape
(4, torch.Size([8]))
>>> with mb.open(d + "/local") as w:  # the writer goes on, and publishes again
...     w.extend({"x": np.arange(10), "terminated": np.arange(10) == 9})
>>> mb.convert.copy(d + "/local", url, compression="zstd", progress=False)["sequence"]
2
>>> ro.refresh(wait=False)  # prepared in a background thread: the old snapshot serves meanwhile
False
>>> while not ro.refresh(wait=False):  # a later call adopts it
...     _ = ro.sample(8)
>>> ro.num_episodes
5
>>> ro.close()

``mb.open(url, mode="r", cache_dir=..., storage_options=..., pool=...)`` returns a read-only
:class:`~mmbuffer.Buffer` over a :class:`RemoteSource`: the small parts of the published snapshot (manifest, index,
tree, final observations) are fetched whole into ``cache_dir`` and opened by the
ordinary store code, the done flags chunk by chunk as reads first need them
(``_filled.py``); the data columns are read through zarr's store layer
(:class:`mmbuffer._disk.columns.RemoteArray`). fsspec is the I/O layer: it is what zarr,
xarray and pandas users configure already (``storage_options``, the ``AWS_*``
environment), one dependency covers S3, GCS, Azure, HTTP and local files, and
zarr-python's ``FsspecStore`` is its mature store (obstore is faster per request,
but the pool makes few, large requests, where the two are alike).

A column with a codec (``mb.Column(..., codec="zstd" | "lz4" | "jpeg:95")``) is read as
locally (:class:`mmbuffer._disk.columns.ShardedArray`): its staging rows come with the
mirror, and each shard file is the snapshot's object, fetched whole once per host,
checked against the table, mapped read-only from the cache and decoded in place by the
same compiled kernels (exactly the inner chunks a batch needs); so samples, slices and
frame stacks are the local store's, JPEG included (publishing keeps the local shard files
where the copy holds every row where the source does: ``publish``'s ``lossy_shards_kept``).

Sampling reads from a :class:`PoolConfig` pool of whole blocks (``_pool.py`` says
how that changes the distribution); ``pool=None`` reads exactly, on demand.
Publishing (``mb.convert.copy(src, url)``, ``mb.convert.publish``: ``convert/_pipeline/publish.py``)
and snapshots: ``_snapshot.py``.

Safety: every object read is checked against its snapshot's object table
(``_objects.py``), kept by digest in the host's bounded, shared cache (``_cache.py``:
``cache_limit``, LRU eviction, one download per object per host, typed errors for a
full or unwritable ``cache_dir``); ``engine="icechunk"`` publishes incrementally and
transactionally (``_icechunk.py``); ``refresh()`` fetches only the small parts whose
digest changed (the rest is hard linked from the mirror open before) and opens the new
snapshot beside sampling, swapping it in briefly (``_refresh.py``). Final
observations are compressed like the columns in a snapshot: only the chunks of their
episodes' slots are shipped.

Both engines publish incrementally: only objects whose digest changed are sent, and the
raw arrays (episode index, flags, tree) go as zstd chunks that the reader rebuilds bit
for bit (``_dense.py``); at 1e6 rows a publish after 1% new rows sends 2.4% of a full
publish's bytes, at 1e7 rows 1.1% (benchmarks/RESULTS.md), a wrapped ring too (the
copy keeps the local rows). The local copy a publish compares is kept for the next one
and appended to (``convert/_pipeline/staged.py``; files read for their digests only
where they changed), so at 1e7 rows a publish after 1% new rows takes 2–3% of a full
one's time. What a real multi-node deployment still needs (not built here): the object
table lists every object (O(store / chunk) bytes per publish); prefetch ahead of the
sampler across refreshes is not built. Both engines keep the ``keep`` newest snapshots or commits
(Icechunk's through ``expire_snapshots`` + ``garbage_collect``, ``_icechunk.expire``); a
reader on an older one gets ``StoreNotFoundError`` when it needs a deleted object. Writer groups exist on both engines: ``_group.py`` (each host's store under
its own prefix, one ``group.json`` swapped by compare-and-swap) and ``_icegroup.py``
(each host's store under its own folder of one Icechunk repository, commits rebased
over other writers').
Resumable distributed sampling (``BufferDataset.state_dict``, also over a newer
snapshot) is ``mmbuffer/data.py``'s; the pool takes part through ``set_shard(...,
draws=k)``, which starts it holding the blocks of its ``k``-th draw.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import errors, samplers
from .._disk import format as fmt
from .._disk.columns import ColumnArray, ShardedArray
from .._disk.columns.remote import RemoteArray
from .._disk.urls import filesystem, options_for
from .._ledger.manifest import load_manifest
from .._ledger.store import Store
from . import _icechunk, _snapshot
from ._cache import Cache
from ._filled import Filler, open_filled
from ._objects import FetchMany, Table, remote_errors
from ._parts import load_table
from ._pool import ChunkPool, PoolConfig, PooledSampler
from ._refresh import Refresher
from ._verified import ChunkRows, VerifiedStore, mapped_objects

__all__ = ["ChunkPool", "PoolConfig", "RemoteSource", "pool_config"]


@dataclass
class Opened:
    """A snapshot opened beside the current one: its store, pool, pin (fd) and table;
    ``shard``/``epoch``: the pool's shard when it was opened."""

    store: Store
    pool: ChunkPool | None
    snapshot: str
    sequence: int
    pin: int
    table: Table
    shard: tuple[int, int]
    epoch: int

    def close(self) -> None:
        """Close what it opened (a prepare refused, or one left unadopted)."""
        _close(self.store, self.pool, self.pin)
        self.pin = -1


class RemoteSource:
    """The snapshots of a store published at ``url``: what a read-only ``Buffer`` composes.

    It opens the snapshot the pointer names as an ordinary read-only :class:`Store`
    (small arrays mirrored into ``cache``, data columns read through zarr and the
    :class:`ChunkPool`), routes sampler specs through the pool, and on :meth:`refresh`
    opens the newest snapshot as a *new* Store for the facade to swap in: the facade's
    lock never changes. ``snapshot`` is the id of the snapshot opened last. Every object
    read is checked against the snapshot's object table (``_objects.py``) and kept in
    the host's bounded cache (``_cache.py``; ``cache_limit`` bytes, None: unbounded).
    ``pointer``: a callable naming the snapshot to open (a writer group's, ``_group.py``)
    instead of the URL's ``current.json``; ``repo``: the Icechunk repository it is read
    from (a writer of a group in one repository, ``_icegroup.py``).
    """

    def __init__(self, url: str, *, cache_dir: str | os.PathLike[str] | None = None,
                 storage_options: Mapping[str, Any] | None = None, pool: PoolConfig | None = None,
                 cache_limit: int | None = None, pointer: Callable[[], dict[str, Any]] | None = None,
                 repo: _icechunk.Repo | None = None) -> None:
        self.url = url.rstrip("/")
        self._given = pointer  # where the snapshot to open is named (a writer group's pointer), else the URL's own
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = filesystem(self.url, self.storage_options)
        self.files = Cache(_snapshot.cache_base(cache_dir), cache_limit)
        self.cache = _snapshot.cache_root(self.files.base, self.url)
        self.pool_config = pool
        self.pool: ChunkPool | None = None
        self.shard, self.pool_epoch = (0, 1), 0
        self.snapshot, self.sequence = "", -1
        self._pin = -1
        self.repo = repo  # set when the URL holds an Icechunk repository (a group's writer: given)
        self.table = Table({}, self.url, "")  # the open snapshot's object table
        self._path = Path()  # the open snapshot's mirror
        self._lock = threading.RLock()  # the facade's (open)
        self._swap: Callable[[Store], None] | None = None
        self._refresher: Refresher[Opened] = Refresher(self._newer, self._take, Opened.close)

    def _pointer(self) -> dict[str, Any]:
        if self._given is not None:
            return self._given()
        if self.repo is not None:
            return self.repo.pointer()
        try:
            return _snapshot.read_pointer(self.fs, self.root, self.url)
        except errors.StoreNotFoundError:
            if self.url.split("://", 1)[0] not in ("s3", "s3a", "file", "local") or not _icechunk.is_repo(
                    self.url, self.storage_options):
                raise
        self.repo = _icechunk.Repo(self.url, self.storage_options)
        return self.repo.pointer()

    def open(self, lock: threading.RLock, swap: Callable[[Store], None] | None = None) -> Store:
        """The Store of the snapshot the pointer names now, guarded by ``lock``; ``swap(store)``
        (called with ``lock`` held): how :meth:`refresh` hands the facade a newer one."""
        self._lock, self._swap = lock, swap
        return self._adopt(self._prepare(self._pointer()))

    def _mirror(self, pointer: Mapping[str, Any], previous: tuple[Path, Table] | None = None) -> tuple[Path, Table, int]:
        """The snapshot's checked table and local mirror, pinned (the pin's fd); files
        unchanged since ``previous`` (the mirror open now) are linked from it."""
        snap = str(pointer["snapshot"])
        extra: dict[str, bytes] = {}
        fetch_many: Callable[[list[str]], dict[str, bytes | None]]
        if self.repo is not None:
            repo = self.repo
            table = repo.table(pointer)

            def fetch_many(rels: list[str]) -> dict[str, bytes | None]:
                return {rel: _or_none(repo.fetch, snap, rel) for rel in rels}

            extra = {fmt.MANIFEST: json.dumps(pointer["manifest"]).encode(),
                     "zarr.json": json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()}
        else:
            table = load_table(self.fs, self.root, self.url, snap, str(pointer["objects"]),
                               before=previous[1] if previous is not None else None,
                               alive=lambda: _snapshot.check_alive(self.fs, self.root, snap, self.url),
                               later=_snapshot.read_later)
            fetch_many = _snapshot.fetch_objects(self.fs, self.root, table, self.url)
        pin = self.files.pin(self.cache / f"{snap}.pin")
        try:
            before = previous if previous is not None and previous[1].entries else None
            return _snapshot.mirror(fetch_many, snap, self.url, self.cache, self.files, table, extra, before), table, pin
        except BaseException:
            os.close(pin)
            raise

    def _fetch_many(self, snap: str, table: Table) -> FetchMany:
        """A batch of ``snap``'s objects fetched at once, through the engine that holds them."""
        if self.repo is None:
            return _snapshot.fetch_objects(self.fs, self.root, table, self.url)
        return self.repo.fetch_many(snap)

    def _column(self, snap: str, table: Table, name: str, expect: Any, base: Any, fetch: Callable[[str], bytes],
                alive: Callable[[], None] | None) -> tuple[RemoteArray, ChunkRows | None]:
        """A data column of a snapshot, every object (its ``zarr.json`` too) read through
        the verified, cached store over ``base`` (the engine's own store), and its exact
        reader (None if its chunks do not hold whole rows)."""
        import zarr

        store = VerifiedStore(base, prefix=name + "/", table=table, cache=self.files, fetch=fetch, alive=alive,
                              fetch_many=self._fetch_many(snap, table))
        where = f"{self.url}@{snap}/{name}"
        entry = table.get(f"{name}/zarr.json")
        if entry is None:
            raise table.missing(f"{name}/zarr.json")
        with remote_errors(self.url):
            meta = json.loads(store.read_object(f"{name}/zarr.json") or b"null")
        raw = isinstance(meta, dict) and isinstance(meta.get("codecs"), list) and bool(meta["codecs"]) \
            and isinstance(meta["codecs"][0], dict) and meta["codecs"][0].get("name") == "sharding_indexed"
        fmt.check_array_meta(Path(name), meta, expect, raw=raw)
        try:
            array = zarr.open_array(store=store, mode="r")
        except errors.MMBufferError:
            raise
        except Exception as exc:  # noqa: BLE001 - zarr's errors are untyped for us
            raise errors.CorruptStoreError(f"{where}: zarr cannot open the array ({type(exc).__name__}: {exc})") from None
        # an Icechunk commit's missing object is refused by the table's check (alive() then), never read as zeros
        arr = RemoteArray(array, where, cache_bytes=64 << 20, alive=alive if self.repo is None else None)
        if not ChunkRows.fits(array):
            return arr, None
        rows = ChunkRows(array, store, where, cache_bytes=64 << 20)
        arr.attach(rows)  # exact reads: a batch's chunks fetched together (a pool, if any, replaces it)
        return arr, rows

    def _prepare(self, pointer: Mapping[str, Any], mirrored: tuple[Path, Table, int] | None = None, *,
                 fill: bool = False) -> Opened:
        """The snapshot ``pointer`` names, opened beside the one open now (whose state it
        leaves alone; :meth:`_adopt` swaps it in); ``fill``: its pool's first blocks fetched."""
        snap = str(pointer["snapshot"])
        local, table, pin = mirrored if mirrored is not None else self._mirror(pointer)
        snap_url = f"{self.url}/{_snapshot.SNAPSHOTS}/{snap}"
        opened: dict[str, RemoteArray] = {}
        readers: dict[str, ChunkRows] = {}  # their exact readers: the pool fetches blocks through them
        fs = self.fs

        def alive() -> None:  # StoreNotFoundError if a newer publish removed the snapshot
            if self.repo is not None:
                self.repo.check_alive(snap)
            else:
                _snapshot.check_alive(fs, self.root, snap, self.url)

        fetch = _snapshot.object_fetch(fs, self.root, table)  # from the snapshot that holds it (this one, or an earlier one)
        filler = Filler(local, table, self._fetch_many(snap, table), self.files)

        def opener(name: str, expect: Any) -> ColumnArray | None:
            if name.split("/", 1)[1] in fmt.RESERVED_NAMES:  # the done flags: in the mirror (filled on demand)
                return open_filled(local, name, expect, filler)
            get: Callable[[str], bytes] = fetch
            if self.repo is not None:
                repo = self.repo
                get = lambda rel: repo.fetch(snap, rel)
            codec = manifest.codecs.get(name.split("/", 1)[1])
            if codec is not None:  # shards decoded in place by the local reader's kernels, each object verified
                return ShardedArray(local, name.split("/", 1)[1], writable=False, expect=expect, codec=codec,
                                    lane_size=manifest.lane_size, written=[st.written for st in manifest.lanes],
                                    shards=mapped_objects(table, self.files, get, alive))
            if self.repo is not None:
                arr, rows = self._column(snap, table, name, expect, repo.session(snap).store, get, alive)
            else:
                from zarr.storage import FsspecStore

                col_url = f"{snap_url}/{name}"  # never read: every get goes through the table
                base = FsspecStore.from_url(col_url, storage_options=options_for(col_url, self.storage_options),
                                            read_only=True)
                arr, rows = self._column(snap, table, name, expect, base, fetch, alive)
            opened[name.split("/", 1)[1]] = arr
            if rows is not None:
                readers[name.split("/", 1)[1]] = rows
            return arr

        store: Store | None = None
        pool: ChunkPool | None = None
        shard, epoch = self.shard, self.pool_epoch
        try:
            manifest = load_manifest(local)
            with remote_errors(self.url):
                store = Store(local, "r", columns=opener, lock=self._lock, manifest=manifest)
            if self.pool_config is not None and opened:
                # the view without the facade's lock (``view`` is ``@locked``): nobody else sees this store
                # yet, and a thread holding the lock may be waiting for this prepare (refresh, close)
                view = Store.view.__wrapped__(store)  # type: ignore[attr-defined]
                pool = ChunkPool(opened, view, store.capacity, self.pool_config, self.cache, self.files, readers)
                pool.set_shard(*shard, epoch=epoch)
            if pool is not None:  # else each column keeps its exact reader (ChunkRows)
                for arr in opened.values():
                    arr.attach(pool)
            if fill and pool is not None:
                with contextlib.suppress(errors.EmptyBufferError):  # raised by the first draw, as without fill
                    pool.advance()  # starts it: the first blocks come before the swap, not in a draw after it
        except BaseException:
            _close(store, pool, pin)
            raise
        return Opened(store, pool, snap, int(pointer["sequence"]), pin, table, shard, epoch)

    def _adopt(self, new: Opened) -> Store:
        """Read ``new`` from now on (with the facade's lock held); the previous snapshot's
        pool and pin are released (its store is the facade's to close)."""
        self.close_snapshot()
        self.pool, self.snapshot, self.sequence, self._pin = new.pool, new.snapshot, new.sequence, new.pin
        self.table, self._path = new.table, new.store.path
        if new.pool is not None and (new.shard, new.epoch) != (self.shard, self.pool_epoch):
            new.pool.set_shard(*self.shard, epoch=self.pool_epoch)  # set_shard ran during the prepare
        return new.store

    def check_objects(self) -> tuple[int, int, list[str]]:
        """Fetch every object of the open snapshot anew and check it against the snapshot's
        table (``mmbuffer verify URL``): ``(objects, bytes, problems)``."""
        snap, table = self.snapshot, self.table
        fetch_many: Callable[[list[str]], dict[str, bytes | None]]
        if self.repo is not None:
            repo = self.repo

            def fetch_many(rels: list[str]) -> dict[str, bytes | None]:
                return {rel: _or_none(repo.fetch, snap, rel) for rel in rels}
        else:
            fetch_many = _snapshot.fetch_objects(self.fs, self.root, table, self.url)
        table.need()  # every part
        rels, problems, total = sorted(table.entries), [], 0
        for start in range(0, len(rels), 64):
            for rel, data in fetch_many(rels[start:start + 64]).items():
                try:
                    if data is None:
                        raise table.missing(rel)
                    table.check(rel, data)
                    total += len(data)
                except errors.CorruptStoreError as exc:
                    problems.append(str(exc))
        return len(rels), total, problems

    def refresh(self, wait: bool = True) -> bool:
        """Move to the newest published snapshot; return whether it moved.

        The snapshot is fetched and opened without the facade's lock (samples read the
        old one meanwhile), then swapped in under it (``swap``); ``wait=False``: in a
        background thread, adopted by a later call (``_refresh.py``). A snapshot with
        another schema is refused (``CorruptStoreError``) and the source stays where it was.
        """
        return self._refresher.refresh(wait)

    def _newer(self) -> Opened | None:
        """The newest snapshot opened beside the current one, or None when it is open."""
        pointer = self._pointer()
        if pointer["snapshot"] == self.snapshot:
            return None
        mirrored = self._mirror(pointer, (self._path, self.table))
        try:
            old, new = load_manifest(self._path).schema(), load_manifest(mirrored[0]).schema()
            if old != new:
                raise errors.CorruptStoreError(
                    f"{self.url}: snapshot {pointer['snapshot']}: expected the schema opened, {old}, got {new}")
        except BaseException:
            os.close(mirrored[2])
            raise
        return self._prepare(pointer, mirrored, fill=self.pool is not None and self.pool.fetched_bytes > 0)

    def _take(self, new: Opened) -> None:
        with self._lock:
            store = self._adopt(new)
            if self._swap is not None:
                self._swap(store)

    def set_shard(self, index: int, count: int, *, epoch: int = 0, draws: int = 0) -> None:
        """Read the pool's blocks as shard ``index`` of ``count`` (rank * workers + worker),
        in the order of ``epoch`` (``BufferDataset`` calls it in each worker); ``draws``:
        as after that many draws (a resumed pass)."""
        self.shard, self.pool_epoch = (index, count), epoch
        if self.pool is not None:
            self.pool.set_shard(index, count, epoch=epoch, draws=draws)

    def route(self, spec: samplers.Sampler) -> samplers.Sampler:
        """``spec`` conditioned on the pool's blocks (``spec`` itself without a pool, and
        for the epoch sampler, which reads exactly)."""
        if self.pool is None or spec.stateful or isinstance(spec, PooledSampler):
            return spec
        return PooledSampler(spec, self.pool)

    def stop(self) -> None:
        """End refreshing: wait for a prepare running, close what it opened, join its thread."""
        self._refresher.close()

    def close_snapshot(self) -> None:
        """Release the open snapshot's pool and pin (its mirror may be evicted then)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self._pin >= 0:
            os.close(self._pin)
            self._pin = -1

    def close(self) -> None:
        self.stop()
        self.close_snapshot()

    def __repr__(self) -> str:
        return f"RemoteSource({self.url!r}, snapshot={self.snapshot!r}, pool={self.pool_config!r})"


def pool_config(url: str, mode: str, pool: Any) -> PoolConfig | None:
    """``mb.open``'s checks for a URL: read-only; ``pool`` a :class:`PoolConfig`,
    ``"default"`` (``PoolConfig()``) or None (exact, on-demand reads)."""
    if mode != "r":
        raise errors.InvalidArgumentError(
            f"mode: expected 'r' for the URL {url!r} (a published store is read-only; write locally and "
            f"publish with mb.convert.copy(path, url)), got {mode!r}"
        )
    if isinstance(pool, str) and pool == "default":
        return PoolConfig()
    if pool is not None and not isinstance(pool, PoolConfig):
        raise errors.InvalidArgumentError(f"pool: expected an mb.remote.PoolConfig or None, got {pool!r}")
    return pool


def _close(store: Store | None, pool: ChunkPool | None, pin: int) -> None:
    if pool is not None:
        pool.close()
    if store is not None:
        store.close()
    if pin >= 0:
        os.close(pin)


def _or_none(fetch: Callable[[str, str], bytes], snap: str, rel: str) -> bytes | None:
    try:
        return fetch(snap, rel)
    except FileNotFoundError:
        return None
