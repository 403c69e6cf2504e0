"""Publishing through Icechunk, against the real loopback S3 server (moto).

Incremental (a publish after a few new rows writes only the objects that changed),
atomic (a reader pinned to a commit reads it whole; refresh moves to the next),
one publisher at a time (the second commit from the same parent is a LockedError and
changes nothing), every chunk verified, and the published store read by zarr through
Icechunk's store without mmbuffer.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from killing import kill_at_random_instants, publisher, timed
from s3server import new_bucket
from s3server import s3, small_chunks  # noqa: F401 - fixtures

import mmbuffer as mb
from mmbuffer import errors
from mmbuffer._disk import format as fmt

pytest.importorskip("s3fs")
icechunk = pytest.importorskip("icechunk")
from mmbuffer.remote import PoolConfig, _icechunk  # noqa: E402

SMALL = PoolConfig(blocks=2, block_bytes=1, rotate_every=2, prefetch=1)



def extend(path, episodes: int, length: int = 25, start: int = 0, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with mb.open(path) as buf:
        dim = buf.columns["obs"].shape[0]
        for e in range(episodes):
            t = np.arange(start + e * length, start + (e + 1) * length)
            buf.extend({"obs": rng.random((length, dim)), "x": t, "terminated": t == t[-1]}, stream=e % 2)


def make(path, episodes: int = 80, obs: int = 3) -> None:
    mb.create(path, {"obs": ((obs,), "float32"), "x": ((), "int64")}, capacity=8192, num_streams=2,
              next_keys=()).close()
    extend(path, episodes)


def everything(buf: mb.Buffer) -> np.ndarray:
    return buf.get(np.arange(buf.capacity), keys=["x"])["x"].numpy()


def test_publish_is_incremental_atomic_and_readable_by_zarr_without_mmbuffer(tmp_path, s3, monkeypatch):
    monkeypatch.setattr(fmt, "config", dataclasses.replace(fmt.config, chunk_bytes=16 << 10))
    url = f"s3://{new_bucket(s3)}/repo"
    make(tmp_path / "local", obs=64)  # 2000 rows: 512 kB of observations, 128 kB of episode index
    first = mb.convert.publish(tmp_path / "local", url, engine="icechunk", progress=False)
    assert first["sequence"] == 1 and first["objects_written"] > 20
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    assert ro.remote.repo is not None and ro.remote.snapshot == first["snapshot"]
    with mb.open(tmp_path / "local", mode="r") as local:
        before = everything(local)
        np.testing.assert_array_equal(everything(ro), before)
        g = torch.Generator().manual_seed(0)
        b = ro.sample(64, g)
        torch.testing.assert_close(b.data["obs"], local.get(b.indices, keys=["obs"])["obs"], rtol=0, atol=0)
    extend(tmp_path / "local", 2, start=10**6, seed=1)  # 2.5% new rows
    second = mb.convert.publish(tmp_path / "local", url, progress=False)  # engine kept: the URL holds a repository
    # the new rows' chunks (2 lanes x 2 columns, a partial chunk each), flags, index, tree: never the old rows
    assert second["sequence"] == 2 and second["objects_written"] < first["objects_written"] // 3
    assert second["bytes_written"] < first["bytes_written"] // 3
    np.testing.assert_array_equal(everything(ro), before)  # pinned: the first commit, whole
    assert ro.refresh() is True and ro.remote.snapshot == second["snapshot"]
    with mb.open(tmp_path / "local", mode="r") as local:
        after = everything(local)
        assert not np.array_equal(after, before)
        np.testing.assert_array_equal(everything(ro), after)
    ro.close()
    # zarr alone, through Icechunk's store
    import zarr

    repo = icechunk.Repository.open(_icechunk.storage(url, None))
    group = zarr.open_group(repo.readonly_session("main").store, mode="r")
    np.testing.assert_array_equal(group["columns/x"][:], after)
    assert group.attrs["mmbuffer"]["sequence"] == 2


def test_a_second_publisher_from_the_same_commit_is_refused_and_changes_nothing(tmp_path, s3, monkeypatch):
    url = f"s3://{new_bucket(s3)}/repo"
    make(tmp_path / "a")
    make(tmp_path / "b", episodes=10)
    mb.convert.publish(tmp_path / "a", url, engine="icechunk", progress=False)
    extend(tmp_path / "a", 1, start=10**6)
    real = _icechunk.table_bytes
    won = {}

    def meanwhile(*args):  # publisher B commits while publisher A is between its session and its commit
        monkeypatch.setattr(_icechunk, "table_bytes", real)
        won.update(mb.convert.publish(tmp_path / "b", url, progress=False))
        return real(*args)

    monkeypatch.setattr(_icechunk, "table_bytes", meanwhile)
    with pytest.raises(errors.LockedError, match=f"{url}: expected to be the only publisher"):
        mb.convert.publish(tmp_path / "a", url, progress=False)
    assert won["sequence"] == 2
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro, mb.open(tmp_path / "b", mode="r") as b:
        assert ro.remote.snapshot == won["snapshot"]  # B's commit, whole; nothing of A's
        np.testing.assert_array_equal(everything(ro), everything(b))


def test_an_exact_read_fetches_the_chunks_it_lacks_together(tmp_path, s3, monkeypatch):
    """A cold exact read (``pool=None``) of an Icechunk store asks for its missing chunks in
    batches (``Repo.fetch_many``: all in flight at once), never one object at a time."""
    url = f"s3://{new_bucket(s3)}/repo"
    make(tmp_path / "a")
    mb.convert.publish(tmp_path / "a", url, engine="icechunk", progress=False)
    singles, batches = [], []
    real_fetch, real_many = _icechunk.Repo.fetch, _icechunk.Repo.fetch_many

    def fetch(self, snapshot, rel):
        singles.append(rel)
        return real_fetch(self, snapshot, rel)

    def fetch_many(self, snapshot):
        inner = real_many(self, snapshot)

        def counted(rels, probe=False):
            batches.append(list(rels))
            return inner(rels, probe)

        return counted

    monkeypatch.setattr(_icechunk.Repo, "fetch", fetch)
    monkeypatch.setattr(_icechunk.Repo, "fetch_many", fetch_many)
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro, mb.open(tmp_path / "a", mode="r") as lo:
        before, singles[:] = ro.remote.files.downloads, []
        np.testing.assert_array_equal(everything(ro), everything(lo))
        fetched = ro.remote.files.downloads - before
    assert fetched > 10  # many chunks (1 KiB each), fetched by this read
    assert [r for r in singles if not r.endswith("zarr.json")] == []
    assert sum(len(b) for b in batches) == fetched and len(batches) < fetched


def test_publishes_keep_the_newest_commits_and_a_reader_of_an_expired_one_is_told_to_refresh(tmp_path, s3):
    """``keep=2``: once the branch holds 4 commits, those older than its 2 newest are expired
    and the objects only they held deleted; a reader still on an expired commit gets
    ``StoreNotFoundError`` (never rows of a deleted object, never a corrupt-store error), and
    ``refresh()`` brings it to the newest."""
    url = f"s3://{new_bucket(s3)}/repo"
    make(tmp_path / "a")
    first = mb.convert.publish(tmp_path / "a", url, engine="icechunk", keep=2, progress=False)
    old = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)  # on the first commit; nothing read yet
    pruned = []
    for i in range(4):
        extend(tmp_path / "a", 2, start=10**6 + 100 * i, seed=i)
        pruned += mb.convert.publish(tmp_path / "a", url, engine="icechunk", keep=2, progress=False)["pruned"]
    repo = icechunk.Repository.open(_icechunk.storage(url, None))
    assert [c.message.split(" (")[0] for c in repo.ancestry(branch="main")][:-1] == [  # 1 and 2 expired after the 4th
        f"mmbuffer publish {n}" for n in (5, 4, 3)]
    assert first["snapshot"] in pruned and len(pruned) == 2
    with pytest.raises(errors.StoreNotFoundError, match="expired it"):
        old.get(np.arange(old.capacity))  # every column: some of their objects were deleted
    assert old.refresh()
    with mb.open(tmp_path / "a", mode="r") as local:
        np.testing.assert_array_equal(everything(old), everything(local))
    old.close()
    repo.create_tag("mine", repo.lookup_branch("main"))  # someone else's reference: nothing expires now
    for i in range(4):
        extend(tmp_path / "a", 1, start=2 * 10**6 + 100 * i, seed=i)
        assert mb.convert.publish(tmp_path / "a", url, engine="icechunk", keep=2, progress=False)["pruned"] == []
    assert len(list(repo.ancestry(branch="main"))) == 8


def test_a_flipped_chunk_in_the_repository_is_a_typed_error(tmp_path, s3):
    import fsspec

    bucket = new_bucket(s3)
    url = f"s3://{bucket}/repo"
    make(tmp_path / "local")
    mb.convert.publish(tmp_path / "local", url, engine="icechunk", progress=False)
    fs = fsspec.filesystem("s3", endpoint_url=s3, skip_instance_cache=True)
    repo = icechunk.Repository.open(_icechunk.storage(url, None))
    table = _icechunk._read_table(repo.readonly_session("main").store)
    chunks = [k for k in fs.find(f"{bucket}/repo/chunks") if fs.cat_file(k) != table]
    assert len(chunks) > 20
    for key in chunks:  # every chunk object Icechunk wrote, but the object table's
        data = fs.cat_file(key)
        fs.pipe_file(key, data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(errors.CorruptStoreError, match=r"\(column obs\): expected"):
        with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
            ro.get(np.arange(ro.capacity), keys=["obs"])  # x's chunks are small: Icechunk keeps them inline


def test_the_pool_samples_an_icechunk_store(tmp_path, s3):
    url = f"s3://{new_bucket(s3)}/repo"
    make(tmp_path / "local")
    mb.convert.publish(tmp_path / "local", url, engine="icechunk", progress=False)
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=SMALL) as ro, \
            mb.open(tmp_path / "local", mode="r") as local:
        for _ in range(6):
            b = ro.sample(16)
            torch.testing.assert_close(b.data["x"], local.get(b.indices, keys=["x"])["x"], rtol=0, atol=0)
        assert set((b.indices // ro.remote.pool.block_rows).tolist()) <= set(ro.remote.pool.held_blocks())


_PUBLISHER = """
import sys, dataclasses
from mmbuffer._disk import format as fmt
fmt.config = dataclasses.replace(fmt.config, chunk_bytes=1024)
import mmbuffer as mb
import icechunk, s3fs
print("ready", flush=True)
mb.convert.publish(sys.argv[1], sys.argv[2], engine="icechunk", progress=False)
"""


@pytest.mark.slow
def test_a_publisher_killed_at_random_instants_leaves_a_whole_commit(tmp_path, s3):
    """10 publishers (``MMBUFFER_KILL_TRIALS`` runs more) killed (SIGKILL) at random instants, alternating two stores: after
    each, a reader opens exactly one of them (never a mix), and a restarted publisher
    commits."""
    url = f"s3://{new_bucket(s3)}/repo"
    make(tmp_path / "a")
    make(tmp_path / "b", episodes=60)
    extend(tmp_path / "b", 20, start=10**6, seed=3)
    with mb.open(tmp_path / "a", mode="r") as a, mb.open(tmp_path / "b", mode="r") as b:
        states = {"a": everything(a), "b": everything(b)}
    start = publisher(_PUBLISHER, url)
    span = timed(start, tmp_path / "a")  # one whole publish

    def read():
        with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
            return everything(ro)

    published = kill_at_random_instants(start, [tmp_path / "a", tmp_path / "b"], read, list(states.values()),
                                        kills=int(os.environ.get("MMBUFFER_KILL_TRIALS", 10)), span=span, fraction=(0.2, 1.0))
    assert published >= 1  # some publishes completed between the kills
    assert start(tmp_path / "b").wait() == 0  # a restarted publisher commits on top of whatever survived
    with mb.open(url, mode="r", cache_dir=tmp_path / "c2", pool=None) as ro:
        np.testing.assert_array_equal(everything(ro), states["b"])


def test_icechunk_refuses_a_prefix_holding_other_objects(tmp_path, s3):
    import fsspec

    bucket = new_bucket(s3)
    fs = fsspec.filesystem("s3", endpoint_url=s3, skip_instance_cache=True)
    fs.pipe(f"{bucket}/theirs/data.csv", b"a,b\n")
    make(tmp_path / "local", episodes=4)
    mb.convert.copy(tmp_path / "local", f"s3://{bucket}/snap", progress=False)  # engine="snapshots"
    for prefix in ("theirs", "snap"):
        before = sorted(fs.find(f"{bucket}/{prefix}"))
        with pytest.raises(errors.StoreExistsError, match="expected an empty prefix or an Icechunk repository"):
            mb.convert.publish(tmp_path / "local", f"s3://{bucket}/{prefix}", engine="icechunk", progress=False)
        fs.invalidate_cache()
        assert sorted(fs.find(f"{bucket}/{prefix}")) == before  # nothing was changed
