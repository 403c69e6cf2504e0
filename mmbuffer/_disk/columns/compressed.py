"""Compressed columns: chunked Zarr arrays (zstd, lz4) read and written through zarr-python.

For archives and object storage: a random gather decodes whole chunks, far slower
than a mapped raw column (docs/design.md); ``mmbuffer copy`` turns them raw for training.
The metadata is checked like every array of a store (``_format.check_array_meta``),
no link is followed inside the array (zarr opens files by path), and what zarr
cannot open or decode is a ``CorruptStoreError``.
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

    def __init__(self, array: Any, where: Path) -> None:
        self._array = array
        self._where = where
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)

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
        return cls(array, root / name)

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
        self._array[start : start + len(values)] = values

    def write_at(self, rows: np.ndarray, values: np.ndarray) -> None:
        if self._array.read_only:
            self.refuse_write(self._where, "write_at")
        self._array.oindex[np.asarray(rows, dtype=np.int64)] = values

    def flush(self, start: int, stop: int) -> None:
        """zarr-python writes each chunk file whole when it is set: nothing is pending."""
