"""Resumable ``BufferDataset`` over a store published to a real S3 server on loopback (moto).

Random mode samples from the chunk pool, whose blocks rotate with the draws: a resumed
pass must start the pool at the draw it stopped at (same blocks), and continue bit for
bit. Epoch mode reads exactly; a resumed epoch on a newer published snapshot serves the
items of the snapshot it started on; one whose items the newer snapshot lost is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from s3server import new_bucket
from s3server import s3, small_chunks  # noqa: F401 - fixtures

import mmbuffer as mb
from mmbuffer import errors

pytest.importorskip("s3fs")
from mmbuffer.remote import PoolConfig

SMALL = PoolConfig(blocks=2, block_bytes=1, rotate_every=2, prefetch=1)  # a block = one chunk of 128 rows
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")



def _extend(buf: mb.Buffer, first: int, rows: int, stream: int = 0) -> None:
    x = np.arange(first, first + rows)
    done = x % 25 == 24
    buf.extend({"x": x, "obs": np.stack([x, -x], 1).astype("float32"), "terminated": done}, stream=stream,
               final_obs={"obs": np.zeros((int(done.sum()), 2))})


def _publish(tmp_path: Path, url: str, rows: int = 2000, capacity: int = 4096) -> Path:
    local = tmp_path / "local"
    with mb.create(local, {"x": ((), "int64"), "obs": ((2,), "float32")}, capacity=capacity) as buf:
        _extend(buf, 0, rows)
    mb.convert.copy(local, url, compression="zstd", progress=False)
    return local


def _equal(a: list[mb.Batch], b: list[mb.Batch]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.indices, y.indices) and all(torch.equal(x.data[k], y.data[k]) for k in x.data) for x, y in zip(a, b))


def test_random_pass_resumes_bit_identically_from_the_pool(tmp_path, s3):
    url = f"s3://{new_bucket(s3)}/store"
    _publish(tmp_path, url)

    def dataset():
        return mb.data.BufferDataset(url, 16, 4, num_batches=12, seed=1, cache_dir=tmp_path / "cache", pool=SMALL)

    full = list(dataset())
    assert all(torch.equal(b["x"], b.indices) for b in full)  # the rows themselves, not zeros
    ds = dataset()
    it = iter(ds)
    head = [next(it) for _ in range(7)]  # past 3 rotations of the pool's blocks
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["snapshot"] == ds._open().remote.snapshot and state["generation"] == 1
    del it
    resumed = dataset()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert _equal(head + rest, full)
    blocks = resumed._open().remote.pool.block_rows
    assert len({int(b) for x in full for b in (x.indices // blocks).unique()}) > 2  # the pool did rotate


def test_stateful_dataloader_two_ranks_two_workers_over_s3(tmp_path, s3):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    url = f"s3://{new_bucket(s3)}/store"
    _publish(tmp_path, url)
    blocks: dict[int, set[int]] = {}
    for rank in range(2):
        def loader(rank=rank, seed=0):
            ds = mb.data.BufferDataset(url, 16, num_batches=10, seed=4, rank=rank, world_size=2,
                                       cache_dir=tmp_path / "cache", pool=SMALL)
            torch.manual_seed(seed)
            return sdl.StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")

        full = list(loader())
        first = loader()
        head = []
        for b in first:
            head.append(b)
            if len(head) == 4:
                state = json.loads(json.dumps(first.state_dict()))
                break
        del first
        again = loader(seed=1)
        again.load_state_dict(state)
        assert _equal(head + list(again), full)
        for i, b in enumerate(full):  # batch i from worker i % 2
            blocks.setdefault(rank * 2 + i % 2, set()).update((b.indices // 128).tolist())
    assert len(blocks) == 4
    for a in range(4):
        for b in range(a + 1, 4):
            assert not blocks[a] & blocks[b], (a, b)  # every (rank, worker) its own blocks


def test_epoch_resumes_on_a_newer_published_snapshot(tmp_path, s3):
    url = f"s3://{new_bucket(s3)}/store"
    local = _publish(tmp_path, url, rows=700)

    def dataset(name="e"):
        return mb.data.BufferDataset(url, 32, epoch=True, seed=6, name=name, cache_dir=tmp_path / "cache", pool=None)

    full = list(dataset("reference"))
    assert sorted(int(v) for b in full for v in b["x"]) == list(range(700))
    ds = dataset()
    it = iter(ds)
    head = [next(it) for _ in range(5)]
    state = ds.state_dict()
    del it
    with mb.open(local) as w:
        _extend(w, 700, 300)
    assert mb.convert.copy(local, url, compression="zstd", progress=False)["sequence"] == 2
    resumed = dataset()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert resumed._open().remote.sequence == 2  # iterated on the newer snapshot
    assert _equal(head + rest, full)  # the items of the snapshot the epoch started on
    assert sorted(int(v) for b in resumed for v in b["x"]) == list(range(1000))  # the next epoch: all of them


def test_epoch_state_whose_items_a_newer_snapshot_lost_is_refused(tmp_path, s3):
    url = f"s3://{new_bucket(s3)}/store"
    local = _publish(tmp_path, url, rows=400, capacity=512)
    ds = mb.data.BufferDataset(url, 32, epoch=True, cache_dir=tmp_path / "cache", pool=None)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    del it
    with mb.open(local) as w:  # the ring wraps: the oldest episodes go
        _extend(w, 400, 200)
    mb.convert.copy(local, url, compression="zstd", progress=False)
    resumed = mb.data.BufferDataset(url, 32, epoch=True, cache_dir=tmp_path / "cache", pool=None)
    with mb.open(url, mode="r", cache_dir=tmp_path / "cache", pool=None) as ro:
        # a publish keeps the local rows: the newer snapshot begins at the oldest live episode
        assert ro.view().first_starts.tolist() == [100] and int(ro.get(np.array([100]))["x"][0]) == 100
    resumed.load_state_dict(state)
    with pytest.raises(errors.RowNotLiveError, match="stream 0: expected the epoch's 400 items from row 0"):
        list(resumed)
    resumed.load_state_dict({**state, "generation": 7})  # a state from a later publish than any here
    with pytest.raises(errors.RowNotLiveError, match="generation 7"):
        list(resumed)
    mb.convert.copy(local, url, compression="zstd", progress=False, capacity=1024)  # another geometry: rows from 0
    with mb.open(url, mode="r", cache_dir=tmp_path / "cache", pool=None) as ro:
        # row 0 is there, with 500 items, but it holds what was row 100
        assert ro.view().first_starts.tolist() == [0] and int(ro.get(np.array([0]))["x"][0]) == 100
    resumed = mb.data.BufferDataset(url, 32, epoch=True, cache_dir=tmp_path / "cache", pool=None)
    resumed.load_state_dict(state)
    with pytest.raises(errors.RowNotLiveError, match="stream 0: expected the data fingerprinted"):
        list(resumed)
