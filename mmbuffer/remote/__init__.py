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

``mb.open(url, mode="r", cache_dir=..., storage_options=..., pool=...)`` returns a
:class:`RemoteBuffer`: the small parts of the published snapshot (manifest, index,
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
one would make frequent publishing cheap); the raw arrays of a snapshot (final
observations, flags, index, tree) are uploaded and fetched whole and dense, which
costs about 16 bytes per row of capacity plus the final observations; a reader
pinned to a snapshot that ``keep`` has pruned fails (typed) and must ``refresh()``;
the mirror directories under ``cache_dir`` are never deleted by mmbuffer; and the
pool rotates blocks by draw count, with no adaptive prefetch depth for slow links.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from .. import errors, samplers
from .._ledger.manifest import load_manifest
from ..buffer import Buffer
from .._disk.columns.remote import RemoteArray
from .._read.gather import Batch
from .._disk.urls import filesystem
from . import _snapshot
from ._pool import ChunkPool, PoolConfig, PooledSampler

__all__ = ["ChunkPool", "PoolConfig", "RemoteBuffer", "open_remote"]


class RemoteBuffer(Buffer):
    """A published store opened read-only from a URL (use ``mb.open(url, mode="r")``).

    ``snapshot`` is the id of the snapshot it reads: pinned until :meth:`refresh`.
    ``pool`` is the :class:`ChunkPool` (None in exact mode).
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
        self.open_snapshot(_snapshot.read_pointer(self.fs, self.root, self.url))

    def open_snapshot(self, pointer: Mapping[str, Any]) -> None:
        """(Re)initialize this buffer on the snapshot ``pointer`` names."""
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

        super().__init__(local, "r", columns=opener)
        self.snapshot = snap
        self.sequence = int(pointer["sequence"])
        if self.pool_config is not None and opened:
            self.pool = ChunkPool(opened, self.view(), self.capacity, self.pool_config, self.cache)
            self.pool.set_shard(*self.shard, epoch=self.pool_epoch)
        for arr in opened.values():
            arr.attach(self.pool)

    def __repr__(self) -> str:
        return (f"RemoteBuffer({self.url!r}, snapshot={self.snapshot!r}, rows={len(self)}, "
                f"episodes={self.num_episodes}, pool={self.pool_config!r})")

    def set_shard(self, index: int, count: int, *, epoch: int = 0) -> None:
        """Read the pool's blocks as shard ``index`` of ``count`` (rank * workers + worker),
        in the order of ``epoch`` (``BufferDataset`` calls it in each worker)."""
        with self.lock:
            self.shard, self.pool_epoch = (index, count), epoch
            if self.pool is not None:
                self.pool.set_shard(index, count, epoch=epoch)

    def refresh(self) -> bool:
        """Move to the newest published snapshot; return whether it changed.

        Batches already returned keep their data; the old snapshot's pool is dropped.
        A snapshot with another schema is refused (``CorruptStoreError``), and this
        buffer stays on the one it had.
        """
        with self.lock:
            pointer = _snapshot.read_pointer(self.fs, self.root, self.url)
            if pointer["snapshot"] == self.snapshot:
                return False
            local = _snapshot.mirror(self.fs, self.root, str(pointer["snapshot"]), self.url, self.cache)
            old, new = load_manifest(Path(self.path)).schema(), load_manifest(local).schema()
            if old != new:
                raise errors.CorruptStoreError(f"{self.url}: snapshot {pointer['snapshot']}: expected the schema opened, {old}, got {new}")
            self.close()
            self.open_snapshot(pointer)
            return True

    def sample(self, batch_size: int, generator: torch.Generator | None = None, *, prioritized: bool = False,
               beta: float = 0.4, keys: Iterable[str] | None = None, sampler: samplers.Sampler | None = None) -> Batch:
        """As :meth:`Buffer.sample`, drawn from the pool's blocks (exactly, without a pool)."""
        spec = samplers.resolve(sampler, prioritized=prioritized, beta=beta)
        return super().sample(batch_size, generator, keys=keys, sampler=self.through_pool(spec))

    def indices(self, sampler: samplers.Sampler, n: int, generator: torch.Generator | None = None) -> samplers.Draw:
        """As :meth:`Buffer.indices`, drawn from the pool's blocks (what ``mb.stream`` and
        ``BufferDataset`` call)."""
        return super().indices(self.through_pool(sampler), n, generator)

    def through_pool(self, spec: samplers.Sampler) -> samplers.Sampler:
        """``spec`` conditioned on the pool's blocks (``spec`` itself without a pool, and
        for the epoch sampler, which reads exactly)."""
        if self.pool is None or isinstance(spec, (PooledSampler, samplers.Epoch)):
            return spec
        return PooledSampler(spec, self.pool)

    def sample_slices(self, num_slices: int, slice_len: int, strict: bool = True,
                      generator: torch.Generator | None = None, *, prioritized: bool = False, beta: float = 0.4,
                      weighting: str = "windows", keys: Iterable[str] | None = None) -> Batch:
        """As :meth:`Buffer.sample_slices`, drawn from the pool's blocks."""
        spec = samplers.resolve(None, slice_len, prioritized=prioritized, beta=beta, strict=strict, weighting=weighting)
        return self.sample(num_slices, generator, keys=keys, sampler=spec)

    def close(self) -> None:
        with self.lock:
            if self.pool is not None:
                self.pool.close()
                self.pool = None
            super().close()


def open_remote(url: str, *, mode: str = "r", cache_dir: str | os.PathLike[str] | None = None,
                storage_options: Mapping[str, Any] | None = None, pool: Any = "default") -> RemoteBuffer:
    """``mb.open`` for a URL: read-only; ``pool`` a :class:`PoolConfig`, ``"default"``
    (``PoolConfig()``) or None (exact, on-demand reads)."""
    if mode != "r":
        raise errors.InvalidArgumentError(
            f"mode: expected 'r' for the URL {url!r} (a published store is read-only; write locally and "
            f"publish with mb.convert.copy(path, url)), got {mode!r}"
        )
    if isinstance(pool, str) and pool == "default":
        pool = PoolConfig()
    if pool is not None and not isinstance(pool, PoolConfig):
        raise errors.InvalidArgumentError(f"pool: expected an mb.remote.PoolConfig or None, got {pool!r}")
    return RemoteBuffer(url, cache_dir=cache_dir, storage_options=storage_options, pool=pool)
