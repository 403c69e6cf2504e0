"""Columns with a codec: Zarr v3 shards of small zstd chunks, decoded in one compiled call per batch.

Layout: ``sharding.py``. This backend reads and writes it.

Writing (the single writer only). Rows go to a lane's staging half of the shard
they belong to (``staging/<name>/rows``, raw and mapped); when a shard's last row is
written, the shard is encoded once (``kernels.codec.encode_shard``: every inner chunk,
its crc32c, the index) into ``<shard file>.partial``, which is renamed over the shard
file: a reader's map keeps the file it opened, whole. Rows are therefore written in
each lane's order (``write_range`` refuses anything else) and nothing is encoded per
``extend``. Before a half is reused for the shard two ahead, its tag
(``staging/<name>/tags``) is set to that shard's number, before any row lands in it.

Where a row is. Given a lane's cursor ``written`` (the caller's ledger: what the
writer extended, or a reader's last commit) row ``a`` (absolute) is in the staging
half ``(a // shard_rows) % 2`` while its shard is incomplete (``a // shard_rows ==
written // shard_rows``), else in the shard file, whose header names the absolute
shard it holds.

Durability (``flush``, at commit): shard files written since the last flush are
fsynced with their directories, then the staging rows and tags. A half that holds
committed rows is reused only after its shard's file is fsynced and the new tag is
on disk, so a crash at any instant leaves every committed row in the staging half
the manifest implies or in a durable shard file. A writer reopening a store after a
crash reloads the staging half of a lane's incomplete shard from the shard file when
the dead writer had moved on (``_repair``).

Reading. A reader (another process) checks after the copy what a writer may have
changed meanwhile: a staged row whose half's tag changed is read from its shard file
instead (the writer finished that shard before reusing the half); a shard file
holding a later shard than wanted means the writer lapped the row, which the
store's re-check (``_read/recheck.py``: the reservation) redraws; an earlier one, or
none, is ``CorruptStoreError``. Every chunk's crc32c is checked before it is decoded,
and a decoded size other than the chunk's is ``CorruptStoreError`` naming the column,
the shard file and the inner chunk: never wrong pixels.

>>> import tempfile, numpy as np, mmbuffer as mb
>>> buf = mb.create(tempfile.mkdtemp() + "/z", {"x": mb.Column((2,), "uint8", codec="zstd")},
...                 capacity=16, next_keys=())
>>> buf.extend({"x": np.arange(20, dtype="uint8").reshape(10, 2)})
>>> buf.get([0, 9])["x"].tolist()
[[0, 1], [18, 19]]
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import files as _files, safe_io as _safe_io
from ... import errors
from .. import format as fmt
from ...config import config
from .sharding import check_meta
from .base import ColumnArray
from .raw import RawArray

__all__ = ["ShardedArray"]


def default_max_maps() -> int:
    """Shard files a column keeps mapped at most: each map holds a file descriptor
    (Python's ``mmap`` keeps a duplicate), so an eighth of the soft ``RLIMIT_NOFILE``
    (128 at the common 1,024), the oldest let go beyond it; a million 84x84 frames
    are about 2,000 shard files."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft // 8))


class ShardedArray(ColumnArray):
    """A column with a codec (see the module docstring)."""

    def __init__(self, root: Path, name: str, *, writable: bool, expect: fmt.Expect, codec: str, lane_size: int,
                 written: Sequence[int], cursors: Callable[[], np.ndarray] | None = None,
                 cache_bytes: int | None = None, shards: Callable[[str], np.ndarray | None] | None = None,
                 max_maps: int | None = None) -> None:
        self._root, self._name, self._where = root, name, root / "columns" / name
        self._writable = writable
        rows, row_shape, dtype = expect
        self.shape, self.dtype = (rows, *row_shape), np.dtype(dtype)
        meta = _files.read_json_in(root, f"columns/{name}/zarr.json")
        self._inner, self._shard = check_meta(self._where / "zarr.json", meta, expect, codec)
        self._kind, self._level = fmt.check_codec(name, codec, row_shape, self.dtype) if codec.startswith("jpeg") \
            else fmt.parse_codec(name, codec)
        if rows % lane_size or lane_size % self._shard:
            raise errors.CorruptStoreError(f"{self._where}/zarr.json: expected shards dividing the lane size {lane_size}, got {self._shard} rows")
        self._lane = lane_size
        self._streams = rows // lane_size
        self._row_bytes = int(np.prod(row_shape, dtype=np.int64)) * self.dtype.itemsize
        s2 = 2 * self._shard
        self._stage_arr = RawArray.open(root, f"staging/{name}/rows", writable=writable, expect=(self._streams * s2, row_shape, self.dtype))
        self._tags_arr = RawArray.open(root, f"staging/{name}/tags", writable=writable, expect=(self._streams * 2, (), np.dtype(np.int64)))
        self._stage, self._tags = self._stage_arr.mapped(), self._tags_arr.mapped()
        files = rows // self._shard
        self._addr = np.zeros(files, np.int64)  # per shard file: its map's address (0: not mapped),
        self._size = np.zeros(files, np.int64)  # its size
        self._ver = np.full(files, -1, np.int64)  # and the absolute shard it holds (-1: none)
        self._maps: list[Any] = [None] * files
        self._shards = shards  # rel -> the shard object's bytes (None: not in the snapshot), else files under root
        self._held: dict[int, None] = {}  # shard files mapped, oldest first
        self._max_maps = max(1, default_max_maps() if max_maps is None else max_maps)
        self._cursors = cursors
        self._written = np.array(written, dtype=np.int64)  # the writer's cursors (its own rows)
        self._durable = self._written.copy()  # the cursors of the last flush (the commit)
        self._ready = np.zeros(self._streams, bool)  # staging checked after a crash (``_repair``)
        self._pending: set[int] = set()  # shard files written since the last flush
        self._cache_bytes = config.decode_cache_bytes if cache_bytes is None else cache_bytes
        self._cache: Any = None
        self._dctx: Any = None
        self._cctx: Any = None
        self._buf: np.ndarray | None = None
        self._lock = threading.Lock()

    # -- where rows are ------------------------------------------------------------------
    def _rel(self, f: int) -> str:
        return "/".join(["columns", self._name, "c", str(f), *(["0"] * (len(self.shape) - 1))])

    def _file(self, lane: int, k: int) -> int:
        """The shard file of absolute shard ``k`` of ``lane``."""
        per = self._lane // self._shard
        return lane * per + k % per

    def _remap(self, f: int) -> None:
        """Map shard file ``f`` afresh (the writer may have replaced it), header and index checked."""
        self._addr[f], self._size[f], self._ver[f], self._maps[f] = 0, 0, -1, None
        self._held.pop(f, None)
        rel = self._rel(f)
        per = self._shard // self._inner
        data = self._shards(rel) if self._shards is not None else self._map_file(rel, 16 + 16 * per + 4)
        if data is None:
            return
        size = len(data)
        if size < 16 + 16 * per + 4:
            raise errors.CorruptStoreError(f"{self._root / rel}: column {self._name!r}: file seems not fully written: expected at least {16 + 16 * per + 4} bytes, got {size}")
        from ...kernels import codec

        index = data[size - 16 * per - 4 : size - 4]
        if data[:8].tobytes() != codec.MAGIC.tobytes() or codec.crc32c(index) != int(data[size - 4 :].view("<u4")[0]):
            raise errors.CorruptStoreError(
                f"{self._root / rel}: column {self._name!r}: shard header or index: expected the magic b'MMBSHRD1' and an index "
                f"matching its crc32c, got {data[:8].tobytes()!r} and a mismatch"
            )
        self._maps[f] = data
        self._addr[f], self._size[f], self._ver[f] = data.ctypes.data, size, int(data[8:16].view("<i8")[0])
        self._held[f] = None

    def _map_file(self, rel: str, least: int) -> np.ndarray | None:
        """The shard file ``rel`` mapped (None: no file; zeros of its size when shorter than ``least``, which the caller refuses)."""
        if not _safe_io.lexists(self._root, rel):
            return None
        fd = _safe_io.open_file(self._root, rel)
        try:
            size = os.fstat(fd).st_size
            if size < least:
                return np.zeros(size, np.uint8)
            handle = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if config.madvise_random and hasattr(mmap, "MADV_RANDOM"):
            handle.madvise(mmap.MADV_RANDOM)
        return np.frombuffer(handle, np.uint8)

    # -- reading ---------------------------------------------------------------------------
    def read(self, rows: np.ndarray) -> np.ndarray:
        idx = np.asarray(rows, dtype=np.int64)
        flat = idx.reshape(-1)
        out = np.empty((flat.size, *self.row_shape), self.dtype)
        if flat.size:
            if flat.min() < 0 or flat.max() >= self.shape[0]:
                raise IndexError(f"{self._where}: row ids must lie in [0, {self.shape[0]})")
            with self._lock:
                self._read_into(flat, out)
        return out.reshape(idx.shape + self.row_shape)

    def _read_into(self, flat: np.ndarray, out: np.ndarray) -> None:
        from ...kernels import staging

        S = self._shard
        if len(self._held) > self._max_maps:  # keep those this read needs, let the oldest others go
            self._let_go(set(np.unique(flat // S).tolist()))
        written = self._cursors() if self._cursors is not None else self._written
        todo, stale = staging.locate(flat, written, self._lane, S, self._tags, self._ver,
                                     self._stage.reshape(len(self._stage), -1).view(np.uint8),
                                     out.reshape(len(out), -1).view(np.uint8))
        if todo.shape[1] == 0:
            return
        rows, kk, at = todo
        if not stale:  # every shard file mapped at the shard wanted (the common case)
            self._decode(rows, kk, at, out)
            return
        f = rows // S
        for s in np.unique(f[self._ver[f] != kk]).tolist():  # a shard file replaced since this process mapped it
            self._remap(s)
        ver = self._ver[f]
        if (ver < kk).any():  # a shard the ledger says is complete is not on disk
            b = int(np.flatnonzero(ver < kk)[0])
            raise errors.CorruptStoreError(
                f"{self._root / self._rel(int(f[b]))}: column {self._name!r}: expected shard {int(kk[b])} of lane "
                f"{int(rows[b]) // self._lane} (rows the manifest commits), got {'no file' if ver[b] < 0 else f'shard {int(ver[b])}'}"
            )
        keep = ver == kk  # later shards: the writer lapped these rows (the caller's re-check redraws them)
        if not keep.all():
            out[at[~keep]] = 0
        self._decode(rows[keep], kk[keep], at[keep], out)

    def _let_go(self, keep: set[int]) -> None:
        for s in [s for s in self._held if s not in keep][: len(self._held) - self._max_maps]:
            del self._held[s]
            self._addr[s], self._size[s], self._ver[s], self._maps[s] = 0, 0, -1, None

    def _decode(self, rows: np.ndarray, versions: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
        from ...kernels import codec

        if self._cache is None:
            self._cache = codec.Cache(self._inner * self._row_bytes, self._cache_bytes)
        if self._kind == "jpeg":
            self._decode_jpeg(rows, versions, positions, out)
            return
        if self._dctx is None:
            self._dctx = codec.Context(compress=False, kind=self._kind)
        fail = codec.decode_rows(self._dctx, rows, versions, positions, self._inner, self._shard, self._row_bytes,
                                 self._addr, self._size, self._cache, out.reshape(-1).view(np.uint8))
        if fail is not None:
            f, ci, reason = fail
            first = f * self._shard + ci * self._inner
            raise errors.CorruptStoreError(
                f"{self._root / self._rel(f)}: column {self._name!r}: inner chunk {ci} (rows {first}-{first + self._inner - 1}): "
                f"expected a chunk that passes its checks, got {reason}"
            )

    def _decode_jpeg(self, rows: np.ndarray, versions: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
        from ...kernels import images
        from .jpeg import imagecodecs

        imagecodecs(self._name)  # SchemaError naming the column and the extra
        fail = images.decode_rows(rows, versions, positions, self._shard, self.row_shape, self._addr, self._size,
                                  self._maps, self._cache, out.reshape(-1).view(np.uint8))
        if fail is not None:
            f, ci, reason = fail
            raise errors.CorruptStoreError(
                f"{self._root / self._rel(f)}: column {self._name!r}: inner chunk {ci} (row {f * self._shard + ci}): "
                f"expected a chunk that passes its checks, got {reason}"
            )

    # -- writing (the single writer) ---------------------------------------------------------
    def write_range(self, start: int, values: np.ndarray) -> None:
        if not self._writable:
            self.refuse_write(self._where, "write_range")
        n = len(values)
        if n == 0:
            return
        L, S = self._lane, self._shard
        lane, p = divmod(int(start), L)
        with self._lock:
            a = int(self._written[lane])
            if p != a % L or p + n > L:
                raise errors.InvalidArgumentError(
                    f"{self._where}: write_range: a column with a codec is written in each lane's order: expected rows from "
                    f"{lane * L + a % L} (at most {L - a % L}), got {n} rows from {start}"
                )
            if not self._ready[lane]:
                self._repair(lane)
            i = 0
            while i < n:
                k, off = divmod(a, S)
                m = min(n - i, S - off)
                half = lane * 2 + k % 2
                if self._tags[half] != k:
                    self._enter(lane, k)
                self._stage_arr.write_range(half * S + off, values[i : i + m])
                a, i = a + m, i + m
                if a % S == 0:
                    self._encode(lane, k)
            self._written[lane] = a

    def _enter(self, lane: int, k: int) -> None:
        """Take staging half ``k % 2`` of ``lane`` for absolute shard ``k``: if it holds
        committed rows (the last flush ended inside shard ``k - 2``), their shard file is
        made durable and the new tag reaches the disk before any row overwrites them."""
        half = lane * 2 + k % 2
        d = int(self._durable[lane])
        keep = d // self._shard == k - 2 and d % self._shard
        if keep:
            self._sync_files([self._file(lane, k - 2)])
        self._tags[half] = k
        if keep:
            self._tags_arr.flush(half, half + 1)

    def _encode(self, lane: int, k: int) -> None:
        """Encode the complete shard ``k`` of ``lane`` from its staging half into its file."""
        from ...kernels import codec

        S = self._shard
        chunks, chunk_bytes = S // self._inner, self._inner * self._row_bytes
        half = lane * 2 + k % 2
        src = self._stage[half * S : (half + 1) * S].reshape(-1).view(np.uint8)
        if self._kind == "lz4":
            blob = codec.encode_shard_lz4(self.dtype.itemsize, src, chunks, chunk_bytes, k)
            self._buf, n = np.frombuffer(blob, np.uint8), len(blob)
        elif self._kind == "jpeg":
            from ...kernels import images
            from .jpeg import imagecodecs

            imagecodecs(self._name)
            blob = images.encode_shard(self._level, self._stage[half * S : (half + 1) * S], k)
            self._buf, n = np.frombuffer(blob, np.uint8), len(blob)
        else:
            if self._cctx is None:
                self._cctx = codec.Context(compress=True)
                self._buf = np.empty(codec.shard_bound(chunks, chunk_bytes), np.uint8)
            assert self._buf is not None
            n = codec.encode_shard(self._cctx, self._level, src, chunks, chunk_bytes, k, self._buf)
        f = self._file(lane, k)
        rel = self._rel(f)
        parent = self._root.joinpath(*rel.split("/")[:-1])
        parent.mkdir(parents=True, exist_ok=True)
        _safe_io.check_tree(self._root, str(Path(rel).parent))  # no link on the way
        tmp = parent / (rel.rsplit("/", 1)[1] + ".partial")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            view = self._buf.data[:n]
            while len(view):
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, parent / rel.rsplit("/", 1)[1])
        self._ver[f] = -1  # this process maps the new file at its next read
        self._pending.add(f)

    def _sync_files(self, files: Sequence[int]) -> None:
        todo = [f for f in files if f in self._pending]
        dirs: set[Path] = set()
        for f in todo:
            _files.fsync_in(self._root, self._rel(f))
            parts = self._rel(f).split("/")[:-1]
            dirs.update(self._root.joinpath(*parts[:j]) for j in range(2, len(parts) + 1))
        for d in sorted(dirs, key=lambda x: len(x.parts), reverse=True):
            _files.fsync_dir(d)
        self._pending.difference_update(todo)

    def _repair(self, lane: int) -> None:
        """Before a lane's first write: if a dead writer reused the staging half of the
        committed incomplete shard, load its rows back from the shard file it wrote first."""
        w = int(self._written[lane])
        k, off = divmod(w, self._shard)
        half = lane * 2 + k % 2
        if off and self._tags[half] != k:
            f = self._file(lane, k)
            self._remap(f)
            if self._ver[f] != k:
                raise errors.CorruptStoreError(
                    f"{self._root / self._rel(f)}: column {self._name!r}: expected shard {k} (committed rows of lane {lane} "
                    f"no longer staged), got {'no file' if self._ver[f] < 0 else f'shard {int(self._ver[f])}'}"
                )
            rows = f * self._shard + np.arange(off, dtype=np.int64)
            values = np.empty((off, *self.row_shape), self.dtype)
            self._decode(rows, np.full(off, k, np.int64), np.arange(off, dtype=np.int64), values)
            self._stage[half * self._shard : half * self._shard + off] = values
            self._tags[half] = k
            self._stage_arr.flush(half * self._shard, half * self._shard + off)
            self._tags_arr.flush(half, half + 1)
        self._ready[lane] = True

    def write_at(self, rows: np.ndarray, values: np.ndarray) -> None:
        if not self._writable:
            self.refuse_write(self._where, "write_at")
        raise errors.InvalidArgumentError(f"{self._where}: write_at: a column with a codec is written in each lane's order (write_range)")

    def flush(self, start: int, stop: int) -> None:
        """fsync the shard files written since the last flush, then the staging of the
        lane of rows ``[start, stop)`` (see the module docstring)."""
        if stop <= start:
            return
        with self._lock:
            self._sync_files(sorted(self._pending))
            lane = start // self._lane
            s2 = 2 * self._shard
            self._stage_arr.flush(lane * s2, (lane + 1) * s2)
            self._tags_arr.flush(lane * 2, lane * 2 + 2)
            self._durable[lane] = self._written[lane]

    def release(self) -> None:
        with self._lock:
            self._addr[:], self._size[:], self._ver[:] = 0, 0, -1
            self._maps = [None] * len(self._maps)
            self._held.clear()
            self._cache = None
            self._stage_arr.release()

    def close(self) -> None:
        for arr in (self._stage_arr, self._tags_arr):
            arr.close()
        for ctx in (self._dctx, self._cctx):
            if ctx is not None and hasattr(ctx, "close"):
                ctx.close()
        self._dctx = self._cctx = None
        self._cache = None
