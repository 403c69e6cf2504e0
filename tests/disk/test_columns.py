"""The local column backends against the conformance suite (``tests/column_conformance.py``,
zarr's ``StoreTests`` is the model): raw, zstd and lz4. The remote backend's subclass is
``TestRemoteArray`` in tests/remote/test_remote.py, beside the S3 server it needs."""

from __future__ import annotations

import numpy as np
from column_conformance import ROWS, ColumnTests

from mmbuffer._disk import format as fmt
from mmbuffer._disk.columns import RawArray, ZarrArray


class TestRawArray(ColumnTests):
    compressed = False

    def create(self, root, name, row_shape, dtype):
        fmt.create_raw(root, name, ROWS, row_shape, np.dtype(dtype))

    def test_is_raw(self, col):
        assert isinstance(col, RawArray) and col.mapped() is not None

    def test_allocate_reserves_the_blocks(self, tmp_path, col):
        """A sparse shard file gets its blocks before a store through the map needs them."""
        import os

        shard = tmp_path.joinpath("c", "c", *(["0"] * len(col.shape)))
        before = os.stat(shard).st_blocks
        col.allocate(0, ROWS)
        assert os.stat(shard).st_blocks * 512 >= before * 512 + col.mapped().nbytes - 8192


class TestZarrArrayZstd(ColumnTests):
    compressed = True

    def create(self, root, name, row_shape, dtype):
        fmt.create_compressed(root, name, ROWS, row_shape, np.dtype(dtype), "zstd")

    def test_is_compressed(self, col):
        assert isinstance(col, ZarrArray) and col.mapped() is None


class TestZarrArrayLz4(TestZarrArrayZstd):
    def create(self, root, name, row_shape, dtype):
        fmt.create_compressed(root, name, ROWS, row_shape, np.dtype(dtype), "lz4")
