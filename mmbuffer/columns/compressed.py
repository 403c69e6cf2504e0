"""Compressed columns: chunked Zarr arrays (zstd, lz4) read and written through zarr-python.

For archives and object storage: a random gather decodes whole chunks, far slower
than a mapped raw column (DESIGN.md); ``mmbuffer copy`` turns them raw for training.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import _format as fmt
from .base import ColumnArray


class ZarrArray(ColumnArray):
    """A compressed column (``_format.CompressedArray``: checked metadata, typed errors)."""

    def __init__(self, array: fmt.CompressedArray) -> None:
        self._array = array
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)

    @classmethod
    def open(cls, root: Path, name: str, *, writable: bool, expect: fmt.Expect | None = None) -> ZarrArray:
        return cls(fmt.CompressedArray(root, name, writable=writable, expect=expect))

    def read(self, rows: np.ndarray) -> np.ndarray:
        return self._array[rows]

    def read_range(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        values = self._array[slice(start, stop)]
        if out is None:
            return values
        out[...] = values
        return out

    def write_range(self, start: int, values: np.ndarray) -> None:
        self._array[slice(start, start + len(values))] = values

    def write_at(self, rows: np.ndarray, values: np.ndarray) -> None:
        self._array[rows] = values

    def flush(self, start: int, stop: int) -> None:
        """zarr-python writes each chunk file whole when it is set: nothing is pending."""
