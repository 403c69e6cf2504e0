"""Incremental publishing, counted in bytes by the real loopback S3 server (moto).

After 1% new rows, a publish sends a small fraction of a full publish's bytes, with both
engines (the server counts every PUT body: objects, multipart parts, Icechunk's own
files); what a reader gets after it is bit-identical to the local store. The raw arrays
(episode index, flags, priority tree) go as chunks and are rebuilt on the reader, every
chunk checked; an older published snapshot (pointer version 2) still opens, and a
publish on top of it sends only what changed; a pointer of an unknown version is refused
naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer import errors
from mmbuffer._disk import format as fmt
from killing import kill_at_random_instants, publisher, timed
from s3server import counting_moto_s3, flat_table, new_bucket, table_objects

pytest.importorskip("s3fs")
from mmbuffer.remote import _snapshot  # noqa: E402
from mmbuffer.remote._objects import OBJECTS, digest, file_digest, table_bytes  # noqa: E402

ROWS = 100_000


@pytest.fixture(scope="module")
def server():
    with counting_moto_s3() as (endpoint, counter):
        yield endpoint, counter


@pytest.fixture(autouse=True)
def chunks_of_64k(monkeypatch):
    """Chunks of 64 KiB: a store of 100k rows has dozens per column, as a large store has."""
    monkeypatch.setattr(fmt, "config", dataclasses.replace(fmt.config, chunk_bytes=64 << 10))


@pytest.fixture
def fs(server):
    import fsspec

    f = fsspec.filesystem("s3", endpoint_url=server[0], skip_instance_cache=True)
    yield f
    f.invalidate_cache()


def extend(path, start: int, n: int, episode: int = 1000) -> None:
    rng = np.random.default_rng(start)
    t = np.arange(start, start + n)
    with mb.open(path) as buf:
        buf.extend({"obs": rng.standard_normal((n, 8), dtype=np.float32), "x": t, "terminated": t % episode == episode - 1},
                   final_obs={"obs": rng.standard_normal((int((t % episode == episode - 1).sum()), 8), dtype=np.float32)})


def make(path, rows: int = ROWS, priorities: bool = False) -> None:
    mb.create(path, {"obs": ((8,), "float32"), "x": ((), "int64")}, capacity=rows * 11 // 10,
              priorities=mb.PriorityConfig() if priorities else None).close()
    extend(path, 0, rows)


def same_reads(ro: mb.Buffer, path) -> None:
    """Every row, every key, the episodes and the priorities: bit-identical to the local store."""
    with mb.open(path, mode="r") as local:
        assert (len(ro), ro.num_episodes) == (len(local), local.num_episodes)
        starts, lengths = local.episodes()  # the live rows (a wrapped ring's too), at the local store's rows
        rows = np.concatenate([np.arange(a, a + n) for a, n in zip(starts.tolist(), lengths.tolist())]) % local.capacity
        want, got = local.get(rows), ro.get(rows)
        assert sorted(want) == sorted(got)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
        for a, b in zip(ro.episodes(), local.episodes()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        if local.priorities is not None:
            np.testing.assert_array_equal(ro.leaf_priorities(rows), local.leaf_priorities(rows))


def publish(server, path, url: str, engine: str) -> tuple[dict, int]:
    counter = server[1]
    before = counter.put_bytes
    summary = mb.convert.publish(path, url, engine=engine, progress=False)
    return summary, counter.put_bytes - before


@pytest.mark.parametrize("engine, priorities, wrapped", [("snapshots", True, False), ("icechunk", False, False),
                                                        ("snapshots", True, True), ("icechunk", False, True)])
def test_a_publish_after_one_percent_new_rows_sends_a_small_fraction(tmp_path, server, engine, priorities, wrapped):
    """Also once the ring has wrapped (a replay buffer in its steady state): a publish keeps
    the local rows, so the rows that stayed are the same chunks as before."""
    if engine == "icechunk":
        pytest.importorskip("icechunk")
    url = f"s3://{new_bucket(server[0])}/store"
    make(tmp_path / "local", priorities=priorities)
    if wrapped:  # the ring passes its end: the oldest episodes evicted, the rows at the end kept
        extend(tmp_path / "local", ROWS, ROWS // 2)
        with mb.open(tmp_path / "local", mode="r") as local:
            assert 0 < local.view().first_starts[0] < ROWS
    first, full = publish(server, tmp_path / "local", url, engine)
    assert full > ROWS * 8 * 4 * 0.8  # at least the observations (random float32: zstd saves ~10%)
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    same_reads(ro, tmp_path / "local")
    packed = ro.remote.table.packed
    assert {"index/ends", "columns/terminated"} <= set(packed) and ("priority/leaves" in packed) == priorities
    for step in range(2):  # 1% new rows, twice: each publish sends what changed
        extend(tmp_path / "local", ROWS * (3 if wrapped else 2) // 2 + step * ROWS // 100, ROWS // 100)
        second, sent = publish(server, tmp_path / "local", url, engine)
        assert second["sequence"] == 2 + step
        assert second["incremental"] and second["rows_copied"] == ROWS // 100  # appended to the last copy
        assert second["rows"] == len(mb.open(tmp_path / "local", mode="r"))
        assert 0 < sent <= 0.05 * full, (sent, full)  # the goal: <= 5% of a full publish
        assert sent >= ROWS // 100 * 8 * 4 * 0.8  # at least the new observations went
        assert ro.refresh() is True
        same_reads(ro, tmp_path / "local")  # after the incremental publish: bit-identical
    ro.close()
    with mb.open(url, mode="r", cache_dir=tmp_path / "fresh", pool=None) as cold:  # a new reader, a new cache
        same_reads(cold, tmp_path / "local")


def test_a_packed_index_chunk_damaged_or_missing_is_a_typed_error_naming_it(tmp_path, server, fs):
    bucket = new_bucket(server[0])
    url = f"s3://{bucket}/store"
    make(tmp_path / "local", rows=20_000)
    snap = publish(server, tmp_path / "local", url, "snapshots")[0]["snapshot"]
    chunks = sorted(fs.find(f"{bucket}/store/snapshots/{snap}/index/ends/c"))
    assert chunks  # the index went as chunks, not as one dense file
    key = chunks[0]
    rel = key.split(f"{snap}/", 1)[1]
    good = fs.cat_file(key)
    fs.pipe_file(key, good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(errors.CorruptStoreError, match=f"{rel} \\(column {rel}\\): expected BLAKE2b-128"):
        mb.open(url, mode="r", cache_dir=tmp_path / "c1")
    fs.rm_file(key)
    with pytest.raises(errors.CorruptStoreError, match=f"{rel} .*expected the object the snapshot names, found nothing"):
        mb.open(url, mode="r", cache_dir=tmp_path / "c2")
    fs.pipe_file(key, good)
    with mb.open(url, mode="r", cache_dir=tmp_path / "c3", pool=None) as ro:
        same_reads(ro, tmp_path / "local")
    for refused in ("c1", "c2"):  # the refused opens left no mirror behind
        assert not list((tmp_path / refused).rglob("manifest.json"))


def _publish_v2(fs, root: str, store) -> str:
    """A snapshot as mmbuffer published it before (pointer version 2, object table version 1):
    every object of a zstd copy under its own snapshot folder."""
    snap = "0000000001-0123456789ab"
    files = {p.relative_to(store).as_posix(): p for p in store.rglob("*") if p.is_file() and p.name != fmt.LOCK}
    table = json.dumps({"format": "mmbuffer-objects", "version": 1, "hash": "blake2b-128",
                        "objects": {r: list(file_digest(p)) for r, p in sorted(files.items())}}).encode()
    for rel, p in files.items():
        fs.put_file(str(p), f"{root}/snapshots/{snap}/{rel}")
    fs.pipe_file(f"{root}/snapshots/{snap}/{OBJECTS}", table)
    group = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()
    fs.pipe({f"{root}/zarr.json": group, f"{root}/snapshots/zarr.json": group})
    fs.pipe_file(f"{root}/current.json", json.dumps({"format": "mmbuffer-remote", "version": 2, "snapshot": snap,
                                                     "sequence": 1, "generation": 1, "objects": digest(table)}).encode())
    return snap


def test_an_older_published_snapshot_still_opens_and_an_unknown_version_is_refused(tmp_path, server, fs):
    bucket = new_bucket(server[0])
    url, root = f"s3://{bucket}/old", f"{bucket}/old"
    make(tmp_path / "local", rows=20_000)
    mb.convert.copy(tmp_path / "local", tmp_path / "zst", compression="zstd", progress=False)
    old = _publish_v2(fs, root, tmp_path / "zst")
    assert "index/ends/c/0" in json.loads(fs.cat_file(f"{root}/snapshots/{old}/objects.json"))["objects"]
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    assert ro.remote.snapshot == old and not ro.remote.table.packed  # the dense index, read as it was published
    same_reads(ro, tmp_path / "local")
    # publishing on top of it: version 3, the unchanged data chunks named in the old snapshot, not sent again
    extend(tmp_path / "local", 20_000, 200)
    new, sent = publish(server, tmp_path / "local", url, "snapshots")
    held = [r for r, v in table_objects(fs, root, new["snapshot"]).items() if v[2:] == [old]]
    assert json.loads(fs.cat_file(f"{root}/current.json"))["version"] == 3
    assert any(r.startswith("columns/obs/c/") for r in held) and sent < 20_000 * 8 * 4 // 2
    assert ro.refresh() is True and ro.remote.table.packed  # from the dense index to the chunked one
    same_reads(ro, tmp_path / "local")
    ro.close()
    # a pointer of a version this mmbuffer does not read: refused, naming the version
    pointer = json.loads(fs.cat_file(f"{root}/current.json"))
    fs.pipe_file(f"{root}/current.json", json.dumps(dict(pointer, version=99)).encode())
    with pytest.raises(errors.FormatVersionError, match=r"current.json: version: expected one of \[2, 3\].*got 99"):
        mb.open(url, mode="r", cache_dir=tmp_path / "c2")


def test_a_publish_over_a_damaged_snapshot_sends_everything_and_is_whole(tmp_path, server, fs):
    bucket = new_bucket(server[0])
    url = f"s3://{bucket}/store"
    make(tmp_path / "local", rows=20_000)
    first, full = publish(server, tmp_path / "local", url, "snapshots")
    key = f"{bucket}/store/snapshots/{first['snapshot']}/objects.json"
    fs.pipe_file(key, fs.cat_file(key) + b" ")  # no longer the table the pointer names
    extend(tmp_path / "local", 20_000, 200)
    second, sent = publish(server, tmp_path / "local", url, "snapshots")
    table = table_objects(fs, f"{bucket}/store", second["snapshot"])
    assert not any(v[2:] == [first["snapshot"]] for v in table.values()) and sent > 0.9 * full  # names nothing of it
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        same_reads(ro, tmp_path / "local")


def _resign(fs, root: str, snap: str, body: dict) -> None:
    """Replace a snapshot's object table by ``body`` and point the pointer at its digest."""
    raw = json.dumps(body, separators=(",", ":")).encode()
    fs.pipe_file(f"{root}/snapshots/{snap}/{OBJECTS}", raw)
    pointer = json.loads(fs.cat_file(f"{root}/current.json"))
    fs.pipe_file(f"{root}/current.json", json.dumps(dict(pointer, objects=digest(raw))).encode())


