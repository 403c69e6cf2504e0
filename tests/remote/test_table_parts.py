"""The object table in parts (``mmbuffer/remote/_parts.py``), against a real S3-compatible
server on loopback (moto): a publish sends the parts whose chunks changed and names the
others where they are; a reader's refresh fetches only those; a new reader fetches a
data part when a read first names it, once, concurrently with its other readers; a
publisher keeps the parts it published, so the next publish reads none back; a damaged
part is a typed error naming it, never rows.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from s3server import counting_moto_s3, new_bucket, small_chunks, table_objects  # noqa: F401 - fixture (1 KiB chunks)

import mmbuffer as mb
from mmbuffer import errors

pytest.importorskip("s3fs")
from mmbuffer.remote import _parts
from mmbuffer.remote._objects import digest

PART = 16  # chunks a part names in the stores of these tests (mmbuffer's: 256)
ROWS = 5_000  # x: int64 in 1 KiB chunks, 128 rows each: 40 chunks, three parts


class Requests:
    """WSGI middleware recording each request's method and path."""

    def __init__(self, app):
        self.app, self.lock, self.seen = app, threading.Lock(), []

    def __call__(self, environ, start_response):
        with self.lock:
            self.seen.append((environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", "")))
        return self.app(environ, start_response)

    def parts_read(self) -> list[str]:
        with self.lock:
            return [p for m, p in self.seen if m == "GET" and "/parts/" in p]

    def parts_written(self) -> list[str]:
        with self.lock:
            return [p for m, p in self.seen if m == "PUT" and "/parts/" in p]

    def reset(self) -> None:
        with self.lock:
            self.seen = []


@pytest.fixture(scope="module")
def server():
    with counting_moto_s3(Requests) as (endpoint, counter):
        yield endpoint, counter


@pytest.fixture
def small_parts(monkeypatch):
    """Stores published with parts of ``PART`` chunks: three parts of x are 40 objects
    to publish, not 625."""
    monkeypatch.setattr(_parts, "PART", PART)


@pytest.fixture
def fs(server, small_parts):
    """The server's filesystem (every test that publishes takes it, with ``small_parts``)."""
    import fsspec

    f = fsspec.filesystem("s3", endpoint_url=server[0], skip_instance_cache=True)
    yield f
    f.invalidate_cache()


def extend(path: Path, start: int, rows: int) -> None:
    with mb.open(path) as buf:
        t = np.arange(start, start + rows)
        buf.extend({"x": t, "terminated": t % 1000 == 999})


def new_store(tmp_path: Path, endpoint: str) -> tuple[str, str]:
    """A local store of ``ROWS`` rows at ``tmp_path/local`` and a new URL: (url, its root)."""
    bucket = new_bucket(endpoint)
    mb.create(tmp_path / "local", {"x": ((), "int64")}, capacity=1 << 17, next_keys=()).close()
    extend(tmp_path / "local", 0, ROWS)
    return f"s3://{bucket}/store", f"{bucket}/store"


def parts_of(fs, root: str) -> tuple[str, dict[str, list]]:
    pointer = json.loads(fs.cat_file(f"{root}/current.json"))
    return pointer["snapshot"], json.loads(fs.cat_file(f"{root}/snapshots/{pointer['snapshot']}/objects.json"))["parts"]


def same_rows(ro: mb.Buffer, local: Path) -> None:
    with mb.open(local, mode="r") as want:
        rows = np.arange(len(want))
        for k in ("x", "terminated"):
            np.testing.assert_array_equal(ro.get(rows, keys=[k])[k].numpy(), want.get(rows, keys=[k])[k].numpy())


def test_a_publish_sends_the_parts_that_changed_and_a_refresh_fetches_only_those(tmp_path, server, fs):
    endpoint, requests = server
    url, root = new_store(tmp_path, endpoint)
    first = mb.convert.publish(tmp_path / "local", url, progress=False)
    snap1, parts1 = parts_of(fs, root)
    x_parts = sorted(k for k in parts1 if k.startswith("columns/x/"))
    assert x_parts == ["columns/x/0", "columns/x/1", "columns/x/2"]  # 40 chunks of x, PART a part
    objects = table_objects(fs, root, snap1)
    assert sum(r.startswith("columns/x/c/") for r in objects) == -(-ROWS // 128) > 2 * PART
    assert not [r for r in json.loads(fs.cat_file(f"{root}/snapshots/{snap1}/objects.json"))["objects"]
                if "/c/" in r]  # the root names no chunk: they are in the parts
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    same_rows(ro, tmp_path / "local")

    extend(tmp_path / "local", ROWS, 100)  # the last chunks of x and of the flags change
    requests.reset()
    second = mb.convert.publish(tmp_path / "local", url, progress=False)
    snap2, parts2 = parts_of(fs, root)
    sent = sorted(k for k, v in parts2.items() if v[2] == snap2)
    assert "columns/x/2" in sent and "columns/x/0" not in sent and "columns/x/1" not in sent
    assert parts2["columns/x/0"] == parts1["columns/x/0"]  # the same bytes, held by the first snapshot
    assert len(requests.parts_written()) == len(sent) < len(parts2)
    assert requests.parts_read() == []  # the publisher kept the parts it published: none read back
    root2 = len(fs.cat_file(f"{root}/snapshots/{snap2}/objects.json"))
    assert second["table_bytes_written"] == root2 + sum(parts2[k][0] for k in sent) < root2 + sum(
        v[0] for v in parts2.values())  # the root and the changed parts: not the others
    assert first["table_bytes_written"] == sum(v[0] for v in parts1.values()) + len(
        fs.cat_file(f"{root}/snapshots/{snap1}/objects.json"))

    requests.reset()
    old = ro.remote.table
    assert ro.refresh() is True
    assert sorted(p.split("/parts/", 1)[1][:-5] for p in requests.parts_read()) == sent  # only the changed parts
    new = ro.remote.table
    unchanged = [r for r in new.entries if r.startswith("columns/x/c/") and int(r.split("/")[3]) < PART]
    assert len(unchanged) == PART and all(new.entries[r] is old.entries[r] for r in unchanged)  # shared, not copied
    assert {new.holder(r) for r in unchanged} == {snap1}
    same_rows(ro, tmp_path / "local")
    ro.close()


def read_parts(requests: Requests) -> list[str]:
    """The keys of the parts fetched since ``requests.reset()``, in order."""
    return [p.split("/parts/", 1)[1][: -len(".json")] for p in requests.parts_read()]


def test_a_new_reader_fetches_a_part_when_a_read_first_names_it(tmp_path, server, fs):
    """The table of a large store is ~1M entries: a new reader fetches, besides the root,
    the parts its mirror needs (the index) at open, and each data or flag part when a read
    first names one of its chunks; every part once."""
    endpoint, requests = server
    url, root = new_store(tmp_path, endpoint)
    mb.convert.publish(tmp_path / "local", url, progress=False)
    _, parts = parts_of(fs, root)
    later = [k for k in parts if k.startswith(("columns/x/", "columns/terminated/"))]
    assert len(later) == 4 and len(parts) > len(later)  # x's three, the flags' one; the index's
    requests.reset()
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro, \
            mb.open(tmp_path / "local", mode="r") as local:
        assert sorted(read_parts(requests)) == sorted(set(parts) - set(later))  # at open: the mirror's
        requests.reset()
        rows = np.arange(PART * 128 + 5, PART * 128 + 300)  # rows whose chunks part columns/x/1 names
        np.testing.assert_array_equal(ro.get(rows, keys=["x"])["x"].numpy(), local.get(rows, keys=["x"])["x"].numpy())
        assert read_parts(requests) == ["columns/x/1"]
        requests.reset()
        ro.get(rows + 1000, keys=["x"])
        assert read_parts(requests) == []  # loaded once
        same_rows(ro, tmp_path / "local")  # every row: the others, each once
        assert sorted(read_parts(requests)) == sorted(set(later) - {"columns/x/1"})


def test_a_publisher_without_its_parts_reads_them_back_once(tmp_path, server, fs):
    endpoint, requests = server
    url, root = new_store(tmp_path, endpoint)
    mb.convert.publish(tmp_path / "local", url, progress=False, work_dir=False)
    _, parts1 = parts_of(fs, root)
    extend(tmp_path / "local", ROWS, 100)
    requests.reset()
    mb.convert.publish(tmp_path / "local", url, progress=False, work_dir=False)  # a temporary copy: no memo
    assert len(requests.parts_read()) == len(parts1)  # the previous table's parts, to name what did not change
    _, parts2 = parts_of(fs, root)
    assert parts2["columns/x/0"] == parts1["columns/x/0"]
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        same_rows(ro, tmp_path / "local")


def _damaged(tmp_path, server, fs) -> tuple[str, str, str]:
    url, root = new_store(tmp_path, server[0])
    mb.convert.publish(tmp_path / "local", url, progress=False)
    return url, root, parts_of(fs, root)[0]


@pytest.mark.parametrize("damage", ["flipped", "missing", "swapped"])
def test_a_damaged_part_is_a_typed_error_naming_it(tmp_path, server, fs, damage):
    """A data part is read when a read first names it: the read is refused, not the open;
    the reader's other parts still serve, and the read is refused again (never rows)."""
    url, root, snap = _damaged(tmp_path, server, fs)
    key = f"{root}/snapshots/{snap}/parts/columns/x/1.json"
    raw = fs.cat_file(key)
    if damage == "flipped":
        fs.pipe_file(key, raw[:-10] + bytes([raw[-10] ^ 1]) + raw[-9:])
        match = "expected .* bytes of BLAKE2b-128 .* got .* \\(a changed or swapped part\\)"
    elif damage == "missing":
        fs.rm_file(key)
        match = "expected the part of objects.json its snapshot names, found nothing"
    else:  # another part's bytes (a well-formed part, of another key)
        fs.pipe_file(key, fs.cat_file(f"{root}/snapshots/{snap}/parts/columns/x/0.json"))
        match = "expected .* got .* \\(a changed or swapped part\\)"
    damaged = np.arange(PART * 128, PART * 128 + 10)  # rows in chunks part columns/x/1 names
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        for _ in range(2):
            with pytest.raises(errors.CorruptStoreError, match=rf"parts/columns/x/1.json: {match}"):
                ro.get(damaged, keys=["x"])
        np.testing.assert_array_equal(ro.get(np.arange(10), keys=["x"])["x"].numpy(), np.arange(10))
        if damage == "missing":  # and gone with its snapshot (a newer publish pruned it: its manifest first)
            fs.rm_file(f"{root}/snapshots/{snap}/manifest.json")
            with pytest.raises(errors.StoreNotFoundError, match="removed by a newer publish"):
                ro.get(damaged, keys=["x"])


def test_a_damaged_part_of_the_mirror_refuses_the_open(tmp_path, server, fs):
    url, root, snap = _damaged(tmp_path, server, fs)
    key = f"{root}/snapshots/{snap}/parts/index/ends/0.json"
    raw = fs.cat_file(key)
    fs.pipe_file(key, raw[:-10] + bytes([raw[-10] ^ 1]) + raw[-9:])
    with pytest.raises(errors.CorruptStoreError, match="parts/index/ends/0.json: expected .* bytes of BLAKE2b-128"):
        mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    assert not list((tmp_path / "c").rglob("manifest.json"))  # nothing mirrored


def test_a_part_naming_an_object_of_another_part_is_refused(tmp_path, server, fs):
    """Even signed by the root (its digest recorded there and the root's in the pointer):
    a part holds the entries of its own chunks only."""
    url, root, snap = _damaged(tmp_path, server, fs)
    key = f"{root}/snapshots/{snap}/parts/columns/x/1.json"
    body = json.loads(fs.cat_file(key))
    rel, entry = next(iter(body["objects"].items()))
    body["objects"] = {"columns/x/c/3": entry, **{k: v for k, v in body["objects"].items() if k != rel}}
    raw = json.dumps(body, separators=(",", ":")).encode()
    fs.pipe_file(key, raw)
    table_key = f"{root}/snapshots/{snap}/objects.json"
    table = json.loads(fs.cat_file(table_key))
    table["parts"]["columns/x/1"][:2] = [len(raw), digest(raw)]
    signed = json.dumps(table, separators=(",", ":")).encode()
    fs.pipe_file(table_key, signed)
    pointer = json.loads(fs.cat_file(f"{root}/current.json"))
    fs.pipe_file(f"{root}/current.json", json.dumps(dict(pointer, objects=digest(signed))).encode())
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro, \
            pytest.raises(errors.CorruptStoreError, match=r"parts/columns/x/1.json: columns/x/c/3: expected objects "
                                                          r"of part 'columns/x/1' only"):
        ro.get(np.arange(PART * 128, PART * 128 + 10), keys=["x"])


def test_pruning_keeps_the_parts_the_kept_snapshots_name(tmp_path, server, fs):
    endpoint, _ = server
    url, root = new_store(tmp_path, endpoint)
    pruned = []
    for i in range(4):
        if i:
            extend(tmp_path / "local", ROWS + 100 * i, 100)
        pruned += mb.convert.publish(tmp_path / "local", url, progress=False, keep=2)["pruned"]
    assert sorted({p[:10] for p in pruned}) == ["0000000001", "0000000002"]  # a folder still holding named objects
    first = pruned[0]  # stays listed as dropped until it holds none
    fs.invalidate_cache()
    left = sorted(p.split(f"/{first}/", 1)[1] for p in fs.find(f"{root}/snapshots/{first}"))
    snaps = sorted(p.rsplit("/", 2)[-2] for p in fs.glob(f"{root}/snapshots/*/manifest.json"))
    named = {r for s in snaps for r, v in table_objects(fs, root, s).items() if v[2:] == [first]}
    roots = [json.loads(fs.cat_file(f"{root}/snapshots/{s}/objects.json")) for s in snaps]
    named |= {f"parts/{k}.json" for body in roots for k, v in body["parts"].items() if v[2] == first}
    assert left == sorted(named) and any(r.startswith("parts/") for r in left)  # what the kept ones still name
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None) as ro:
        same_rows(ro, tmp_path / "local")


def _memory_table(monkeypatch, fetched: list[list[str]], gate=None):
    """A published table of two arrays (three parts) on fsspec's memory filesystem, loaded
    as a reader loads it (every part later); ``fetched``: the parts of each fetch batch;
    ``gate(paths)``: called before each batch is fetched."""
    import fsspec

    from mmbuffer.remote._parts import load_table, split

    fs = fsspec.filesystem("memory")
    snap, root = "0000000001-0123456789ab", f"mem-{np.random.default_rng().integers(1 << 40)}"
    entries = {f"columns/{a}/c/{i}": (3, "0" * 32) for a in "xy" for i in range(300 if a == "x" else 10)}
    made = split(entries | {"zarr.json": (5, "1" * 32)}, {}, {}, snap, None)
    fs.pipe_file(f"{root}/snapshots/{snap}/objects.json", made.root)
    for rel, (_, raw) in made.send.items():
        fs.pipe_file(f"{root}/snapshots/{snap}/{rel}", raw)
    real = fs.cat_ranges

    def cat_ranges(paths, starts, ends, **kw):
        fetched.append(sorted(p.split("/parts/", 1)[1] for p in paths))
        if gate is not None:
            gate(paths)
        return real(paths, starts, ends, **kw)

    monkeypatch.setattr(fs, "cat_ranges", cat_ranges)
    return fs, load_table(fs, root, "memory://" + root, snap, digest(made.root), later=lambda key: True), root, snap


def test_readers_load_different_parts_at_once_and_one_part_once(monkeypatch):
    """Two readers of one table needing different parts fetch them concurrently (each
    fetch waits here until the other has begun: loads one after the other would time
    out); a third needing a part being loaded waits for it instead of fetching it again."""
    both = threading.Barrier(2, timeout=20)
    fetched: list[list[str]] = []
    _, table, _, _ = _memory_table(monkeypatch, fetched, gate=lambda paths: both.wait())
    assert fetched == [] and table.get("zarr.json") == (5, "1" * 32)  # the root's own: nothing fetched
    found = {}
    threads = [threading.Thread(target=lambda r=r: found.update({r: table.get(r)}))
               for r in ("columns/x/c/260", "columns/y/c/3", "columns/y/c/4")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(map(tuple, fetched)) == [("columns/x/1.json",), ("columns/y/0.json",)]  # y's part once
    assert all(v == (3, "0" * 32) for v in found.values()) and len(found) == 3
    assert table.get("columns/x/c/299") == (3, "0" * 32) and table.get("columns/x/c/300") is None  # not published
    assert len(fetched) == 2


def test_a_reader_waiting_for_a_part_that_failed_raises_too(monkeypatch):
    """Never an object taken for unpublished: a reader that waited for another's load
    of a part that failed loads it itself, and gets the error."""
    first_started, release = threading.Event(), threading.Event()
    fetched: list[list[str]] = []

    def gate(paths):
        if len(fetched) == 1:  # the first load: held until the second reader waits, then finds nothing
            first_started.set()
            release.wait(20)

    fs, table, root, snap = _memory_table(monkeypatch, fetched, gate=gate)
    fs.rm_file(f"{root}/snapshots/{snap}/parts/columns/y/0.json")
    raised = []

    def read():
        try:
            table.get("columns/y/c/1")
        except errors.CorruptStoreError as exc:
            raised.append(str(exc))

    one = threading.Thread(target=read)
    one.start()
    assert first_started.wait(20)
    two = threading.Thread(target=read)
    two.start()
    two.join(0.5)
    assert two.is_alive()  # waiting for the first load, not fetching
    release.set()
    one.join(20)
    two.join(20)
    assert len(raised) == 2 and all("parts/columns/y/0.json: expected the part" in m for m in raised)
    assert fetched == [["columns/y/0.json"]] * 2  # the second reader's own attempt
