"""Stores on object storage, against a real S3-compatible server on loopback (moto).

URLs are never local paths; publish (``mb.convert.copy(store, url)``), open, sample
from the chunk pool or exactly, DataLoader workers x ranks reading disjoint blocks,
snapshot pinning and refresh, and the column conformance suite on ``RemoteArray``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer._disk import format as fmt
from mmbuffer import errors
from s3server import moto_s3, new_bucket, table_objects
from column_conformance import ROWS, ColumnTests

pytest.importorskip("s3fs")
from mmbuffer._disk.columns.remote import RemoteArray  # noqa: E402
from mmbuffer.remote import PoolConfig, RemoteSource  # noqa: E402

SMALL = PoolConfig(blocks=2, block_bytes=1, rotate_every=2, prefetch=1)  # block = one chunk


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture
def bucket(s3):
    return new_bucket(s3)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 1 KiB (128 rows of ``x``), so a small store has many blocks."""
    import dataclasses

    monkeypatch.setattr(fmt, "config", dataclasses.replace(fmt.config, chunk_bytes=1024))


def make_store(path: Path, episodes: int = 40, length: int = 25, *, streams: int = 2, seed: int = 0,
               priorities: bool = False) -> mb.Buffer:
    """A store with distinct values per row (``x`` = a global step counter)."""
    rng = np.random.default_rng(seed)
    buf = mb.create(path, {"obs": ((3,), "float32"), "x": ((), "int64")}, capacity=4096, num_streams=streams,
                    priorities=mb.PriorityConfig() if priorities else None)
    step = 0
    for e in range(episodes):
        t = np.arange(step, step + length)
        buf.extend({"obs": rng.random((length, 3)), "x": t, "terminated": t == t[-1]}, stream=e % streams,
                   final_obs={"obs": -np.ones((1, 3))})
        step += length
    buf.commit()
    return buf


def publish(tmp_path: Path, url: str, **kw) -> mb.Buffer:
    local = make_store(tmp_path / "local", **kw)
    local.close()
    mb.convert.copy(tmp_path / "local", url, compression="zstd", progress=False)
    return mb.open(tmp_path / "local", mode="r")


def same_as_local(local: mb.Buffer, batch: mb.Batch) -> None:
    want = local.get(batch.indices, keys=["obs", "x", "next_obs"])
    for k, v in want.items():
        torch.testing.assert_close(batch.data[k], v, rtol=0, atol=0)


# -- 1. URLs are never local paths --------------------------------------------------------------
def test_a_url_is_never_taken_for_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(errors.InvalidArgumentError, match="path: expected a local path.*s3://bucket/x"):
        mb.create("s3://bucket/x", {"x": ((), "int64")}, capacity=8)
    with pytest.raises(errors.InvalidArgumentError, match="mode: expected 'r'"):
        mb.open("s3://bucket/x", mode="a")
    src = tmp_path / "d.npz"
    np.savez(src, observations=np.zeros((4, 2), "float32"), actions=np.zeros((4, 1), "float32"),
             rewards=np.zeros(4, "float32"), terminals=np.array([0, 0, 0, 1], bool), timeouts=np.zeros(4, bool),
             next_observations=np.zeros((4, 2), "float32"))
    with pytest.raises(errors.InvalidArgumentError, match="dst: expected a local path"):
        mb.convert.convert("npz", src, "gs://bucket/y", progress=False)
    with pytest.raises(errors.InvalidArgumentError, match="they are for URLs"):
        mb.open(tmp_path, mode="r", storage_options={"anon": True})
    ds = mb.data.BufferDataset("s3://bucket/prefix/store", 4)
    assert ds.path == "s3://bucket/prefix/store"  # not collapsed to 's3:/bucket/...'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npz"]  # no folder named 's3:' or 'gs:'