def test_packed_arrays_are_checked_by_their_chunks_digests_and_a_version_2_table_still_reads(tmp_path, server, fs):
    """Version 3 records a packed array's digest over its chunks' digests (a chunk of zeros
    is never hashed on the reader); a table of version 2 records the digest of the shard
    file's bytes and still opens; a record that matches neither rebuild is refused."""
    from mmbuffer.remote._dense import Packed, shard_rel

    bucket = new_bucket(server[0])
    url, root = f"s3://{bucket}/store", f"{bucket}/store"
    make(tmp_path / "local", rows=20_000, priorities=True)
    snap = publish(server, tmp_path / "local", url, "snapshots")[0]["snapshot"]
    body = json.loads(fs.cat_file(f"{root}/snapshots/{snap}/{OBJECTS}"))
    assert body["version"] == 4 and {"index/ends", "priority/leaves"} <= set(body["packed"])
    files = {a: file_digest(tmp_path / "local" / shard_rel(a, Packed(*rec)))
             for a, rec in body["packed"].items()}
    for a, rec in body["packed"].items():
        assert rec[1] == files[a][0] and rec[2] != files[a][1]  # same file, a digest of its chunks' digests
    # one objects.json, as mmbuffer wrote before table version 4 (parts): version 3 still reads
    flat = flat_table(fs, root, snap, version=3)
    _resign(fs, root, snap, flat)
    with mb.open(url, mode="r", cache_dir=tmp_path / "flat3", pool=None) as ro:
        assert not ro.remote.table.parts and len(ro.remote.table.entries) == len(flat["objects"])
        same_reads(ro, tmp_path / "local")
    # version 2: the digests of the files' bytes
    _resign(fs, root, snap, dict(flat, version=2, packed={a: [rec[0], rec[1], files[a][1]] for a, rec in body["packed"].items()}))
    with mb.open(url, mode="r", cache_dir=tmp_path / "v2", pool=None) as ro:
        assert ro.remote.table.packed and not any(r.chunked for r in ro.remote.table.packed.values())
        same_reads(ro, tmp_path / "local")
    # a table whose record is the file's digest (or any other): refused, nothing mirrored
    _resign(fs, root, snap, dict(body, packed=dict(body["packed"], **{"index/ends": [*body["packed"]["index/ends"][:2], files["index/ends"][1]]})))
    with pytest.raises(errors.CorruptStoreError, match=r"index/ends \(rebuilt from its chunks\): expected BLAKE2b-128"):
        mb.open(url, mode="r", cache_dir=tmp_path / "bad", pool=None)
    assert not list((tmp_path / "bad").rglob("manifest.json"))
    _resign(fs, root, snap, body)
    with mb.open(url, mode="r", cache_dir=tmp_path / "v4", pool=None) as ro:
        assert all(r.chunked for r in ro.remote.table.packed.values())
        same_reads(ro, tmp_path / "local")


