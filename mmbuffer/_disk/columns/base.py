"""The column backend contract: one array of rows of a store, behind a protocol.

A store keeps every column, the final observations, the episode index and the
priority tree as arrays of rows ``[rows, *row_shape]``. :class:`ColumnArray` is
what the store asks of each, whatever holds the bytes: read rows at given ids into
a new array (a gather), read or write a contiguous range, write at given ids,
make a range durable, and drop this process's pages. ``RawArray`` (``raw.py``)
memory-maps a file and writes large blocks with ``pwrite``; ``ZarrArray``
(``compressed.py``) reads and writes compressed chunks through zarr-python; a
later backend (object storage, a chunk pool) is one more file that passes the same
conformance suite (``tests/disk/test_columns.py``, zarr's ``StoreTests`` is the model).

The index and the tree are updated in place by pure functions over numpy arrays:
a backend whose bytes are mapped into the process exposes them with
:meth:`ColumnArray.mapped`; others return None, and the store keeps such arrays
where it can map them.
"""

from __future__ import annotations

import abc
from pathlib import Path

import numpy as np

from ... import errors


class ColumnArray(abc.ABC):
    """Rows ``[rows, *row_shape]`` of one dtype. Row ids are global (0 .. rows - 1)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @staticmethod
    def refuse_write(where: Path | str, what: str) -> None:
        """The typed refusal of a write to an array opened read-only (nothing is written)."""
        raise errors.ReadOnlyError(f"{where}: {what}: expected an array opened writable, got one opened read-only")

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @abc.abstractmethod
    def read(self, rows: np.ndarray) -> np.ndarray:
        """A new array ``rows.shape + row_shape`` of the rows at ids ``rows``."""

    def ahead(self, rows: np.ndarray) -> None:
        """``rows`` (flat global ids, a batch's) are about to be read: a backend that fetches
        them from afar may start now, so that a batch's columns, read one after another,
        are fetched together (``gather`` calls it for each such column first). The
        default does nothing."""

    def read_range(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[start, stop)``, into ``out`` (C-contiguous) when given (here a gather of
        those ids; a backend with a faster contiguous read overrides it)."""
        values = self.read(np.arange(start, stop, dtype=np.int64))
        if out is None:
            return values
        out[...] = values
        return out

    @abc.abstractmethod
    def write_range(self, start: int, values: np.ndarray) -> None:
        """Write ``values`` (``[n, *row_shape]``) at rows ``[start, start + n)``."""

    @abc.abstractmethod
    def write_at(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Write ``values[i]`` at row ``rows[i]`` (ids distinct)."""

    @abc.abstractmethod
    def flush(self, start: int, stop: int) -> None:
        """Make rows ``[start, stop)`` durable (returns after they reached the disk)."""

    def release(self) -> None:
        """Drop this process's mapped pages (the data stays); no-op when nothing is mapped."""

    def allocate(self, start: int, stop: int) -> None:
        """Reserve the storage under rows ``[start, stop)`` before they are written
        (``OSError(ENOSPC)`` when there is none), where writing into a hole could
        fail later without an error to raise (a store through a map); else no-op."""

    def discard(self, start: int, stop: int) -> None:
        """Give back the storage under rows ``[start, stop)``, whose values are no longer
        needed (they may read as zeros afterwards); a no-op where the backend cannot."""

    def drop_cache(self, start: int, stop: int) -> None:
        """Write rows ``[start, stop)`` behind and drop them from the page cache, when
        the backend has one; nothing is lost either way."""

    def mapped(self) -> np.ndarray | None:
        """The rows as a numpy array over the backend's bytes (changed in place), if any."""
        return None

    def close(self) -> None:
        """Release file handles; the object is unusable afterwards."""
