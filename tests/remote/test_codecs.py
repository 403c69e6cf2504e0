"""Published stores with per-column codecs (zstd, lz4, jpeg), against a real loopback S3 server (moto).

A reader opens them with ``mb.open(url)`` on both engines and gets exactly what the local
store returns: every row, ``sample``, ``sample_slices``, frame stacks and ``BufferDataset``
(bit-identical for the lossless codecs, and the local store's own JPEG decode for the lossy
one: publishing keeps its shard files). Codec shards are fetched as whole objects, each
checked against the snapshot's table, and decoded in place by the local reader's compiled
kernels; a flipped byte is a ``CorruptStoreError`` naming the column, never pixels.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import mmbuffer as mb
from mmbuffer import errors
from mmbuffer._disk import format as fmt
from mmbuffer._disk.columns import ShardedArray, sharding
from s3server import counting_moto_s3, new_bucket

pytest.importorskip("s3fs")
pytest.importorskip("imagecodecs")

CODECS = {"frames": "zstd", "state": "lz4", "cam": "jpeg:95"}


def frames(rows: np.ndarray) -> np.ndarray:
    """Atari-like 84x84 uint8 frames: a fixed background, a ball that moves, the row id in a corner."""
    out = np.zeros((len(rows), 84, 84), np.uint8)
    out[:, 10:12, :] = 140  # a wall
    out[:, 70:74, 20:64] = 200  # a paddle
    i = np.arange(len(rows))
    y, x = 14 + rows % 50, 4 + (rows * 3) % 76
    for dy in range(2):
        for dx in range(2):
            out[i, y + dy, x + dx] = 255
    out[:, 0, 0], out[:, 0, 1] = rows % 251, (rows // 251) % 251
    return out


def camera(rows: np.ndarray, size: int = 64) -> np.ndarray:
    """Camera-like RGB frames: smooth gradients that drift with the row, a little noise."""
    g = np.linspace(0, 1, size, dtype=np.float32)
    phase = (rows % 97).astype(np.float32)[:, None, None] / 97
    r = 128 + 100 * np.sin(6.28 * (g[None, :, None] + phase))
    gr = 128 + 100 * np.cos(6.28 * (g[None, None, :] - phase))
    b = 64 + 128 * g[None, :, None] * g[None, None, :] + 0 * phase
    img = np.stack(np.broadcast_arrays(r, gr, b), axis=-1)
    noise = np.random.default_rng(int(rows[0]) if len(rows) else 0).normal(0, 3, img.shape)
    return np.clip(img + noise, 0, 255).astype(np.uint8)


def steps(start: int, n: int, episode: int, cam: int = 64) -> dict[str, np.ndarray]:
    rows = np.arange(start, start + n)
    return {"frames": frames(rows), "raw_frames": frames(rows + 7), "state": np.sin(rows[:, None] + np.arange(64)).astype(np.float32),
            "cam": camera(rows, cam), "action": rows % 6, "terminated": rows % episode == episode - 1}


def make(path: Path, rows: int, *, capacity: int, streams: int = 2, episode: int = 97, cam: int = 64,
         raw: bool = True) -> None:
    """``raw=False``: without ``raw_frames`` (in 64 KiB chunks, 9 rows each: most of the objects)."""
    columns = {"frames": mb.Column((84, 84), "uint8", codec="zstd"), "raw_frames": ((84, 84), "uint8"),
               "state": mb.Column((64,), "float32", codec="lz4"), "cam": mb.Column((cam, cam, 3), "uint8", codec="jpeg:95"),
               "action": ((), "int64")}
    if not raw:
        del columns["raw_frames"]
    with mb.create(path, columns, capacity=capacity, num_streams=streams, next_keys=("frames", "cam")) as buf:
        extend(buf, 0, rows, streams=streams, episode=episode, cam=cam)


def extend(buf: mb.Buffer, start: int, rows: int, *, streams: int, episode: int, cam: int = 64) -> None:
    for s in range(streams):
        part = steps(start + s * rows // streams, rows // streams, episode, cam)
        if "raw_frames" not in buf.columns:
            del part["raw_frames"]
        ends = int(part["terminated"].sum())
        buf.extend(part, stream=s, final_obs={"frames": np.full((ends, 84, 84), 9, np.uint8),
                                              "cam": np.full((ends, cam, cam, 3), 9, np.uint8)})
    buf.commit()


@pytest.fixture(scope="module")
def server():
    with counting_moto_s3() as (endpoint, counter):
        yield endpoint, counter


@pytest.fixture(autouse=True)
def small_inner_chunks(monkeypatch):
    """Inner chunks of 4 KiB of rows (one 84x84 frame, 16 rows of ``state``), so a small
    store holds complete shard files of every codec column as well as staged rows."""
    monkeypatch.setattr(sharding, "INNER_BYTES", 4096)
    monkeypatch.setattr(fmt, "config", dataclasses.replace(fmt.config, chunk_bytes=64 << 10))


@pytest.fixture(scope="module", params=["snapshots", "icechunk"])
def published(request, server, tmp_path_factory):
    """A local store with codec and raw columns (2 streams, 2,400 rows) published with each engine."""
    if request.param == "icechunk":
        pytest.importorskip("icechunk")
    mp = pytest.MonkeyPatch()
    mp.setattr(sharding, "INNER_BYTES", 4096)
    mp.setattr(fmt, "config", dataclasses.replace(fmt.config, chunk_bytes=64 << 10))
    tmp = tmp_path_factory.mktemp(request.param)
    make(tmp / "local", 2400, capacity=4096)
    url = f"s3://{new_bucket(server[0])}/store"
    summary = mb.convert.publish(tmp / "local", url, engine=request.param, progress=False)
    mp.undo()
    return tmp, url, summary, request.param


def assert_same(got: mb.Batch | dict, want: mb.Batch | dict) -> None:
    a, b = (x.data if isinstance(x, mb.Batch) else x for x in (got, want))
    assert sorted(a) == sorted(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k
    if isinstance(got, mb.Batch) and isinstance(want, mb.Batch):
        assert torch.equal(got.indices, want.indices)


def test_every_read_of_a_published_codec_store_is_the_local_stores(published):
    tmp, url, summary, _ = published
    assert summary["lossy_shards_kept"] > 0  # the JPEG shards are the local store's own files
    with mb.open(tmp / "local", mode="r") as local, mb.open(url, mode="r", cache_dir=tmp / "c", pool=None) as ro:
        assert {k: c.codec for k, c in ro.columns.items() if c.codec} == CODECS
        assert all(isinstance(ro.store.column(k), ShardedArray) for k in CODECS)  # the local reader's compiled path
        rows = np.arange(len(local))
        before = ro.remote.files.downloads
        assert_same(ro.get(rows), local.get(rows))  # every row and key, next_* included
        table = ro.remote.table.entries
        shards = [r for r in table if r.startswith(tuple(f"columns/{k}/c/" for k in CODECS))]
        assert len({r.split("/")[1] for r in shards}) == 3  # complete shard files of each codec column...
        assert ro.remote.files.downloads - before >= len(shards)  # ...fetched as verified objects
        for seed in range(2):
            g1, g2 = (torch.Generator().manual_seed(seed) for _ in range(2))
            assert_same(ro.sample(64, g1), local.sample(64, g2))
            assert_same(ro.sample_slices(8, 10, generator=g1), local.sample_slices(8, 10, generator=g2))
            stacked = ro.sample(32, g1, stack={"frames": 4, "cam": 4})
            assert stacked.data["frames"].shape == (32, 4, 84, 84) and stacked.data["next_cam"].shape == (32, 4, 64, 64, 3)
            assert_same(stacked, local.sample(32, g2, stack={"frames": 4, "cam": 4}))
            assert_same(ro.sample_slices(4, 6, generator=g1, stack={"frames": 4}, stack_pad="zero"),
                         local.sample_slices(4, 6, generator=g2, stack={"frames": 4}, stack_pad="zero"))


def test_the_pool_and_the_dataset_read_codec_columns_as_the_local_store(published):
    tmp, url, _, _ = published
    with mb.open(tmp / "local", mode="r") as local, mb.open(url, mode="r", cache_dir=tmp / "c") as pooled:
        assert pooled.remote.pool is not None  # the default pool over the raw columns
        for _ in range(4):
            b = pooled.sample(64)
            assert_same(b.data, local.get(b.indices))
            s = pooled.sample(16, stack={"frames": 4})
            assert torch.equal(s.data["frames"][:, -1], local.get(s.indices, ["frames"])["frames"])
            assert torch.equal(s.data["next_frames"][:, -1], local.get(s.indices, ["next_frames"])["next_frames"])
    kw = dict(epoch=True, seed=3, num_batches=6, stack={"frames": 4})
    here = list(mb.data.BufferDataset(tmp / "local", 16, 4, **kw))
    there = list(mb.data.BufferDataset(url, 16, 4, cache_dir=tmp / "c", **kw))
    assert len(here) == len(there) == 6
    for a, b in zip(there, here):
        assert a.data["frames"].shape == (16, 4, 4, 84, 84)
        assert_same(a, b)


def shard_key(fs, url: str, local: Path, column: str, engine: str) -> str:
    """The object on the server holding a complete shard file of ``column`` (found by its bytes)."""
    files = sorted(p for p in (local / "columns" / column / "c").rglob("*") if p.is_file())
    assert files
    want = files[0].read_bytes()
    root = url.split("://", 1)[1]
    where = f"{root}/snapshots" if engine == "snapshots" else f"{root}/chunks"
    keys = [k for k, d in fs.find(where, detail=True).items() if d["size"] == len(want) and fs.cat_file(k) == want]
    assert len(keys) == 1, (column, keys)
    return keys[0]


def test_a_flipped_byte_in_a_codec_shard_object_is_a_corrupt_store_error_naming_the_column(
        published, server, capsys, monkeypatch):
    """A byte flipped in a shard object of ``frames`` (zstd) and in one of ``cam`` (JPEG):
    a read of each column is refused naming it, and ``verify`` names both objects."""
    import fsspec

    from mmbuffer._cli.main import main

    tmp, url, _, engine = published
    fs = fsspec.filesystem("s3", endpoint_url=server[0], skip_instance_cache=True)
    monkeypatch.setenv("MMBUFFER_CACHE_DIR", str(tmp / "cli"))
    assert main(["info", url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    with mb.open(tmp / "local", mode="r") as local:
        assert (info["rows"], info["episodes"]) == (len(local), local.num_episodes)
        assert main(["verify", url]) == 0
        assert capsys.readouterr().out.rstrip().endswith("ok")
        good = {column: (key, fs.cat_file(key))
                for column in ("frames", "cam") for key in [shard_key(fs, url, tmp / "local", column, engine)]}
        try:
            for key, data in good.values():
                fs.pipe_file(key, data[:100] + bytes([data[100] ^ 1]) + data[101:])
            with mb.open(url, mode="r", cache_dir=tmp / "flip", pool=None) as ro:
                for column in good:
                    with pytest.raises(errors.CorruptStoreError, match=f"column {column}\\): expected BLAKE2b-128"):
                        ro.get(np.arange(len(local)), [column])
            assert main(["verify", url]) == 1
            problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("problem:")]
            assert len(problems) == 2 and all(any(f"columns/{c}/" in line for line in problems) for c in good), problems
        finally:
            for key, data in good.values():
                fs.pipe_file(key, data)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["snapshots", "icechunk"])
def test_a_publish_after_one_percent_new_rows_sends_only_changed_codec_objects(tmp_path, server, engine):
    """As the raw-column test (``test_incremental.py``): after 1% new rows a publish sends at
    most 5% of a full publish's bytes, counted by the server; the reader then reads what
    the local store holds."""
    if engine == "icechunk":
        pytest.importorskip("icechunk")
    rows, counter = 6_144, server[1]
    make(tmp_path / "local", rows, capacity=6_656, streams=1, episode=256, cam=32, raw=False)  # codec columns
    url = f"s3://{new_bucket(server[0])}/store"
    before = counter.put_bytes
    first = mb.convert.publish(tmp_path / "local", url, engine=engine, progress=False)
    full = counter.put_bytes - before
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    with mb.open(tmp_path / "local") as buf:
        extend(buf, rows, rows // 100, streams=1, episode=256, cam=32)
    before = counter.put_bytes
    second = mb.convert.publish(tmp_path / "local", url, engine=engine, progress=False)
    sent = counter.put_bytes - before
    # the JPEG shards the first publish sent are the local store's own, and stay in the copy
    # the second appended to (which completed no new shard: none to take)
    assert first["lossy_shards_kept"] > 0 and second["sequence"] == 2 and second["incremental"]
    assert 0 < sent <= 0.05 * full, (sent, full)
    print(f"{engine}: full publish {full} B, after 1% new rows {sent} B ({sent / full:.2%})")
    assert ro.refresh() is True
    with mb.open(tmp_path / "local", mode="r") as local:
        assert len(ro) == len(local) > rows
        pick = np.r_[np.random.default_rng(0).choice(rows, 500, replace=False), np.arange(rows - 300, len(local))]
        assert_same(ro.get(pick), local.get(pick))
    ro.close()


def test_a_snapshot_column_holds_at_most_max_maps_shard_objects(tmp_path, small_inner_chunks):
    """``ShardedArray(shards=...)`` (what a snapshot's codec column is) lets go of the oldest
    shard objects beyond ``max_maps`` and fetches them again when a later read needs them;
    every read is still the local store's."""
    make(tmp_path / "local", 600, capacity=1024, streams=1)
    calls: list[str] = []

    def shards(rel: str) -> np.ndarray | None:
        calls.append(rel)
        path = tmp_path / "local" / rel
        return np.frombuffer(path.read_bytes(), np.uint8) if path.is_file() else None

    with mb.open(tmp_path / "local", mode="r") as local:
        written = [lane.written for lane in local.store.committed]
        col = ShardedArray(tmp_path / "local", "frames", writable=False, expect=(1024, (84, 84), np.dtype(np.uint8)),
                           codec="zstd", lane_size=1024, written=written, shards=shards, max_maps=2)
        files = sum(p.is_file() for p in (tmp_path / "local" / "columns" / "frames" / "c").rglob("*"))
        meta = json.loads((tmp_path / "local" / "columns" / "frames" / "zarr.json").read_text())
        shard = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
        assert files == 600 // shard >= 4  # several complete shard files
        rows = np.arange(600)
        want = local.get(rows, ["frames"])["frames"].numpy()
        np.testing.assert_array_equal(col.read(rows), want)  # one read needs them all: all held for it
        assert len(calls) == len(set(calls)) >= files
        n = len(calls)
        for start in range(0, files * shard, shard):  # one shard per read: the oldest let go each time
            np.testing.assert_array_equal(col.read(rows[start:start + shard]), want[start:start + shard])
        assert len(calls) - n >= files - 2  # fetched again: at most 2 were still held
        col.close()


def test_a_wrapped_ring_publishes_at_its_own_rows_with_its_own_jpeg_shards(tmp_path, server, small_inner_chunks):
    """Once the ring has wrapped, a publish keeps every row where the local store has it
    (the copy's lanes begin at the oldest live episode), so the JPEG shard files sent are
    the local store's own and every column, JPEG included, reads back bit for bit; also
    after a publish that appended to the copy the first one kept."""
    make(tmp_path / "local", 1000, capacity=1024, streams=1)
    with mb.open(tmp_path / "local") as buf:  # wrapped: the oldest episodes evicted
        extend(buf, 1000, 500, streams=1, episode=97)
        assert buf.store.committed[0].first_start > 0
    url = f"s3://{new_bucket(server[0])}/store"
    for step in range(2):  # then more rows, appended to the copy the first publish kept
        if step:
            with mb.open(tmp_path / "local") as buf:
                extend(buf, 1500, 300, streams=1, episode=97)
        summary = mb.convert.publish(tmp_path / "local", url, progress=False)
        assert summary["lossy_shards_kept"] > 0 and summary["incremental"] == bool(step)
        with mb.open(tmp_path / "local", mode="r") as local, \
                mb.open(url, mode="r", cache_dir=tmp_path / f"c{step}", pool=None) as ro:
            (ls, ll), (rs, rl) = local.episodes(), ro.episodes()
            assert torch.equal(ll, rl) and torch.equal(ls, rs)  # the same episodes at the same rows
            rows = np.concatenate([np.arange(a, a + n) % 1024 for a, n in zip(ls.tolist(), ll.tolist())])
            here, there = local.get(rows), ro.get(rows)
            for k in ("frames", "raw_frames", "state", "action", "next_frames", "cam"):
                assert torch.equal(here[k], there[k]), k


def test_a_publish_into_another_capacity_re_encodes_jpeg_within_its_tolerance(tmp_path, server, small_inner_chunks):
    """A publish with another ``capacity`` holds the live episodes from row 0 (other rows
    than the local store's): the lossless columns are still bit-identical episode by
    episode, and the JPEG column is re-encoded from the local decode (no shard file kept),
    within ``jpeg.tolerance``."""
    from mmbuffer._disk.columns.jpeg import tolerance

    make(tmp_path / "local", 1000, capacity=1024, streams=1)
    with mb.open(tmp_path / "local") as buf:  # wrapped: the oldest episodes evicted
        extend(buf, 1000, 500, streams=1, episode=97)
    url = f"s3://{new_bucket(server[0])}/store"
    summary = mb.convert.publish(tmp_path / "local", url, progress=False, capacity=2048)
    assert summary["lossy_shards_kept"] == 0
    with mb.open(tmp_path / "local", mode="r") as local, mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        (ls, ll), (rs, rl) = local.episodes(), ro.episodes()
        assert torch.equal(ll, rl) and not torch.equal(ls, rs)  # the same episodes, at other rows
        for a, b, n in zip(ls.tolist(), rs.tolist(), ll.tolist()):
            here, there = local.get(np.arange(a, a + n) % 1024), ro.get(np.arange(b, b + n) % 2048)  # one lane
            for k in ("frames", "raw_frames", "state", "action", "next_frames"):
                assert torch.equal(here[k], there[k]), k
            err = (here["cam"].float() - there["cam"].float()).abs().mean(dim=(1, 2, 3))
            assert float(err.max()) <= tolerance(95)