def test_a_table_of_an_unknown_version_is_refused_naming_it(tmp_path):
    from mmbuffer.remote._objects import parse_table

    raw = table_bytes({"a": (1, digest(b"a"))}).replace(b'"version":3', b'"version":7')
    with pytest.raises(errors.FormatVersionError, match="objects.json: version: expected 1, 2, 3 or 4, got 7"):
        parse_table(raw, "s3://b/s/snapshots/x/objects.json", "s3://b/s", "x")


def test_zarr_reads_the_chunked_index_of_a_published_store_without_mmbuffer(tmp_path, server):
    """The first snapshot is a whole Zarr group (later ones name what earlier ones hold);
    Icechunk's store serves every commit whole."""
    import zarr

    url = f"s3://{new_bucket(server[0])}/store"
    make(tmp_path / "local", rows=20_000)
    snap = publish(server, tmp_path / "local", url, "snapshots")[0]["snapshot"]
    group = zarr.open_group(f"{url}/{_snapshot.SNAPSHOTS}/{snap}", mode="r",
                            storage_options={"endpoint_url": server[0]})
    local = zarr.open_group(str(tmp_path / "local"), mode="r")
    for name in ("index/ends", "columns/terminated", "columns/x"):
        np.testing.assert_array_equal(group[name][:], local[name][:])
    if pytest.importorskip("icechunk"):
        import icechunk

        from mmbuffer.remote import _icechunk

        ic_url = f"s3://{new_bucket(server[0])}/repo"
        publish(server, tmp_path / "local", ic_url, "icechunk")
        extend(tmp_path / "local", 20_000, 200)
        publish(server, tmp_path / "local", ic_url, "icechunk")
        repo = icechunk.Repository.open(_icechunk.storage(ic_url, None))
        group = zarr.open_group(repo.readonly_session("main").store, mode="r")
        local = zarr.open_group(str(tmp_path / "local"), mode="r")
        for name in ("index/ends", "columns/terminated", "columns/x"):
            np.testing.assert_array_equal(group[name][:], local[name][:])