# -- 2. publish, open, sample ---------------------------------------------------------------------
def test_publish_open_and_sample_exactly_and_from_the_pool(tmp_path, bucket):
    url = f"s3://{bucket}/prefix/store"
    local = publish(tmp_path, url, priorities=True)
    exact = mb.open(url, mode="r", cache_dir=tmp_path / "cache", pool=None)
    assert isinstance(exact.remote, RemoteSource) and exact.remote.pool is None
    assert (len(exact), exact.num_episodes, exact.columns) == (len(local), local.num_episodes, local.columns)
    rows = np.array([0, 5, 2048 + 7, 999])
    for k, v in local.get(rows).items():
        torch.testing.assert_close(exact.get(rows)[k], v, rtol=0, atol=0)
    g = torch.Generator().manual_seed(0)
    same_as_local(local, exact.sample(64, g))
    same_as_local(local, exact.sample_slices(8, 10, generator=g))
    np.testing.assert_array_equal(exact.leaf_priorities(np.arange(100)), local.leaf_priorities(np.arange(100)))
    pooled = mb.open(url, mode="r", cache_dir=tmp_path / "cache", pool=SMALL)
    pool = pooled.remote.pool
    b = pooled.sample(64, g)
    same_as_local(local, b)
    held = set(pool.held_blocks())
    assert len(held) == 2 and set((b.indices // pool.block_rows).tolist()) <= held
    s = pooled.sample_slices(8, 10, generator=g, prioritized=True)
    same_as_local(local, s)
    assert set((s.indices // pool.block_rows).reshape(-1).tolist()) <= set(pool.held_blocks())
    exact.close(), pooled.close(), local.close()


def test_a_snapshot_ships_only_the_final_observations_of_its_episodes(tmp_path, bucket, s3):
    """The final observations of a published snapshot are compressed chunks of the used
    slots (one per episode), not a capacity-sized array; a reader gets them back exact."""
    import fsspec

    url = f"s3://{bucket}/finals"
    local = publish(tmp_path, url, episodes=6)  # 6 episodes in a store of 4096 rows
    fs = fsspec.filesystem("s3", endpoint_url=s3)
    objects = fs.find(f"{bucket}/finals/snapshots", detail=True)
    shipped = sum(info["size"] for path, info in objects.items() if "/final/obs/c/" in path)
    dense = 4096 * 3 * 4  # a capacity-sized array of float32 [3] rows
    assert 0 < shipped <= 2 * 1024  # the chunks (1 KiB of rows each, see small_chunks) of 6 slots
    assert shipped < dense / 20
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        starts, lengths = ro.episodes()
        last = (starts + lengths - 1).numpy()
        assert ro.get(last, ["next_obs"])["next_obs"].numpy().tolist() == [[-1.0, -1.0, -1.0]] * 6
        rows = np.arange(len(local))
        same = local.get(rows, ["next_obs"])["next_obs"]
        torch.testing.assert_close(ro.get(rows, ["next_obs"])["next_obs"], same, rtol=0, atol=0)
    local.close()


def test_pool_rotation_is_deterministic_and_shards_cover_an_epoch_disjointly(tmp_path, bucket):
    url = f"s3://{bucket}/store"
    publish(tmp_path, url).close()
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=SMALL) as buf:
        pool = buf.remote.pool
        live = set(pool.live.tolist())
        assert len(live) >= 8
        shards = [set(pool.order(3)[i::1].tolist()) for i in range(1)]
        parts = []
        for i in range(3):
            buf.remote.set_shard(i, 3, epoch=3)
            parts.append(pool.order(3).tolist())
        assert sorted(sum(parts, [])) == sorted(live)  # disjoint, and together every block once
        assert shards[0] == live
        buf.remote.set_shard(1, 3, epoch=3)
        seen, draws = [], []
        for _ in range(12):
            draws.append(buf.sample(16, torch.Generator().manual_seed(1)).indices)
            seen.append(tuple(pool.held_blocks()))
        later = set(np.concatenate([pool.order(e) for e in range(3, 3 + 12)]).tolist())
        assert set(sum(map(list, seen), [])) <= later  # only this shard's blocks, epoch after epoch
        assert seen[0] == tuple(parts[1][:2]) and seen[2] == tuple(parts[1][1:3])  # one block out, the next in
        buf.remote.set_shard(1, 3, epoch=3)
        again = [buf.sample(16, torch.Generator().manual_seed(1)).indices for _ in range(12)]
        assert all(torch.equal(a, b) for a, b in zip(draws, again))
        assert pool.fetched_bytes > 0


def test_dataloader_two_workers_two_ranks_read_disjoint_blocks(tmp_path, bucket):
    url = f"s3://{bucket}/store"
    local = publish(tmp_path, url)
    per_shard = {}
    for rank in range(2):
        ds = mb.data.BufferDataset(url, 16, num_batches=8, rank=rank, world_size=2, seed=5,
                                   cache_dir=tmp_path / "cache", pool=SMALL)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
        with mb.open(url, mode="r", cache_dir=tmp_path / "cache", pool=SMALL) as probe:
            block_rows = probe.remote.pool.block_rows
        for i, batch in enumerate(loader):  # in order: batch i comes from worker i % 2
            same_as_local(local, batch)
            per_shard.setdefault(rank * 2 + i % 2, set()).update((batch.indices // block_rows).tolist())
    assert len(per_shard) == 4
    for a in range(4):
        for b in range(a + 1, 4):
            assert not per_shard[a] & per_shard[b], (a, b)
    local.close()


# -- snapshots --------------------------------------------------------------------------------------
def test_readers_keep_their_snapshot_until_refresh(tmp_path, bucket):
    url = f"s3://{bucket}/store"
    publish(tmp_path, url, episodes=10).close()
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    first = ro.remote.snapshot
    with mb.open(tmp_path / "local") as w:  # the writer goes on, and publishes again
        w.extend({"obs": np.ones((30, 3)), "x": np.arange(30) + 10_000, "terminated": np.arange(30) == 29},
                 final_obs={"obs": np.zeros((1, 3))})
    mb.convert.copy(tmp_path / "local", url, progress=False)
    assert ro.num_episodes == 10 and ro.remote.snapshot == first
    assert ro.sample(32).data["x"].max() < 10_000  # still the pinned snapshot
    assert ro.refresh() is True and ro.refresh() is False
    assert ro.num_episodes == 11 and ro.remote.snapshot != first
    with mb.open(tmp_path / "local", mode="r") as local:
        rows = np.flatnonzero(np.isin(np.arange(4096), np.arange(0, 4096)))[:4096]
        torch.testing.assert_close(ro.get(rows)["x"], local.get(rows)["x"], rtol=0, atol=0)
    ro.close()


def test_a_pruned_snapshot_raises_instead_of_reading_zeros(tmp_path, bucket):
    url = f"s3://{bucket}/store"
    publish(tmp_path, url, episodes=10).close()
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    from mmbuffer.convert import publish as publish_to

    publish_to(tmp_path / "local", url, keep=1, progress=False)
    with pytest.raises(errors.StoreNotFoundError, match="removed by a newer publish"):
        ro.get(np.arange(10))
    assert ro.refresh() and ro.get(np.arange(3))["x"].tolist() == [0, 1, 2]
    ro.close()


def test_copy_back_and_the_cli(tmp_path, bucket):
    url = f"s3://{bucket}/a/b"
    local = make_store(tmp_path / "local", episodes=6)
    local.close()
    from mmbuffer._cli.main import main

    assert main(["copy", str(tmp_path / "local"), url, "--compression", "zstd"]) == 0
    mb.convert.copy(url, tmp_path / "back", progress=False)
    with mb.open(tmp_path / "back", mode="r") as back, mb.open(tmp_path / "local", mode="r") as src:
        assert back.compression is None and back.num_episodes == src.num_episodes == 6
        for k, v in src.get(np.arange(len(src) // 2)).items():
            torch.testing.assert_close(back.get(np.arange(len(src) // 2))[k], v, rtol=0, atol=0)


def test_publishing_refuses_a_prefix_it_did_not_write(tmp_path, bucket, s3):
    import fsspec

    fs = fsspec.filesystem("s3", endpoint_url=s3)
    fs.pipe(f"{bucket}/theirs/data.csv", b"a,b\n")
    make_store(tmp_path / "local", episodes=2).close()
    with pytest.raises(errors.StoreExistsError, match="other objects"):
        mb.convert.copy(tmp_path / "local", f"s3://{bucket}/theirs", progress=False)
    assert fs.find(f"{bucket}/theirs") == [f"{bucket}/theirs/data.csv"]


@pytest.mark.parametrize("pointer, match", [
    (b'{"format": "mmbuffer-remote", "snapshot": "../../etc", "sequence": 1}', "snapshot: expected an id"),
    (b"not json", "not valid JSON"),
    (b'{"format": "other"}', "format: expected"),
])
def test_a_hostile_pointer_is_a_typed_error(tmp_path, bucket, s3, pointer, match):
    import fsspec

    fsspec.filesystem("s3", endpoint_url=s3).pipe(f"{bucket}/h/current.json", pointer)
    with pytest.raises(errors.CorruptStoreError, match=match):
        mb.open(f"s3://{bucket}/h", mode="r", cache_dir=tmp_path)
    assert not any(tmp_path.rglob("*.json"))


def test_storage_options_are_used_as_given(tmp_path, bucket, s3, monkeypatch):
    url = f"s3://{bucket}/store"
    publish(tmp_path, url, episodes=4).close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", storage_options={"endpoint_url": s3}) as ro:
        assert ro.num_episodes == 4


# -- the column conformance suite on RemoteArray ---------------------------------------------------
class TestRemoteArray(ColumnTests):
    compressed = True

    @pytest.fixture(autouse=True)
    def server(self, s3):
        self.bucket = new_bucket(s3)

    def url(self, root: Path) -> str:
        return f"s3://{self.bucket}/{hashlib.sha1(str(root).encode()).hexdigest()[:10]}"

    def create(self, root, name, row_shape, dtype):
        import fsspec

        fmt.create_compressed(root, name, ROWS, row_shape, np.dtype(dtype), "zstd")
        fs = fsspec.filesystem("s3")
        for f in (root / name).rglob("*"):
            if f.is_file():
                fs.put_file(str(f), f"{self.url(root)[5:]}/{f.relative_to(root).as_posix()}")

    def open(self, root, name, *, writable, expect):
        return RemoteArray.open(self.url(root), name, writable=writable, expect=expect)

    def zarr_array(self, root, name, mode):
        import zarr

        return zarr.open_array(f"{self.url(root)}/{name}", mode=mode)

    def test_is_remote(self, col):
        assert isinstance(col, RemoteArray) and col.mapped() is None


def test_fewer_blocks_than_shards_share_blocks(tmp_path, bucket):
    url = f"s3://{bucket}/store"
    publish(tmp_path, url, episodes=2, length=20).close()  # 40 rows: one live block per lane
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=SMALL) as buf:
        n = len(buf.remote.pool.live)
        assert n == 2
        for i in range(5):
            buf.remote.set_shard(i, 5)
            assert buf.remote.pool.order(0).tolist() == [buf.remote.pool.order(0).tolist()[0]]  # one block each
            b = buf.sample(4)
            assert set((b.indices // buf.remote.pool.block_rows).tolist()) <= set(buf.remote.pool.live.tolist())


def test_publish_keeps_three_snapshots_and_a_failed_publish_stays_invisible(tmp_path, bucket, s3, monkeypatch):
    import fsspec

    from mmbuffer.convert import publish as publish_to

    url = f"s3://{bucket}/store"
    make_store(tmp_path / "local", episodes=3).close()
    for _ in range(4):
        publish_to(tmp_path / "local", url, progress=False)
    fs = fsspec.filesystem("s3", endpoint_url=s3)

    def whole() -> list[str]:  # snapshots with their manifest (a dropped one keeps only objects the kept ones name)
        fs.invalidate_cache()
        return sorted(p.rsplit("/", 2)[-2] for p in fs.glob(f"{bucket}/store/snapshots/*/manifest.json"))

    snaps = whole()
    assert [s[:10] for s in snaps] == ["0000000002", "0000000003", "0000000004"]
    first = next(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/store/snapshots") if "/0000000001-" in p)
    held = {p.split(f"/{first}/", 1)[1] for p in fs.find(f"{bucket}/store/snapshots/{first}")}
    tables = [table_objects(fs, f"{bucket}/store", s) for s in snaps]
    named = {rel for t in tables for rel, v in t.items() if v[2:] == [first]}
    roots = [json.loads(fs.cat_file(f"{bucket}/store/snapshots/{s}/objects.json")) for s in snaps]
    named |= {f"parts/{key}.json" for body in roots for key, v in body["parts"].items() if v[2] == first}
    assert held == named and "manifest.json" not in held and "objects.json" not in held  # what the kept ones name
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    assert ro.remote.snapshot == snaps[-1]
    mirrors = sorted(p.name for p in ro.remote.cache.iterdir())
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as again:  # the mirror is reused
        assert again.path == ro.path and sorted(p.name for p in ro.remote.cache.iterdir()) == mirrors

    def fail(*args, **kwargs):
        raise OSError("the network went away")

    from mmbuffer.remote import _snapshot

    monkeypatch.setattr(_snapshot, "write_pointer", fail)  # the upload succeeds, the pointer write fails
    with pytest.raises(OSError):
        publish_to(tmp_path / "local", url, progress=False)
    monkeypatch.undo()
    assert len(whole()) == 4  # uploaded: a fourth snapshot
    assert ro.refresh() is False and ro.remote.snapshot == snaps[-1]  # the half-published snapshot is invisible
    assert ro.get(np.arange(3))["x"].tolist() == [0, 1, 2]
    done = publish_to(tmp_path / "local", url, progress=False)  # the orphan goes, the pointed-to one stays
    assert whole() == sorted([snaps[1], snaps[2], done["snapshot"]]) and done["sequence"] == 5
    assert ro.get(np.arange(3))["x"].tolist() == [0, 1, 2]  # snapshot 4 is kept: its objects too
    ro.close()


def test_a_remote_column_whose_metadata_disagrees_is_refused(tmp_path, bucket, s3):
    import json

    import fsspec

    url = f"s3://{bucket}/store"
    publish(tmp_path, url, episodes=2).close()
    fs = fsspec.filesystem("s3", endpoint_url=s3)
    snap = json.loads(fs.cat_file(f"{bucket}/store/current.json"))["snapshot"]
    key = f"{bucket}/store/snapshots/{snap}/columns/obs/zarr.json"
    meta = json.loads(fs.cat_file(key))
    meta["shape"] = [meta["shape"][0], 4]  # the manifest says (3,)
    fs.pipe_file(key, json.dumps(meta).encode())
    # the object table catches the change before the metadata check would
    with pytest.raises(errors.CorruptStoreError, match=r"columns/obs/zarr.json \(column obs\): expected \d+ bytes"):
        mb.open(url, mode="r", cache_dir=tmp_path / "c")


def test_copy_to_and_from_a_url_takes_the_online_layout_options(tmp_path, bucket):
    """capacity / num_streams reach the published copy and the copy back (not dropped for URLs)."""
    url = f"s3://{bucket}/layout"
    local = make_store(tmp_path / "local", episodes=6)
    rows = len(local)
    local.close()
    mb.convert.copy(tmp_path / "local", url, capacity=4 * rows, num_streams=2, progress=False)
    with mb.open(url, mode="r", cache_dir=tmp_path / "cache", pool=None) as ro:
        assert (ro.capacity, ro.num_streams, len(ro)) == (4 * rows, 2, rows)
    mb.convert.copy(url, tmp_path / "back", capacity=8 * rows, progress=False)
    with mb.open(tmp_path / "back", mode="r") as back:
        assert (back.capacity, back.num_streams, back.num_episodes) == (8 * rows, 2, 6)


def test_refresh_fetches_only_the_small_parts_that_changed(tmp_path, bucket):
    url = f"s3://{bucket}/store"
    publish(tmp_path, url, episodes=10).close()
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    rows = np.arange(ro.capacity)
    ro.get(rows, keys=["terminated"])  # every chunk of the flags filled in this mirror
    old = dict(ro.remote.table.entries)
    with mb.open(tmp_path / "local") as w:
        w.extend({"obs": np.ones((30, 3)), "x": np.arange(30) + 10_000, "terminated": np.arange(30) == 29},
                 final_obs={"obs": np.zeros((1, 3))})
    mb.convert.copy(tmp_path / "local", url, progress=False)
    fetched = ro.remote.files.mirror_bytes
    assert ro.refresh()
    fetched = ro.remote.files.mirror_bytes - fetched
    new, mirror = ro.remote.table.entries, Path(ro.path)
    small = [r for r in new if not re.match(r"^columns/(obs|x)/c/", r)]  # all but the data chunks (read remotely)
    changed = [r for r in small if old.get(r) != new[r]]
    flag = [r for r in changed if r.startswith("columns/terminated/c/")]  # fetched when first read (_filled.py)
    assert 0 < len(changed) < len(small) and flag
    assert any(r.startswith("index/ends/c/") for r in small if r not in changed)  # index chunks kept, not fetched
    assert any(r.startswith("columns/terminated/c/") for r in small if r not in changed)
    assert fetched == sum(new[r][0] for r in changed if r not in flag)  # exactly what changed, the flags' aside
    kept = next(r for r in small if r not in changed and (mirror / r).is_file())
    assert (mirror / kept).stat().st_nlink == 2  # linked from the previous mirror, not fetched
    with mb.open(tmp_path / "local", mode="r") as local:
        torch.testing.assert_close(ro.get(rows, keys=["x"])["x"], local.get(rows, keys=["x"])["x"], rtol=0, atol=0)
        fetched = ro.remote.files.mirror_bytes
        np.testing.assert_array_equal(ro.get(rows, keys=["terminated"])["terminated"].numpy(),
                                      local.get(rows, keys=["terminated"])["terminated"].numpy())
        # the chunks that changed, fetched now; the unchanged ones the old mirror held, copied at refresh
        assert ro.remote.files.mirror_bytes - fetched == sum(new[r][0] for r in flag)
    ro.close()
