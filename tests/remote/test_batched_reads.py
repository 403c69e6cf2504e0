"""Exact remote reads (``pool=None``): a read's objects fetched together, one ranged GET each.

Counted at a real loopback server (moto): a cold read sends no HEAD, one GET per object
it fetches, and the snapshot's existence check once per batch of requests (in the batch),
never once per object; a warm read sends nothing. A snapshot removed under a reader is
still a ``StoreNotFoundError`` as soon as a read must fetch, and rows are never wrong.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from s3server import (
    RequestCounter,
    counting_moto_s3,
    new_bucket,
    small_chunks,  # noqa: F401 - fixture
)

import mmbuffer as mb
from mmbuffer import errors

pytest.importorskip("s3fs")
from mmbuffer.remote import _verified

KEYS = ["obs", "x"]


@pytest.fixture(scope="module")
def server():
    with counting_moto_s3(RequestCounter) as (endpoint, counter):
        yield endpoint, counter


def publish(tmp_path: Path, endpoint: str, episodes: int = 40, length: int = 25) -> tuple[Path, str]:
    local = tmp_path / "local"
    rng = np.random.default_rng(0)
    with mb.create(local, {"obs": ((3,), "float32"), "x": ((), "int64")}, capacity=4096, next_keys=()) as buf:
        for e in range(episodes):
            t = np.arange(e * length, (e + 1) * length)
            buf.extend({"obs": rng.random((length, 3)), "x": t, "terminated": t == t[-1]})
    url = f"s3://{new_bucket(endpoint)}/store"
    mb.convert.copy(local, url, progress=False)
    return local, url


def batches_sent(ro: mb.Buffer, monkeypatch) -> list[list[str]]:
    """The paths of every batch of objects the reader sends from now on (``fs.cat_ranges``
    calls; not those loading the parts of its table, ``remote/_parts.py``)."""
    calls: list[list[str]] = []
    fs = ro.remote.fs
    real = fs.cat_ranges

    def cat_ranges(paths, starts, ends, **kw):
        if not all("/parts/" in p for p in paths):
            calls.append(list(paths))
        return real(paths, starts, ends, **kw)

    monkeypatch.setattr(fs, "cat_ranges", cat_ranges)
    return calls


def assert_rows(ro: mb.Buffer, local: Path, rows: np.ndarray) -> None:
    got = ro.get(rows, keys=KEYS)
    with mb.open(local, mode="r") as lo:
        want = lo.get(rows, keys=KEYS)
    for k in KEYS:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_a_cold_read_sends_one_ranged_get_per_object_and_one_existence_check_per_batch(tmp_path, server, monkeypatch):
    endpoint, counter = server
    local, url = publish(tmp_path, endpoint)
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    calls = batches_sent(ro, monkeypatch)
    counter.reset()
    before = ro.remote.files.downloads
    assert_rows(ro, local, np.arange(len(ro)))
    fetched = ro.remote.files.downloads - before
    assert fetched > 10  # many chunks (1 KiB each), fetched by this read
    assert counter.count("HEAD") == 0  # the size comes from the object table, not from a HEAD
    assert counter.count("GET", "object") == fetched
    assert counter.count("GET", "part") == len(KEYS)  # each column's part of the table, loaded by this read
    # one batch per column read, each carrying every missing chunk of the column and the existence check
    assert len(calls) == len(KEYS) == counter.count("GET", "manifest")
    assert all(c[-1].endswith("/manifest.json") for c in calls)
    assert sum(len(c) - 1 for c in calls) == fetched
    counter.reset()
    assert_rows(ro, local, np.arange(len(ro))[::-1])  # held: nothing is asked of the server
    assert counter.count("GET") == counter.count("HEAD") == 0
    ro.close()


def test_pieces_fetched_ahead_of_the_decode_and_a_small_slab_read_right(tmp_path, server, monkeypatch):
    endpoint, _ = server
    local, url = publish(tmp_path, endpoint)
    monkeypatch.setattr(_verified, "_PIECE", 1)  # one chunk per batch of requests: the next fetched while one decodes
    init = _verified.ChunkRows.__init__
    monkeypatch.setattr(_verified.ChunkRows, "__init__", lambda self, *a, cache_bytes, **k: init(self, *a, cache_bytes=1, **k))
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    calls = batches_sent(ro, monkeypatch)
    before = ro.remote.files.downloads
    assert_rows(ro, local, np.arange(len(ro)))  # wider than the slab of one chunk: it grows for the read
    assert len(calls) == ro.remote.files.downloads - before > 10  # one object per batch
    assert all(len([p for p in c if not p.endswith("/manifest.json")]) == 1 for c in calls)
    assert sum(c[-1].endswith("/manifest.json") for c in calls) == len(KEYS)  # one check per column read
    rng = np.random.default_rng(1)
    for _ in range(5):  # chunks leave the slab and come back from the host cache, verified
        assert_rows(ro, local, rng.integers(0, len(ro), 300))
    assert len(calls) == ro.remote.files.downloads - before  # ... never from the server again
    ro.close()


def test_a_batch_asks_for_every_columns_chunks_before_it_decodes_one(tmp_path, server, monkeypatch):
    """``gather`` calls ``ahead`` for each column read through its backend before it reads
    the first, so a remote reader has every column's requests under way while the first
    decodes (``ChunkRows.ahead``); the reads then wait for those fetches instead of asking
    again: still one GET per object and one existence check per column read, rows right."""
    endpoint, counter = server
    local, url = publish(tmp_path, endpoint)
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    calls = batches_sent(ro, monkeypatch)
    events: list[tuple[str, str]] = []
    ahead, decode = _verified.ChunkRows.ahead, _verified.ChunkRows._decode

    def ahead_seen(self, rows):
        events.append(("ahead", self._where))
        return ahead(self, rows)

    def decode_seen(self, chunk, out):
        events.append(("decode", self._where))
        return decode(self, chunk, out)

    monkeypatch.setattr(_verified.ChunkRows, "ahead", ahead_seen)
    monkeypatch.setattr(_verified.ChunkRows, "_decode", decode_seen)
    counter.reset()
    before = ro.remote.files.downloads
    assert_rows(ro, local, np.arange(len(ro)))
    first = [kind for kind, _ in events].index("decode")
    asked = {where.rsplit("/", 1)[-1] for kind, where in events[:first] if kind == "ahead"}
    assert asked == set(KEYS)  # every column's fetch started before the first decode
    fetched = ro.remote.files.downloads - before
    assert fetched > 10 and counter.count("GET", "object") == fetched  # none asked twice
    assert len(calls) == len(KEYS) == counter.count("GET", "manifest")
    ro.close()


def test_a_snapshot_removed_under_a_reader_raises_when_a_read_must_fetch_and_rows_are_never_wrong(tmp_path, server):
    endpoint, counter = server
    local, url = publish(tmp_path, endpoint)
    ro = mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=None)
    assert_rows(ro, local, np.arange(100))
    # same rows again: the new snapshot names the old one's objects (all still there), the old manifest goes
    mb.convert.publish(local, url, keep=1, progress=False)
    assert_rows(ro, local, np.arange(100))  # held and verified: served, right
    counter.reset()
    with pytest.raises(errors.StoreNotFoundError, match="removed by a newer publish"):
        ro.get(np.arange(900, 1000), keys=KEYS)  # must fetch: the check in its batch finds the snapshot gone
    assert counter.count("GET", "manifest") >= 1
    assert ro.refresh()
    assert_rows(ro, local, np.arange(900, 1000))
    ro.close()
