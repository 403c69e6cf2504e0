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
>>> ro.close()

``mb.open(url, mode="r", cache_dir=..., storage_options=..., pool=...)`` returns a read-only
:class:`~mmbuffer.Buffer` over a :class:`RemoteSource`: the small parts of the published snapshot (manifest, index,
tree, final observations, flags) are fetched whole into ``cache_dir`` and opened
by the ordinary store code; the data columns are read through zarr's store layer
(:class:`mmbuffer._disk.columns.RemoteArray`). fsspec is the I/O layer: it is what zarr,
xarray and pandas users configure already (``storage_options``, the ``AWS_*``
environment), one dependency covers S3, GCS, Azure, HTTP and local files, and
zarr-python's ``FsspecStore`` is its mature store (obstore is faster per request,
but the pool makes few, large requests, where the two are alike).

Sampling reads from a :class:`PoolConfig` pool of whole blocks (``_pool.py`` says
how that changes the distribution); ``pool=None`` reads exactly, on demand.
Publishing (``mb.convert.copy(src, url)``, ``mb.convert.publish``: ``convert/_pipeline/publish.py``)
and snapshots: ``_snapshot.py``.

What a real multi-node deployment still needs (not built here): publishing is a
full copy per snapshot (an incremental publish of the chunks written since the last
one would make frequent publishing cheap); the raw arrays of a snapshot (flags,
index, tree) are uploaded and fetched whole and dense, which costs about 16 bytes
per row of capacity (final observations are compressed like the columns: only the
chunks of their episodes' slots are shipped); a reader
pinned to a snapshot that ``keep`` has pruned fails (typed) and must ``refresh()``;
the mirror directories under ``cache_dir`` are never deleted by mmbuffer; and the
pool rotates blocks by draw count, with no adaptive prefetch depth for slow links.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import errors, samplers
from .._disk.columns.remote import RemoteArray
from .._disk.urls import filesystem
from .._ledger.manifest import load_manifest
from .._ledger.store import Store
from . import _snapshot
from ._pool import ChunkPool, PoolConfig, PooledSampler

__all__ = ["ChunkPool", "PoolConfig", "RemoteSource", "pool_config"]


class RemoteSource:
    """The snapshots of a store published at ``url``: what a read-only ``Buffer`` composes.

    It opens the snapshot the pointer names as an ordinary read-only :class:`Store`
    (small arrays mirrored into ``cache``, data columns read through zarr and the
    :class:`ChunkPool`), routes sampler specs through the pool, and on :meth:`refresh`
    opens the newest snapshot as a *new* Store for the facade to swap in: the facade's
    lock never changes. ``snapshot`` is the id of the snapshot opened last.
    """

    def __init__(self, url: str, *, cache_dir: str | os.PathLike[str] | None = None,
                 storage_options: Mapping[str, Any] | None = None, pool: PoolConfig | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = filesystem(self.url, self.storage_options)
        self.cache = _snapshot.cache_root(cache_dir, self.url)
        self.pool_config = pool
        self.pool: ChunkPool | None = None
        self.shard, self.pool_epoch = (0, 1), 0
        self.snapshot, self.sequence = "", -1

    def open(self, lock: threading.RLock) -> Store:
        """The Store of the snapshot the pointer names now, guarded by ``lock``."""
        return self._open(_snapshot.read_pointer(self.fs, self.root, self.url), lock)

    def _open(self, pointer: Mapping[str, Any], lock: threading.RLock) -> Store:
        snap = str(pointer["snapshot"])
        local = _snapshot.mirror(self.fs, self.root, snap, self.url, self.cache)
        snap_url = f"{self.url}/{_snapshot.SNAPSHOTS}/{snap}"
        opened: dict[str, RemoteArray] = {}

        def alive() -> None:
            _snapshot.check_alive(self.fs, self.root, snap, self.url)

        def opener(name: str, expect: Any) -> RemoteArray:
            arr = RemoteArray.open(snap_url, name, writable=False, expect=expect,
                                   storage_options=self.storage_options, alive=alive)
            opened[name.split("/", 1)[1]] = arr
            return arr

        store = Store(local, "r", columns=opener, lock=lock)
        pool = None
        if self.pool_config is not None and opened:
            pool = ChunkPool(opened, store.view(), store.capacity, self.pool_config, self.cache)
            pool.set_shard(*self.shard, epoch=self.pool_epoch)
        for arr in opened.values():
            arr.attach(pool)
        self.close()  # the previous snapshot's pool: its store is swapped out under the same lock
        self.pool, self.snapshot, self.sequence = pool, snap, int(pointer["sequence"])
        return store

    def refresh(self, current: Store, lock: threading.RLock) -> Store | None:
        """The newest published snapshot as a new Store, or None when ``current`` is it.

        A snapshot with another schema is refused (``CorruptStoreError``): the facade
        keeps ``current``. Call with ``lock`` held; close ``current`` after the swap.
        """
        pointer = _snapshot.read_pointer(self.fs, self.root, self.url)
        if pointer["snapshot"] == self.snapshot:
            return None
        local = _snapshot.mirror(self.fs, self.root, str(pointer["snapshot"]), self.url, self.cache)
        old, new = load_manifest(Path(current.path)).schema(), load_manifest(local).schema()
        if old != new:
            raise errors.CorruptStoreError(f"{self.url}: snapshot {pointer['snapshot']}: expected the schema opened, {old}, got {new}")
        return self._open(pointer, lock)

    def set_shard(self, index: int, count: int, *, epoch: int = 0) -> None:
        """Read the pool's blocks as shard ``index`` of ``count`` (rank * workers + worker),
        in the order of ``epoch`` (``BufferDataset`` calls it in each worker)."""
        self.shard, self.pool_epoch = (index, count), epoch
        if self.pool is not None:
            self.pool.set_shard(index, count, epoch=epoch)

    def route(self, spec: samplers.Sampler) -> samplers.Sampler:
        """``spec`` conditioned on the pool's blocks (``spec`` itself without a pool, and
        for the epoch sampler, which reads exactly)."""
        if self.pool is None or spec.stateful or isinstance(spec, PooledSampler):
            return spec
        return PooledSampler(spec, self.pool)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

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
