"""Read-only raw columns whose chunks are filled on first read.

A published store's done flags are a byte a row of capacity (1e10 rows: 20 GB for the
two), so a remote reader does not fetch them whole at open: its mirror holds them as a
sparse file of the full length, one byte a chunk in a *present* file says which chunks
hold their bytes, and :class:`FilledArray` asks its ``fill`` (``mmbuffer.remote``) for
the chunks a read needs that are not there yet. ``fill`` writes them into the file
(every process of the host maps the same one) and then marks them present; a read never
returns a row of a chunk not marked. :meth:`mapped` is None, so every read of the rows
goes through :meth:`read` / :meth:`read_range`.

>>> import tempfile, numpy as np
>>> from pathlib import Path
>>> from mmbuffer._disk import format as fmt
>>> from mmbuffer._disk.columns.raw import RawArray
>>> root = Path(tempfile.mkdtemp())
>>> fmt.create_raw(root, "x", 8, (), np.dtype("uint8"))
>>> writer = RawArray.open(root, "x", writable=True)
>>> present, asked = np.zeros(4, np.uint8), []
>>> def fill(chunks):  # what mmbuffer.remote does with the published chunks
...     asked.extend(chunks.tolist())
...     for k in chunks.tolist():
...         writer.write_range(2 * k, np.full(2, k + 1, np.uint8)); present[k] = 1
>>> col = FilledArray(RawArray.open(root, "x", writable=False), present, 2, fill)
>>> col.read(np.array([5, 0, 4])).tolist(), col.read_range(4, 6).tolist(), asked
([3, 1, 3], [3, 3], [0, 2])
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .base import ColumnArray
from .raw import RawArray


class FilledArray(ColumnArray):
    """``raw`` (mapped read-only) whose chunks of ``chunk_rows`` rows are readable where
    ``present`` (uint8, a chunk each, shared) is nonzero; ``fill(chunks)`` makes those
    chunks present (sorted, distinct, not present when asked)."""

    def __init__(self, raw: RawArray, present: np.ndarray, chunk_rows: int, fill: Callable[[np.ndarray], None]) -> None:
        self._raw, self._present, self._chunk_rows, self._fill = raw, present, chunk_rows, fill
        self.shape, self.dtype = raw.shape, raw.dtype
        self._whole = self._all_present()  # then a read checks nothing

    def _all_present(self) -> bool:
        return bool(np.count_nonzero(self._present) == len(self._present))

    def _ensure(self, chunks: np.ndarray) -> None:
        have = self._present[chunks]
        if np.count_nonzero(have) != len(have):
            self._fill(np.unique(chunks[have == 0]))
            self._whole = self._all_present()

    def read(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows)
        if not self._whole:
            self._ensure(rows.reshape(-1) // self._chunk_rows)
        return self._raw.read(rows)

    def ahead(self, rows: np.ndarray) -> None:
        """The chunks of ``rows`` filled now, with the batch's other columns' fetches in flight."""
        if not self._whole:
            self._ensure(np.asarray(rows).reshape(-1) // self._chunk_rows)

    def read_range(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        if stop > start and not self._whole:
            self._ensure(np.arange(start // self._chunk_rows, (stop - 1) // self._chunk_rows + 1))
        return self._raw.read_range(start, stop, out)

    def write_range(self, start: int, values: np.ndarray) -> None:
        self._raw.write_range(start, values)  # refused: mapped read-only

    def write_at(self, rows: np.ndarray, values: np.ndarray) -> None:
        self._raw.write_at(rows, values)  # refused: mapped read-only

    def flush(self, start: int, stop: int) -> None:
        """Nothing to make durable: the array is read-only."""

    def release(self) -> None:
        self._raw.release()

    def close(self) -> None:
        self._raw.close()
