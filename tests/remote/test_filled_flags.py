"""A remote reader's done flags, fetched chunk by chunk when first read (``mmbuffer/remote/_filled.py``),
against a real S3-compatible server on loopback (moto).

A new reader's mirror lays the flags out as holes: its cold start does not fetch them, a
read fetches the chunks it touches (each checked against the snapshot's table), writes
them, makes them durable and only then marks them present; the processes of a host fetch
each chunk once; a damaged chunk is a typed error naming it and never reads as ``False``.
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
from forked import results_of
from s3server import new_bucket, s3, small_chunks, table_objects  # noqa: F401 - fixtures (1 KiB chunks: 4 a flag)

import mmbuffer as mb
from mmbuffer import errors

pytest.importorskip("s3fs")

FLAGS = ("terminated", "truncated")


@pytest.fixture
def fs(s3):
    import fsspec

    f = fsspec.filesystem("s3", endpoint_url=s3, skip_instance_cache=True)
    yield f
    f.invalidate_cache()


def published(tmp_path: Path, s3: str, engine: str = "snapshots") -> tuple[str, str]:
    """A store of 4096 rows in one lane (episodes of 25, some truncated) at a new URL: (url, root)."""
    with mb.create(tmp_path / "local", {"x": ((), "int64")}, capacity=4096, next_keys=()) as buf:
        t = np.arange(4000)
        buf.extend({"x": t, "terminated": t % 50 == 49, "truncated": t % 50 == 24})
    bucket = new_bucket(s3)
    url = f"s3://{bucket}/store"
    mb.convert.publish(tmp_path / "local", url, engine=engine, progress=False)
    return url, f"{bucket}/store"


def flag_chunks(fs, root: str) -> dict[str, int]:
    """The flags' published chunk objects and their sizes, from the current snapshot's table."""
    snap = json.loads(fs.cat_file(f"{root}/current.json"))["snapshot"]
    table = table_objects(fs, root, snap)
    return {rel: entry[0] for rel, entry in table.items() if rel.startswith(tuple(f"columns/{f}/c/" for f in FLAGS))}


def present(ro: mb.Buffer, flag: str) -> list[int]:
    return np.fromfile(Path(ro.path) / "columns" / flag / "present", np.uint8).tolist()


def local_flags(tmp_path: Path, rows: np.ndarray) -> dict[str, np.ndarray]:
    with mb.open(tmp_path / "local", mode="r") as local:
        return {k: v.numpy() for k, v in local.get(rows, keys=list(FLAGS)).items()}


def test_a_new_reader_fetches_the_flag_chunks_its_reads_touch(tmp_path, s3, fs):
    url, root = published(tmp_path, s3)
    sizes = flag_chunks(fs, root)
    assert len(sizes) == 8  # 4 chunks a flag, every one holding an episode end
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        assert present(ro, "terminated") == [0, 0, 0, 0]  # nothing of the flags fetched at open
        shard = Path(ro.path) / "columns" / "terminated" / "c" / "0"
        assert shard.stat().st_blocks * 512 < 4096 + 4096  # holes, and the shard index at the end
        before = ro.remote.files.mirror_bytes
        rows = np.array([1030, 2047, 1100])  # all in chunk 1
        got = ro.get(rows, keys=list(FLAGS))
        want = local_flags(tmp_path, rows)
        for k in FLAGS:
            np.testing.assert_array_equal(got[k].numpy(), want[k])
            assert present(ro, k) == [0, 1, 0, 0]
        assert ro.remote.files.mirror_bytes - before == sum(sizes[f"columns/{k}/c/1"] for k in FLAGS)
        every = np.arange(4000)
        got = ro.get(every, keys=list(FLAGS))  # the rest, then all again from the file
        want = local_flags(tmp_path, every)
        for k in FLAGS:
            np.testing.assert_array_equal(got[k].numpy(), want[k])
            assert got[k].numpy().sum() == 80 and present(ro, k) == [1, 1, 1, 1]
        assert ro.remote.files.mirror_bytes - before == sum(sizes.values())
        s = ro.sample_slices(4, 16)  # the samplers' reads go the same way
        np.testing.assert_array_equal(s["terminated"].numpy().reshape(-1), (s["x"].numpy() % 50 == 49).reshape(-1))
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as again:  # the host's filled mirror, reused
        got = again.get(every, keys=list(FLAGS))
        assert again.remote.files.mirror_bytes == 0  # nothing fetched: not the mirror, not a flag chunk
        for k in FLAGS:
            np.testing.assert_array_equal(got[k].numpy(), want[k])


def test_an_icechunk_commits_flags_are_filled_on_demand_too(tmp_path, s3):
    pytest.importorskip("icechunk")
    url, _ = published(tmp_path, s3, engine="icechunk")
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        assert present(ro, "terminated") == [0, 0, 0, 0] and present(ro, "truncated") == [0, 0, 0, 0]
        every = np.arange(4000)
        got, want = ro.get(every, keys=list(FLAGS)), local_flags(tmp_path, every)
        for k in FLAGS:
            np.testing.assert_array_equal(got[k].numpy(), want[k])
            assert present(ro, k) == [1, 1, 1, 1]


def _read_flags(url: str, cache: str, start, queue) -> None:
    with mb.open(url, mode="r", cache_dir=cache, pool=None) as ro:
        start.wait(60)  # every process opened before any reads
        before = ro.remote.files.mirror_bytes
        got = ro.get(np.arange(4000), keys=list(FLAGS))
        queue.put((int(got["terminated"].sum()), int(got["truncated"].sum()), ro.remote.files.mirror_bytes - before))


def test_processes_sharing_a_cache_fetch_each_flag_chunk_once(tmp_path, s3, fs):
    url, root = published(tmp_path, s3)
    results = results_of(_read_flags, (url, str(tmp_path / "c"), mp.get_context("fork").Barrier(3)))
    assert [r[:2] for r in results] == [(80, 80)] * 3
    assert sum(r[2] for r in results) == sum(flag_chunks(fs, root).values())  # every chunk once, over the host


@pytest.mark.parametrize("fault, match", [
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "expected BLAKE2b-128 .*changed or swapped"),
    (lambda d: d[: len(d) // 2], r"expected \d+ bytes, got \d+ \(a truncated"),
    (None, "expected the object the snapshot names, found nothing"),
])
def test_a_damaged_flag_chunk_is_a_typed_error_never_false(tmp_path, s3, fs, fault, match):
    url, root = published(tmp_path, s3)
    rel = "columns/truncated/c/2"
    key = f"{root}/snapshots/{json.loads(fs.cat_file(f'{root}/current.json'))['snapshot']}/{rel}"
    if fault is None:
        fs.rm_file(key)
    else:
        fs.pipe_file(key, fault(fs.cat_file(key)))
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:  # the flags are not read at open
        assert ro.get(np.arange(5), keys=["truncated"])["truncated"].tolist() == [False] * 5  # chunk 0: whole
        for _ in range(2):  # refused each time: nothing marked present
            with pytest.raises(errors.CorruptStoreError, match=f"{rel} \\(column truncated\\): {match}"):
                ro.get(np.array([2048 + 24]), keys=["truncated"])
        assert present(ro, "truncated") == [1, 0, 0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "local"]  # nothing written outside cache_dir


def test_a_fill_that_cannot_be_made_durable_marks_nothing_and_is_typed(tmp_path, s3, monkeypatch):
    """The chunk's bytes are synced before it is marked present: a failed sync (a full
    disk) is a ``DiskFullError`` naming ``cache_dir``, and the chunk is fetched again next time."""
    from mmbuffer.remote import _filled

    url, _ = published(tmp_path, s3)
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        real = _filled.os.fdatasync

        def full(fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(_filled.os, "fdatasync", full)
        with pytest.raises(errors.DiskFullError, match=f"cache_dir {tmp_path / 'c'}: expected room for"):
            ro.get(np.array([49]), keys=["terminated"])
        assert present(ro, "terminated") == [0, 0, 0, 0]
        monkeypatch.setattr(_filled.os, "fdatasync", real)
        assert ro.get(np.array([48, 49]), keys=["terminated"])["terminated"].tolist() == [False, True]
        assert present(ro, "terminated") == [1, 0, 0, 0]


def test_a_mirror_is_durable_before_it_is_named(tmp_path, s3, monkeypatch):
    """A mirror found in the cache is reused unchecked (after a crash too): every file of it,
    the flags' holes and present bytes included, is synced before its folder gets its name."""
    from mmbuffer.remote import _snapshot

    url, _ = published(tmp_path, s3)
    events: list[tuple[str, object]] = []
    sync_tree, rename = _snapshot.fsync_tree, os.rename

    def synced(root: Path) -> None:
        events.append(("synced", sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())))
        sync_tree(root)

    def renamed(src, dst, *args, **kw):
        if ".partial-" in Path(src).name:  # the mirror folder (not a file written inside it)
            events.append(("renamed", Path(dst).name))
        return rename(src, dst, *args, **kw)

    monkeypatch.setattr(_snapshot, "fsync_tree", synced)
    monkeypatch.setattr(_snapshot.os, "rename", renamed)
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        mirror = Path(ro.path)
        files = sorted(p.relative_to(mirror).as_posix() for p in mirror.rglob("*") if p.is_file())
    assert "columns/terminated/present" in files
    assert events == [("synced", files), ("renamed", mirror.name)]


def test_a_mirror_missing_its_record_of_the_flags_is_refused_not_read_as_false(tmp_path, s3):
    url, _ = published(tmp_path, s3)
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        record = Path(ro.path) / "columns" / "terminated" / "present"
    record.unlink()  # another user, or a partial cleanup, in the cache
    with pytest.raises(errors.CorruptStoreError, match=f"{record}: expected the mirror's record of the 4 chunks"):
        mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
