"""Faults on the read side of a published store, each against the real loopback server (moto).

Every object read is checked against the snapshot that names it: a flipped, truncated,
missing or swapped chunk, a changed object table or a stale pointer is a typed error
or the previous snapshot, never wrong rows. Unreachable endpoints and refused
credentials are ``RemoteAccessError``. The host cache stays under ``cache_limit``,
is shared by processes (one download per object), and a full or read-only cache
disk (a real tmpfs mounted for the test) is a typed error naming ``cache_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from forked import results_of
from s3server import new_bucket, table_objects
from s3server import s3, small_chunks  # noqa: F401 - fixtures

import mmbuffer as mb
from mmbuffer import errors
from mmbuffer._disk import format as fmt

pytest.importorskip("s3fs")
from mmbuffer.remote import PoolConfig  # noqa: E402

SMALL = PoolConfig(blocks=2, block_bytes=1, rotate_every=2, prefetch=1)



@pytest.fixture
def fs(s3):
    import fsspec

    f = fsspec.filesystem("s3", endpoint_url=s3, skip_instance_cache=True)
    yield f
    f.invalidate_cache()


def make_local(path: Path, episodes: int = 40, length: int = 25, seed: int = 0, capacity: int = 4096,
               obs: int = 3) -> None:
    rng = np.random.default_rng(seed)
    with mb.create(path, {"obs": ((obs,), "float32"), "x": ((), "int64")}, capacity=capacity, num_streams=2,
                   next_keys=()) as buf:
        for e in range(episodes):
            t = np.arange(e * length, (e + 1) * length) + seed * 1_000_000
            buf.extend({"obs": rng.random((length, obs)), "x": t, "terminated": t == t[-1]}, stream=e % 2)


def published(tmp_path: Path, s3: str, **kw) -> tuple[str, str]:
    """A store published at a fresh URL: (url, bucket-relative root)."""
    bucket = new_bucket(s3)
    make_local(tmp_path / "local", **kw)
    url = f"s3://{bucket}/store"
    mb.convert.copy(tmp_path / "local", url, progress=False)
    return url, f"{bucket}/store"


def snapshot_root(fs, root: str) -> str:
    return f"{root}/snapshots/" + json.loads(fs.cat_file(f"{root}/current.json"))["snapshot"]


def a_chunk(fs, root: str, column: str = "x") -> str:
    chunks = sorted(p for p in fs.find(f"{snapshot_root(fs, root)}/columns/{column}/c"))
    assert chunks, column
    return chunks[0]


def read_everything(buf: mb.Buffer) -> dict[str, torch.Tensor]:
    return buf.get(np.arange(len(buf)), keys=["obs", "x"])


def flip(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


@pytest.mark.parametrize("fault, match", [
    (flip, "expected BLAKE2b-128 .*changed or swapped"),
    (lambda d: d[: len(d) // 2], r"expected \d+ bytes, got \d+ \(a truncated"),
    (None, "expected the object the snapshot names, found nothing"),
])
@pytest.mark.parametrize("pool", [None, SMALL])
def test_a_damaged_chunk_is_a_typed_error_naming_it_never_rows(tmp_path, s3, fs, fault, match, pool):
    url, root = published(tmp_path, s3)
    key = a_chunk(fs, root)
    if fault is None:
        fs.rm_file(key)
    else:
        fs.pipe_file(key, fault(fs.cat_file(key)))
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=pool) as ro:
        rel = key.split("/snapshots/", 1)[1].split("/", 1)[1]
        with pytest.raises(errors.CorruptStoreError, match=f"{rel} \\(column x\\): {match}"):
            if pool is None:
                read_everything(ro)
            else:
                for _ in range(64):  # the pool reaches every block within an epoch
                    ro.sample(8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "local"]  # nothing written outside cache_dir


def test_a_chunk_swapped_in_from_another_snapshot_is_refused(tmp_path, s3, fs):
    url, root = published(tmp_path, s3, seed=1)
    old = a_chunk(fs, root, "obs")
    make_local(tmp_path / "local2", seed=2)
    mb.convert.copy(tmp_path / "local2", url, progress=False)
    new = a_chunk(fs, root, "obs")
    assert old != new and fs.cat_file(old) != fs.cat_file(new)
    fs.pipe_file(new, fs.cat_file(old))  # a valid chunk, of the wrong snapshot
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        with pytest.raises(errors.CorruptStoreError, match=r"columns/obs/c/0/0 \(column obs\)"):
            read_everything(ro)


def test_a_swapped_object_table_or_pointer_is_refused_and_a_stale_pointer_reads_its_own_snapshot(tmp_path, s3, fs):
    url, root = published(tmp_path, s3, seed=1)
    first = fs.cat_file(f"{root}/current.json")
    make_local(tmp_path / "local2", seed=2)
    mb.convert.copy(tmp_path / "local2", url, progress=False)
    second = fs.cat_file(f"{root}/current.json")
    # the pointer names snapshot 2 with snapshot 1's table digest: refused
    swapped = dict(json.loads(second), objects=json.loads(first)["objects"])
    fs.pipe_file(f"{root}/current.json", json.dumps(swapped).encode())
    with pytest.raises(errors.CorruptStoreError, match="objects.json: expected BLAKE2b-128"):
        mb.open(url, mode="r", cache_dir=tmp_path / "c")
    # a table edited to bless a changed chunk: its digest no longer matches the pointer's
    fs.pipe_file(f"{root}/current.json", second)
    table_key = f"{snapshot_root(fs, root)}/objects.json"
    table = json.loads(fs.cat_file(table_key))
    rel = next(iter(table["objects"]))
    table["objects"][rel][1] = "0" * 32
    fs.pipe_file(table_key, json.dumps(table).encode())
    with pytest.raises(errors.CorruptStoreError, match="objects.json: expected BLAKE2b-128"):
        mb.open(url, mode="r", cache_dir=tmp_path / "c")
    # a stale pointer (snapshot 1, still kept): the old snapshot, whole and consistent
    fs.pipe_file(f"{root}/current.json", first)
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro, \
            mb.open(tmp_path / "local", mode="r") as local:
        np.testing.assert_array_equal(read_everything(ro)["x"].numpy(), read_everything(local)["x"].numpy())
        assert read_everything(ro)["x"].max() < 1_000_000 * 2  # no row of the second store


def test_an_unreachable_endpoint_and_refused_credentials_are_typed(tmp_path, s3):
    url, _ = published(tmp_path, s3)
    quick = {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
    with pytest.raises(errors.RemoteAccessError, match=f"{url}: expected a reachable endpoint.*endpoint"):
        mb.open(url, mode="r", cache_dir=tmp_path / "c", storage_options={"endpoint_url": "http://127.0.0.1:9", **quick})
    with pytest.raises(errors.RemoteAccessError, match=f"{url}: expected credentials the server accepts"):
        mb.open(url, mode="r", cache_dir=tmp_path / "c", storage_options={"anon": True, "endpoint_url": s3})
    make_local(tmp_path / "other")
    with pytest.raises(errors.RemoteAccessError, match="expected a reachable endpoint"):
        mb.convert.publish(tmp_path / "other", url, progress=False,
                           storage_options={"endpoint_url": "http://127.0.0.1:9", **quick})
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("*.json"))


# -- the cache ---------------------------------------------------------------------------------------
def test_cache_limit_far_below_the_store_evicts_and_reads_stay_right(tmp_path, s3, fs, monkeypatch):
    monkeypatch.setattr(fmt, "config", dataclasses.replace(fmt.config, chunk_bytes=32 << 10))
    url, root = published(tmp_path, s3, episodes=400, capacity=16384, obs=64)  # 2.6 MB of obs
    store_bytes = sum(fs.du(snapshot_root(fs, root), total=False).values())
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as probe:
        mirror = probe.remote.files.used()  # what must stay: the small parts
    limit = mirror + (store_bytes - mirror) // 10
    (tmp_path / "c").rename(tmp_path / "old")
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", cache_limit=limit, pool=None) as ro, \
            mb.open(tmp_path / "local", mode="r") as local:
        g = np.random.default_rng(0)
        peak = 0
        for _ in range(12):
            rows = g.integers(0, len(ro), 200)
            ro.store.column("obs").release()  # the in-memory chunk cache: every read goes to the host cache
            got = ro.get(rows, keys=["obs"])["obs"]
            torch.testing.assert_close(got, local.get(rows, keys=["obs"])["obs"], rtol=0, atol=0)
            peak = max(peak, ro.remote.files.used())
        assert peak <= limit < store_bytes // 2
        assert ro.remote.files.downloads > len(list((tmp_path / "c" / "objects").rglob("*")))  # evicted, fetched again


def test_a_reader_refreshing_under_cache_limit_leaves_no_file_per_snapshot_behind(tmp_path, s3):
    """Mirrors of the snapshots a reader moved past are evicted with their pin and lock
    files (``locks/<snapshot>``, ``locks/<snapshot>.flags``): what stays under
    ``cache_dir`` does not grow with the number of snapshots seen."""
    url, _ = published(tmp_path, s3)
    with mb.open(url, mode="r", cache_dir=tmp_path / "probe", pool=None) as probe:
        read_everything(probe)
        held = probe.remote.files.used()  # a mirror with its flags filled, and the chunks read
    cache = tmp_path / "c"
    with mb.open(url, mode="r", cache_dir=cache, cache_limit=2 * held, pool=None) as ro:
        seen = {ro.remote.snapshot}
        for i in range(6):
            with mb.open(tmp_path / "local") as w:
                t = np.arange(20) + 10_000 * (i + 1)
                w.extend({"obs": np.full((20, 3), i, np.float32), "x": t, "terminated": t % 20 == 19})
            mb.convert.copy(tmp_path / "local", url, progress=False)
            assert ro.refresh()
            seen.add(ro.remote.snapshot)
            got = read_everything(ro)  # the flags filled: their lock taken
            with mb.open(tmp_path / "local", mode="r") as local:
                torch.testing.assert_close(got, read_everything(local), rtol=0, atol=0)
        mirrors = {d.name for d in cache.glob("*/*") if d.is_dir() and d.name in seen}
        pins = {f.name[: -len(".pin")] for f in cache.glob("*/*.pin")}
        locks = {f.name.removesuffix(".flags") for f in (cache / "locks").iterdir() if f.name[10:11] == "-"}
        assert len(seen) == 7 and ro.remote.snapshot in mirrors and len(mirrors) < 7  # evicted: what is tested
        assert pins == mirrors and locks <= mirrors  # the evicted ones' files gone with them
        assert ro.remote.files.used() <= 2 * held


def test_a_pin_waiting_on_a_file_eviction_removes_is_taken_on_the_new_file(tmp_path):
    """Eviction removes a mirror's pin while holding it: a reader that was waiting for that
    pin must not hold the removed file (a later eviction would lock the new one and drop
    the mirror under it), so it takes the pin again on the file now at the path."""
    import fcntl
    import os
    import threading

    from mmbuffer.remote._cache import Cache

    cache, pin = Cache(tmp_path / "c", None), tmp_path / "c" / "u" / "0000000001-0123456789ab.pin"
    evicting = cache.pin(pin, exclusive=True)
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(cache.pin(pin)))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()  # waiting for the evictor
    pin.unlink()
    os.close(evicting)
    reader.join(20)
    assert os.fstat(got[0]).st_ino == os.stat(pin).st_ino  # the pin at the path, not the removed one
    probe = os.open(pin, os.O_RDWR)
    with pytest.raises(BlockingIOError):  # so a later eviction sees it held
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(probe)
    os.close(got[0])


def test_a_cache_limit_below_what_must_be_held_is_a_typed_error(tmp_path, s3):
    url, _ = published(tmp_path, s3)
    with pytest.raises(errors.CacheError, match=rf"cache_dir {tmp_path / 'c'}: expected room for \d+ more bytes within cache_limit=1000"):
        mb.open(url, mode="r", cache_dir=tmp_path / "c", cache_limit=1000)


def test_the_cache_counts_a_young_stores_index_by_the_disk_it_takes(tmp_path, s3):
    """A store of large capacity and few rows: its rebuilt episode index (16 bytes a row of
    capacity) is sparse, and ``cache_limit`` counts the disk it takes, not its length."""
    url, _ = published(tmp_path, s3, capacity=1 << 20)  # 1,000 rows in a 16 MiB index
    with mb.open(url, mode="r", cache_dir=tmp_path / "probe", pool=None) as probe:
        ends = next((tmp_path / "probe").rglob("index/ends/c/0"))
        used = probe.remote.files.used()
    assert ends.stat().st_size >= 16 << 20 and used < 1 << 20  # a sparse file, counted by its blocks
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", cache_limit=4 << 20, pool=None) as ro, \
            mb.open(tmp_path / "local", mode="r") as local:  # a limit far below the index's length
        torch.testing.assert_close(read_everything(ro), read_everything(local), rtol=0, atol=0)
        assert ro.remote.files.used() <= 4 << 20


def _read_all(url: str, cache: str, queue) -> None:
    with mb.open(url, mode="r", cache_dir=cache, pool=None) as ro:
        x = ro.get(np.arange(ro.capacity), keys=["obs", "x"])["x"].numpy()  # every chunk of the ring
        queue.put((int(x.sum()), ro.remote.files.downloads))


def test_processes_sharing_a_cache_download_each_object_once(tmp_path, s3, fs):
    url, root = published(tmp_path, s3)
    table = table_objects(fs, root, snapshot_root(fs, root).rsplit("/", 1)[-1])
    # each column's chunks and its zarr.json, read through the host cache, one file per distinct content
    distinct = {v[1] for rel, v in table.items() if rel.startswith(("columns/obs/", "columns/x/"))}
    assert len(distinct) > 10
    results = results_of(_read_all, (url, str(tmp_path / "c")))
    with mb.open(tmp_path / "local", mode="r") as local:
        want = int(local.get(np.arange(local.capacity), keys=["x"])["x"].numpy().sum())
    assert [r[0] for r in results] == [want] * 3
    assert sum(r[1] for r in results) == len(distinct)  # every object once, over the three processes


@pytest.fixture
def tmpfs(tmp_path):
    """A real small filesystem (tmpfs) mounted at ``tmp_path/disk``; skipped where mounting is not allowed."""
    where = tmp_path / "disk"
    where.mkdir()

    def mount(size: str, *extra: str) -> Path:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *extra]), "tmpfs", str(where)],
                           capture_output=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
        return where

    yield mount
    # lazily: a traceback the test kept may still hold a map of a file there
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_cache_disk_is_a_typed_error_never_sigbus(tmp_path, s3, tmpfs):
    url, _ = published(tmp_path, s3, episodes=400, capacity=16384)
    disk = tmpfs("384k")  # the small parts (~190 KB on disk: the rebuilt index is sparse) fit, the pool's block files (~320 KB) do not
    big = PoolConfig(blocks=4, block_bytes=64 << 10, rotate_every=2, prefetch=1)
    with mb.open(url, mode="r", cache_dir=disk, pool=big) as ro:
        with pytest.raises(errors.DiskFullError, match=rf"cache_dir {disk}: expected room for \d+ more bytes") as info:
            ro.sample(8)
        assert info.value.errno in (28, 122)
        assert ro.get(np.arange(5), keys=["x"])["x"].tolist() == [0, 1, 2, 3, 4]  # the reader lives on
    # exact reads: chunk objects fill the disk while sampling
    with mb.open(url, mode="r", cache_dir=disk, pool=None) as ro:
        with pytest.raises(errors.DiskFullError, match=f"cache_dir {disk}"):
            for _ in range(200):
                ro.store.column("obs").release()
                ro.sample(256)


def test_a_read_only_cache_dir_is_a_typed_error(tmp_path, s3, tmpfs):
    url, _ = published(tmp_path, s3)
    disk = tmpfs("1m", "ro")
    with pytest.raises(errors.CacheError, match=f"cache_dir {disk}: expected a writable directory"):
        mb.open(url, mode="r", cache_dir=disk)


# -- the command line on URLs ------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["snapshots", "icechunk"])
def test_info_and_verify_take_a_url_and_verify_finds_a_flipped_chunk(tmp_path, s3, fs, capsys, engine, monkeypatch):
    if engine == "icechunk":
        pytest.importorskip("icechunk")
    from mmbuffer._cli.main import main

    monkeypatch.setenv("MMBUFFER_CACHE_DIR", str(tmp_path / "cache"))
    bucket = new_bucket(s3)
    url = f"s3://{bucket}/store"
    make_local(tmp_path / "local")
    published_ = mb.convert.publish(tmp_path / "local", url, engine=engine, progress=False)
    assert main(["info", url, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    with mb.open(tmp_path / "local", mode="r") as local:
        assert (summary["rows"], summary["episodes"]) == (len(local), local.num_episodes)
    assert (summary["snapshot"], summary["engine"], summary["path"]) == (published_["snapshot"], engine, url)
    assert main(["verify", url]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("ok") and f"of snapshot {published_['snapshot']}" in out
    if engine == "snapshots":
        key = a_chunk(fs, f"{bucket}/store")
    else:
        import icechunk

        from mmbuffer.remote import _icechunk

        table = _icechunk._read_table(icechunk.Repository.open(_icechunk.storage(url, None)).readonly_session("main").store)
        chunks = [k for k in fs.find(f"{bucket}/store/chunks") if fs.cat_file(k) != table]  # the object table aside
        key = sorted(chunks, key=lambda k: -len(fs.cat_file(k)))[0]  # the largest chunk
    fs.pipe_file(key, flip(fs.cat_file(key)))
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "problem:" in out and "expected BLAKE2b-128" in out and out.rstrip().endswith("FAILED")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "local"]


def test_an_object_changed_in_the_host_cache_is_fetched_anew(tmp_path, s3):
    url, _ = published(tmp_path, s3)
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        want = read_everything(ro)["x"].numpy()
        cached = sorted(p for p in (tmp_path / "c" / "objects").rglob("*") if p.is_file())
        assert cached
        for p in cached:
            p.write_bytes(flip(p.read_bytes()))  # bit rot, or another user, on the local disk
        ro.store.column("x").release()  # the decoded chunks: the next read goes to the host cache
        ro.store.column("obs").release()
        before = ro.remote.files.downloads
        np.testing.assert_array_equal(read_everything(ro)["x"].numpy(), want)
        assert ro.remote.files.downloads > before  # refetched from the server, checked again
