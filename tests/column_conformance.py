"""The conformance suite every column backend passes (zarr's ``testing/store.py`` is the model).

``ColumnTests`` holds the behaviour every :class:`mmbuffer._disk.columns.ColumnArray` must
have, checked against an independent oracle (zarr-python writing and reading the same
files); each backend subclasses it once, saying how to create and open its arrays
(``tests/disk/test_columns.py``: raw, zstd, lz4; ``tests/remote/test_remote.py``: remote).
Not a test module itself: it lives beside ``conftest.py`` so every folder can import it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mmbuffer._disk.columns import ColumnArray, open_array

ROWS = 1000  # not a power of two: partial last chunk


class ColumnTests:
    compressed: bool

    def create(self, root: Path, name: str, row_shape: tuple[int, ...], dtype: str) -> None:
        raise NotImplementedError

    def open(self, root: Path, name: str, *, writable: bool, expect) -> ColumnArray:
        return open_array(root, name, compressed=self.compressed, writable=writable, expect=expect)

    def zarr_array(self, root: Path, name: str, mode: str):
        """The same array opened by zarr-python itself: the oracle the backend is checked against."""
        import zarr

        return zarr.open_array(str(root / name), mode=mode)

    @pytest.fixture(params=[((), "int64"), ((3,), "float32"), ((2, 5), "uint8"), ((), "bool")])
    def spec(self, request):
        return request.param

    @pytest.fixture
    def col(self, tmp_path, spec):
        row_shape, dtype = spec
        self.create(tmp_path, "c", row_shape, dtype)
        return self.open(tmp_path, "c", writable=True, expect=(ROWS, row_shape, np.dtype(dtype)))

    @staticmethod
    def values(col: ColumnArray, n: int, seed: int = 0) -> np.ndarray:
        rng = np.random.default_rng(seed)
        return (rng.integers(0, 200, size=(n, *col.row_shape)) % (2 if col.dtype == bool else 200)).astype(col.dtype)

    # -- an independent oracle: the Zarr world writes and reads the same files -----------
    def test_rows_written_by_zarr_read_back_through_the_backend(self, tmp_path, spec):
        """zarr-python writes the array's files (not mmbuffer's code); the backend, opened
        afterwards, reads exactly those rows."""
        row_shape, dtype = spec
        self.create(tmp_path, "z", row_shape, dtype)
        rng = np.random.default_rng(7)
        v = (rng.integers(0, 200, size=(123, *row_shape)) % (2 if dtype == "bool" else 200)).astype(dtype)
        self.zarr_array(tmp_path, "z", "r+")[400:523] = v
        col = self.open(tmp_path, "z", writable=False, expect=(ROWS, row_shape, np.dtype(dtype)))
        np.testing.assert_array_equal(col.read_range(400, 523), v)
        np.testing.assert_array_equal(col.read(np.array([522, 400, 460])), v[[122, 0, 60]])
        assert not col.read_range(0, 400).any() and not col.read_range(523, ROWS).any()

    def test_rows_written_by_the_backend_read_back_through_zarr(self, tmp_path, col, spec):
        v = self.values(col, 200, seed=3)
        col.write_range(17, v)
        col.flush(17, 217)
        col.close()
        got = self.zarr_array(tmp_path, "c", "r")[:]
        np.testing.assert_array_equal(got[17:217], v)
        assert not got[:17].any() and not got[217:].any()

    def test_writes_to_a_read_only_array_are_refused_typed_and_change_nothing(self, tmp_path, col, spec):
        import mmbuffer as mb

        v = self.values(col, 10, seed=4)
        col.write_range(0, v)
        col.flush(0, 10)
        ro = self.open(tmp_path, "c", writable=False, expect=(ROWS, spec[0], np.dtype(spec[1])))
        with pytest.raises(mb.errors.ReadOnlyError, match="write_range.*read-only"):
            ro.write_range(0, np.zeros_like(v))
        with pytest.raises(mb.errors.ReadOnlyError, match="write_at.*read-only"):
            ro.write_at(np.array([1, 2]), np.zeros_like(v[:2]))
        np.testing.assert_array_equal(self.open(tmp_path, "c", writable=False, expect=(ROWS, spec[0], np.dtype(spec[1])))
                                      .read_range(0, 10), v)

    def test_shape_and_dtype(self, col, spec):
        assert col.shape == (ROWS, *spec[0]) and col.dtype == np.dtype(spec[1]) and len(col) == ROWS

    def test_unwritten_rows_read_as_zero(self, col):
        assert not col.read(np.array([0, 500, ROWS - 1])).any()

    def test_write_range_then_read_and_read_range(self, col):
        v = self.values(col, 300)
        col.write_range(650, v)
        np.testing.assert_array_equal(col.read_range(650, 950), v)
        rows = np.array([[700, 651], [949, 650]])
        got = col.read(rows)
        assert got.shape == rows.shape + col.row_shape
        np.testing.assert_array_equal(got, v[rows - 650])
        out = np.empty((100, *col.row_shape), col.dtype)
        assert col.read_range(700, 800, out=out) is out
        np.testing.assert_array_equal(out, v[50:150])
        assert not col.read_range(950, ROWS).any()  # past the write: untouched

    def test_write_at_scattered_rows(self, col):
        rows = np.array([999, 3, 512, 64])
        v = self.values(col, 4, seed=1)
        col.write_at(rows, v)
        np.testing.assert_array_equal(col.read(rows), v)
        assert not col.read(np.array([0, 2, 4, 998])).any()

    def test_flushed_rows_survive_reopen(self, tmp_path, col, spec):
        v = self.values(col, 77, seed=2)
        col.write_range(ROWS - 77, v)
        col.flush(ROWS - 77, ROWS)
        col.release()
        col.close()
        again = self.open(tmp_path, "c", writable=False, expect=(ROWS, spec[0], np.dtype(spec[1])))
        np.testing.assert_array_equal(again.read_range(ROWS - 77, ROWS), v)
        np.testing.assert_array_equal(again.read(np.arange(ROWS - 77, ROWS)), v)

    def test_release_and_drop_cache_lose_nothing(self, col):
        v = self.values(col, 10, seed=3)
        col.write_range(0, v)
        col.drop_cache(0, 10)
        col.release()
        np.testing.assert_array_equal(col.read_range(0, 10), v)

    def test_allocate_keeps_the_data(self, col):
        v = self.values(col, 20, seed=5)
        col.write_range(100, v)
        col.allocate(0, ROWS)
        np.testing.assert_array_equal(col.read_range(100, 120), v)
        assert not col.read_range(0, 100).any()

    def test_mapped_view_is_the_data(self, col):
        view = col.mapped()
        if view is None:  # a backend without a mapping: the store keeps index and tree elsewhere
            assert self.compressed
            return
        v = self.values(col, 5, seed=4)
        view[10:15] = v
        np.testing.assert_array_equal(col.read_range(10, 15), v)

    def test_metadata_mismatch_is_refused(self, tmp_path, col, spec):
        from mmbuffer import errors

        with pytest.raises(errors.CorruptStoreError):
            self.open(tmp_path, "c", writable=False, expect=(ROWS + 1, spec[0], np.dtype(spec[1])))
