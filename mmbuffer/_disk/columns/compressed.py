"""Compressed columns: chunked Zarr arrays (zstd, lz4) read and written through zarr-python.

For archives and object storage: a random gather decodes whole chunks, far slower
than a mapped raw column (docs/design.md); ``mmbuffer copy`` turns them raw for training.
The metadata is checked like every array of a store (``_format.check_array_meta``),
no link is followed inside the array (zarr opens files by path), and what zarr
cannot open or decode is a ``CorruptStoreError``.

Durability: zarr-python replaces a chunk file whole when rows in it are set (a
``.partial`` file renamed over it: a kill leaves the old chunk or the new one), but
fsyncs nothing. The array remembers the chunks written since they were last made
durable, and :meth:`ZarrArray.flush` fsyncs those files and every directory from
theirs up to the store root (zarr makes a directory per chunk coordinate), so a
commit's manifest never names rows that a power cut can take back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import files as _files, safe_io as _safe_io
from ... import errors
from .. import format as fmt
from .base import ColumnArray


class ZarrArray(ColumnArray):
    """A compressed column of a store."""

    def __init__(self, array: Any, where: Path, root: Path | None = None, name: str = "") -> None:
        self._array = array
        self._where = where
        self._root, self._name = root, name  # the store and the array's path in it (flush)
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)
        self._chunk_rows = int(array.metadata.chunk_grid.chunk_shape[0])  # rows per stored file
        self._dirty: set[int] = set()  # stored files written since the last flush

    @classmethod
    def open(cls, root: Path, name: str, *, writable: bool, expect: fmt.Expect | None = None) -> ZarrArray:
        meta = root / name / "zarr.json"
        fmt.check_array_meta(meta, _files.read_json_in(root, f"{name}/zarr.json"), expect, raw=False)
        _safe_io.check_tree(root, name)
        import zarr  # only compressed stores need zarr to be read (mmbuffer info stays light)

        try:
            array = zarr.open_array(str(root / name), mode="r+" if writable else "r")
        except Exception as exc:  # noqa: BLE001 - zarr's errors are untyped for us
            raise errors.CorruptStoreError(f"{meta}: zarr cannot open the array ({type(exc).__name__}: {exc})") from None
        return cls(array, root / name, root, name)

    def _decoded(self, read: Callable[[], Any]) -> np.ndarray:
        try:
            return np.asarray(read())
        except (IndexError, errors.MMBufferError):
            raise
        except Exception as exc:  # noqa: BLE001 - a chunk that does not decode
            raise errors.CorruptStoreError(f"{self._where}: a chunk cannot be read ({type(exc).__name__}: {exc})") from None

    def read(self, rows: np.ndarray) -> np.ndarray:
        idx = np.asarray(rows, dtype=np.int64)
        uniq, inverse = np.unique(idx.reshape(-1), return_inverse=True)
        values = self._decoded(lambda: self._array.oindex[uniq])
        return values[inverse].reshape(idx.shape + self.row_shape)

    def read_range(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        values = self._decoded(lambda: self._array[start:stop])
        if out is None:
            return values
        out[...] = values
        return out

    def write_range(self, start: int, values: np.ndarray) -> None:
        if self._array.read_only:
            self.refuse_write(self._where, "write_range")
        if len(values):
            self._dirty.update(range(start // self._chunk_rows, (start + len(values) - 1) // self._chunk_rows + 1))
        self._array[start : start + len(values)] = values

    def write_at(self, rows: np.ndarray, values: np.ndarray) -> None:
        if self._array.read_only:
            self.refuse_write(self._where, "write_at")
        idx = np.asarray(rows, dtype=np.int64)
        self._dirty.update(np.unique(idx // self._chunk_rows).tolist())
        self._array.oindex[idx] = values

    def flush(self, start: int, stop: int) -> None:
        """fsync the chunk files written since the last flush that hold rows of
        ``[start, stop)``, and their directories up to the store root (see the
        module docstring); a file zarr removed (all fill value) needs only those."""
        if self._root is None or stop <= start:
            return
        first, last = start // self._chunk_rows, (stop - 1) // self._chunk_rows
        todo = sorted(c for c in self._dirty if first <= c <= last)
        zeros = (0,) * (len(self.shape) - 1)
        dirs: set[tuple[str, ...]] = set()
        for c in todo:
            key = self._array.metadata.encode_chunk_key((c, *zeros))
            if not self._root.joinpath(self._name, key).parent.is_dir():
                continue  # all fill value from the start: zarr wrote no file, nor its directory
            _files.fsync_in(self._root, f"{self._name}/{key}")
            parts = f"{self._name}/{key}".split("/")[:-1]
            dirs.update(tuple(parts[:k]) for k in range(len(parts) + 1))
        for d in sorted(dirs, key=len, reverse=True):  # deepest first, the store root last
            _files.fsync_dir(self._root.joinpath(*d))
        self._dirty.difference_update(todo)
