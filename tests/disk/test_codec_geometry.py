"""How a codec column's chunks follow its lane size (README, "Design in one page"):
chunks and shards never straddle a lane, so a lane (``capacity // num_streams``)
that is a multiple of 8 rows keeps 84x84 frames in 8-frame chunks, and a lane of a
prime number of rows leaves one-row chunks and one shard file per row, and ``create``
warns about it, naming the column and the lane size."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import mmbuffer as mb


def geometry(path):
    meta = json.loads((path / "columns" / "pixels" / "zarr.json").read_text())
    shard = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
    inner = meta["codecs"][0]["configuration"]["chunk_shape"][0]
    return inner, shard


@pytest.mark.parametrize("capacity, streams, want", [(100_000, 1, (8, 400)), (4 * 1024, 4, (8, 512)),
                                                     (100_003, 1, (1, 1))])
def test_chunks_follow_the_lane_size(tmp_path, capacity, streams, want):
    path = tmp_path / "s"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf = mb.create(path, {"pixels": mb.Column((84, 84), "uint8", codec="zstd")}, capacity=capacity,
                        num_streams=streams)
    said = [str(w.message) for w in caught]
    if want[0] == 1:  # one-row chunks: said once, where the user called create
        assert len(said) == 1 and "'pixels'" in said[0] and f"lanes of {capacity // streams} rows" in said[0]
        assert caught[0].filename == __file__
    else:
        assert said == []
    with buf:
        z = np.zeros(3, bool)
        buf.extend({"pixels": np.ones((3, 84, 84), np.uint8), "terminated": z, "truncated": z})
        buf.commit()
    assert geometry(path) == want
    shards = [f for f in (path / "columns" / "pixels").rglob("*") if f.is_file() and f.name != "zarr.json"]
    # one-row shards: each row its own file at once; 400- and 512-row shards: none complete yet
    assert len(shards) == (3 if want[1] == 1 else 0)
    with mb.open(path, mode="r") as buf:
        assert buf.view().written.sum() == 3
