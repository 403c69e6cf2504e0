"""Raw columns: a memory-mapped single-shard Zarr array, large writes with ``pwrite``.

>>> import tempfile, numpy as np
>>> from pathlib import Path
>>> from mmbuffer._disk import format as fmt
>>> root = Path(tempfile.mkdtemp())
>>> fmt.create_raw(root, "x", 8, (2,), np.dtype("float32"))
>>> col = RawArray.open(root, "x", writable=True)
>>> col.write_range(6, np.ones((3, 2), "float32")[:2]); col.read(np.array([5, 6])).tolist()
[[0.0, 0.0], [1.0, 1.0]]
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ... import errors
from .. import files as _files, rawio as _rawio
from .. import format as fmt
from .base import ColumnArray


class RawArray(ColumnArray):
    """A mapped array and the descriptor it was mapped from (pwrite, pread, fadvise)."""

    def __init__(self, mm: np.ndarray, fd: int | None, where: Path | None = None, private: bool = False) -> None:
        self._mm = mm
        self._fd = fd
        self._where = where  # the shard file, named in errors
        self.private = private  # mapped copy-on-write: stores reach the file only by write_private
        self.shape = tuple(mm.shape)
        self.dtype = mm.dtype

    @classmethod
    def open(
        cls, root: Path, name: str, *, writable: bool, expect: fmt.Expect | None = None, private: bool = False
    ) -> RawArray:
        """Map ``root/name``; ``private=True`` copy-on-write (``rawio.open_raw_fd``)."""
        mm, fd = _rawio.open_raw_fd(root, name, writable=writable, expect=expect, private=private)
        return cls(mm, fd, root.joinpath(name, "c", *(["0"] * mm.ndim)), private)

    def read(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(self._mm[rows])

    def read_range(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.empty((stop - start, *self.row_shape), dtype=self.dtype)
        if self._fd is None:
            out[...] = self._mm[start:stop]
        else:
            _rawio.read_rows(self._fd, self._mm, start, out)
        return out

    def write_range(self, start: int, values: np.ndarray) -> None:
        if not self._mm.flags.writeable:
            self.refuse_write(self._where or "raw array", "write_range")
        if self._fd is None:
            self._mm[start : start + len(values)] = values
        else:
            _rawio.write_rows(self._fd, self._mm, start, values)

    def write_at(self, rows: np.ndarray, values: np.ndarray) -> None:
        if not self._mm.flags.writeable:
            self.refuse_write(self._where or "raw array", "write_at")
        self._mm[rows] = values

    def flush(self, start: int, stop: int) -> None:
        _rawio.flush_rows(self._mm, start, stop)

    def allocate(self, start: int, stop: int) -> None:
        """``posix_fallocate`` the blocks under the rows (``_files.reserve_rows``)."""
        if self._fd is None:
            return
        try:
            _files.reserve_rows(self._fd, self._mm.strides[0], start, stop)
        except OSError as exc:  # name the file: posix_fallocate's error does not
            raise OSError(exc.errno, exc.strerror, str(self._where)) from None

    def discard(self, start: int, stop: int) -> None:
        """Punch a hole under the rows (``_files.free_rows``): blocks wholly inside go back."""
        if self._fd is None or not self._mm.flags.writeable:
            return
        _files.free_rows(self._fd, self._mm.strides[0], start, stop)

    def release(self) -> None:
        if not self.private:  # a private map's pages may hold what is not in the file yet
            _rawio.release(self._mm)

    def write_private(self, candidates: np.ndarray) -> np.ndarray:
        """Write the pages among ``candidates`` (sorted page numbers) that this copy-on-write
        map changed to the file, fdatasync it; return the page numbers written.

        The private copies stay: a later store into them takes no page fault."""
        if not self.private:
            return candidates[:0]
        if self._fd is None:  # closed: what the private map holds cannot reach the file
            raise errors.ReadOnlyError(f"{self._where}: write_private: expected an open array, got a closed one")
        pages = _rawio.private_pages(self._mm, candidates)
        if len(pages):
            try:
                _rawio.write_private(self._fd, self._mm, pages)
                os.fdatasync(self._fd)
            except OSError as exc:  # name the file: pwrite's error does not
                raise OSError(exc.errno, exc.strerror, str(self._where)) from None
        return pages

    def drop_private(self) -> None:
        """Drop the copy-on-write map's private pages (written by ``write_private`` first)."""
        if self.private:
            _rawio.drop_private(self._mm)

    def drop_cache(self, start: int, stop: int) -> None:
        if self._fd is not None:
            _rawio.drop_cache(self._fd, self._mm, start, stop)

    def mapped(self) -> np.ndarray:
        return self._mm

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