_PUBLISHER = """
import sys, dataclasses
from mmbuffer._disk import format as fmt
fmt.config = dataclasses.replace(fmt.config, chunk_bytes=4096)
import mmbuffer as mb
import s3fs
print("ready", flush=True)
mb.convert.publish(sys.argv[1], sys.argv[2], engine="snapshots", keep=2, progress=False)
"""


@pytest.mark.slow
def test_an_incremental_publisher_killed_at_random_instants_leaves_a_whole_snapshot(tmp_path, server, fs):
    """4 publishers (``MMBUFFER_KILL_TRIALS`` runs more) of the object-table engine killed (SIGKILL) at random instants (in the
    upload, the table, the pointer or the prune), alternating two stores that share most
    chunks: after each, a reader opens exactly one of them (never a mix, never a missing
    object), and a restarted publisher completes."""
    url = f"s3://{new_bucket(server[0])}/store"
    make(tmp_path / "a", rows=20_000)
    make(tmp_path / "b", rows=20_000)
    extend(tmp_path / "b", 20_000, 400)  # b = a + 2% new rows: incremental publishes both ways
    states = {}
    for which in "ab":
        with mb.open(tmp_path / which, mode="r") as local:
            states[which] = local.get(np.arange(len(local)), keys=["x"])["x"].numpy()
    start = publisher(_PUBLISHER, url)
    assert start(tmp_path / "a").wait() == 0
    span = timed(start, tmp_path / "b")  # one incremental publish, as in the loop

    def read():
        with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
            return ro.get(np.arange(len(ro)), keys=["x"])["x"].numpy()

    published = kill_at_random_instants(start, [tmp_path / "a", tmp_path / "b"], read, list(states.values()),
                                        kills=int(os.environ.get("MMBUFFER_KILL_TRIALS", 4)), span=span, fraction=(0.1, 1.5))
    assert published >= 1
    assert start(tmp_path / "b").wait() == 0
    with mb.open(url, mode="r", cache_dir=tmp_path / "c2", pool=None) as ro:
        same_reads(ro, tmp_path / "b")
