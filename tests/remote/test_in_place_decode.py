"""Published chunks decoded in place: exact reads into their slab, the pool into its blocks.

A publish writes every dense column as its rows' bytes, zstd-compressed; a remote reader
decodes such a chunk with one ``zstd.decompress`` into where its rows go, not through
zarr's codec pipeline (``ChunkRows._decode``). These tests read a real published store
(moto on loopback) both ways and compare every row with the local store, through the
chunks a store leaves unwritten (the pool's blocks read them as fill values) and the
array's last, partial chunk; a frame whose declared size is not the chunk's is a typed
error, never rows. The pool fetches two blocks at a time, each asking for every column
before it decodes one; a block read that fails holds nothing it fetched; a block that
starts inside a column's chunk (chunk rows that are not powers of two) gets its rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from s3server import moto_s3, new_bucket, small_chunks  # noqa: F401 - fixture

import mmbuffer as mb
from mmbuffer import errors

pytest.importorskip("s3fs")
numcodecs_zstd = pytest.importorskip("numcodecs.zstd")
from mmbuffer.remote import PoolConfig, _verified

KEYS = ("obs", "flag", "x")
CAPACITY = 1000  # not a whole number of any column's 1 KiB chunks: each array's last chunk is partial


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as endpoint:
        yield endpoint


def publish(tmp_path: Path, endpoint: str, rows: int, capacity: int = CAPACITY) -> tuple[Path, str]:
    """``rows`` rows of a store of ``capacity``: the chunks past them are never written."""
    local = tmp_path / "local"
    rng = np.random.default_rng(0)
    with mb.create(local, {"obs": ((3,), "float32"), "flag": ((), "bool"), "x": ((), "int64")},
                   capacity=capacity, next_keys=()) as buf:
        t = np.arange(rows)
        buf.extend({"obs": rng.standard_normal((rows, 3)), "flag": rng.random(rows) < 0.5, "x": t * 7 - 3,
                    "terminated": t % 50 == 49})
    url = f"s3://{new_bucket(endpoint)}/store"
    mb.convert.copy(local, url, progress=False)
    return local, url


def read_all(ro: mb.Buffer) -> dict[str, torch.Tensor]:
    return ro.get(np.arange(len(ro)), keys=list(KEYS))


def counted(monkeypatch) -> dict[str, int]:
    """Calls of the in-place decode and of zarr's decode, from now on."""
    calls = {"in place": 0, "zarr": 0}
    decode, read = _verified.ChunkRows._decode, _verified.ChunkRows._read

    def decode_counted(self, chunk, out):
        calls["in place"] += 1
        return decode(self, chunk, out)

    def read_counted(self, start, stop):
        calls["zarr"] += 1
        return read(self, start, stop)

    monkeypatch.setattr(_verified.ChunkRows, "_decode", decode_counted)
    monkeypatch.setattr(_verified.ChunkRows, "_read", read_counted)
    return calls


@pytest.mark.parametrize("rows", [CAPACITY, 130], ids=["full", "most chunks unwritten"])
@pytest.mark.parametrize("pool", [None, "default", PoolConfig(blocks=2, block_bytes=4096, rotate_every=1)],
                         ids=["exact", "default pool", "small blocks"])
def test_chunks_decoded_in_place_are_the_rows_zarr_reads(tmp_path, s3, monkeypatch, rows, pool):
    local, url = publish(tmp_path, s3, rows)
    with mb.open(local, mode="r") as lo:
        want = read_all(lo)
    calls = counted(monkeypatch)
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=pool) as ro:
        if pool is None:
            got = read_all(ro)
        else:  # rows the pool holds after a few rotations of its blocks, served from them
            g = torch.Generator().manual_seed(0)
            for _ in range(40):
                ro.sample(16, g)
            idx = np.flatnonzero(ro.remote.pool.holds(np.arange(rows)))
            assert idx.size > 0
            got, want = ro.get(idx, keys=list(KEYS)), {k: v[idx] for k, v in want.items()}
    assert calls["in place"] > 0 and calls["zarr"] == 0  # the published codecs: decoded in place only
    for k in KEYS:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    monkeypatch.setattr(_verified, "_plain_zstd", lambda array: False)  # the same snapshot through zarr's pipeline
    with mb.open(url, mode="r", cache_dir=tmp_path / "c2", pool=None) as ro:
        through_zarr = ro.get(np.arange(len(ro)), keys=list(KEYS))
    assert calls["zarr"] > 0
    with mb.open(local, mode="r") as lo:
        for k in KEYS:
            torch.testing.assert_close(through_zarr[k], read_all(lo)[k], rtol=0, atol=0)


@pytest.mark.parametrize("pool", [None, "default"], ids=["exact", "pool"])
def test_a_frame_of_another_size_than_its_chunk_is_a_typed_error_never_rows(tmp_path, s3, monkeypatch, pool):
    """A chunk whose bytes pass the table's check (the publisher's own) but whose frame holds
    fewer bytes than the chunk: refused by name, where a decode into place would leave the
    slot's earlier rows under the new ones."""
    _, url = publish(tmp_path, s3, CAPACITY)
    chunk = _verified.VerifiedStore.chunk

    def short(self, key):
        data = chunk(self, key)
        return None if data is None else numcodecs_zstd.compress(b"\0" * 24, 3)

    monkeypatch.setattr(_verified.VerifiedStore, "chunk", short)
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=pool) as ro, \
            pytest.raises(errors.CorruptStoreError, match=r"expected one zstd frame of \d+ bytes, got 24 bytes"):
        ro.sample(8, torch.Generator().manual_seed(0)) if pool else ro.get(np.arange(10), keys=["x"])


@pytest.mark.parametrize("size", [1, 255, 256, 300, 65_791, 65_792, 70_000, 3_000_000])
@pytest.mark.parametrize("level", [1, 3, 19])
def test_a_zstd_frames_declared_size_is_read_from_its_header(size, level):
    frame = numcodecs_zstd.compress(np.full(size, 7, np.uint8).tobytes(), level)
    assert _verified.zstd_content_size(frame) == size
    assert _verified.zstd_content_size(frame[:5]) == -1  # cut before its size
    assert _verified.zstd_content_size(b"\0" + frame[1:]) == -1  # not a zstd frame


def test_the_pool_fetches_two_blocks_at_once_each_with_all_its_columns_requests_first(tmp_path, s3, monkeypatch):
    """docs/design.md: two blocks under way at a time, each asking for every column's chunks
    before it decodes one. Two block reads meet at a barrier (one thread alone would wait
    for ever: a ``BrokenBarrierError`` after its timeout), and each block's ``ahead`` calls
    cover every column before its first ``read_into``."""
    import threading

    _, url = publish(tmp_path, s3, 8 * 1024, capacity=8 * 1024)  # 8 blocks of the flags' 1,024-row chunks
    meet = threading.Barrier(2, timeout=30)
    events: list[tuple[int, str, str]] = []
    ahead, read_into = _verified.ChunkRows.ahead, _verified.ChunkRows.read_into

    def ahead_seen(self, rows):
        events.append((threading.get_ident(), "ahead", self._where.rsplit("/", 1)[-1]))
        return ahead(self, rows)

    def read_into_met(self, start, stop, out):
        if not any(kind == "read" for who, kind, _ in events if who == threading.get_ident()):
            meet.wait()  # this thread's first block: the other thread must be in its own
        events.append((threading.get_ident(), "read", self._where.rsplit("/", 1)[-1]))
        return read_into(self, start, stop, out)

    monkeypatch.setattr(_verified.ChunkRows, "ahead", ahead_seen)
    monkeypatch.setattr(_verified.ChunkRows, "read_into", read_into_met)
    config = PoolConfig(blocks=2, block_bytes=1024, rotate_every=1, prefetch=2)  # blocks as small as they come
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=config) as ro:
        ro.sample(16, torch.Generator().manual_seed(0))  # the first fill: 4 blocks
        threads = {who for who, _, _ in events}
        assert len(threads) == 2  # two fetching threads met at the barrier
        for who in threads:
            mine = [(kind, col) for w, kind, col in events if w == who]
            first_read = [kind for kind, _ in mine].index("read")
            assert {col for kind, col in mine[:first_read] if kind == "ahead"} == set(KEYS)


def test_a_block_read_that_fails_leaves_nothing_it_fetched_held(tmp_path, s3, monkeypatch):
    """A block's read that fails on one column (here every ``obs`` chunk refused) is a typed
    error at the draw; the other columns' fetches, started before it, are awaited and what
    they held is dropped (checked once the pool is closed: every fetch finished)."""
    _, url = publish(tmp_path, s3, 8 * 1024, capacity=8 * 1024)
    stores = []
    prefetch, decode = _verified.VerifiedStore.prefetch, _verified.ChunkRows._decode

    def prefetch_seen(self, rels, *, probe=True):
        stores.append(self)
        return prefetch(self, rels, probe=probe)

    def decode_refusing_obs(self, chunk, out):
        if self._where.endswith("/obs"):
            raise errors.CorruptStoreError(f"{self._where}: chunk {chunk} refused by this test")
        return decode(self, chunk, out)

    monkeypatch.setattr(_verified.VerifiedStore, "prefetch", prefetch_seen)
    monkeypatch.setattr(_verified.ChunkRows, "_decode", decode_refusing_obs)
    config = PoolConfig(blocks=2, block_bytes=1024, rotate_every=1, prefetch=2)
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=config) as ro, \
            pytest.raises(errors.CorruptStoreError, match="refused by this test"):
        ro.sample(16, torch.Generator().manual_seed(0))
    fetched = {s._prefix for s in stores}
    assert {"columns/flag/", "columns/x/"} <= fetched  # the other columns had fetched for the failed blocks
    assert all(not s._ready for s in stores)


def test_blocks_that_start_inside_a_columns_chunk_get_their_rows(tmp_path, s3, monkeypatch):
    """A store whose columns' chunk rows are not powers of two (not what mmbuffer writes, but
    a store it may be given): the pool's blocks, a whole number of the largest chunk, start
    inside the other columns' chunks; each block still holds exactly its rows."""
    from mmbuffer._disk import format as fmt

    monkeypatch.setattr(fmt, "_chunk_rows", lambda rows, row_bytes: max(1, 1000 // row_bytes))  # obs 83, x 125
    local, url = publish(tmp_path, s3, 6000, capacity=6000)
    with mb.open(local, mode="r") as lo:
        want = read_all(lo)
    calls = counted(monkeypatch)
    config = PoolConfig(blocks=2, block_bytes=1024, rotate_every=1, prefetch=2)
    with mb.open(url, mode="r", cache_dir=tmp_path / "c", pool=config) as ro:
        pool = ro.remote.pool
        assert {k: pool.columns[k].chunk_rows for k in KEYS} == {"obs": 83, "flag": 1000, "x": 125}
        assert pool.block_rows % 83  # every block but the first starts inside an obs chunk
        g = torch.Generator().manual_seed(0)
        seen = set()
        for _ in range(12):  # rotate through every block
            ro.sample(16, g)
            idx = np.flatnonzero(pool.holds(np.arange(6000)))
            got = ro.get(idx, keys=list(KEYS))
            for k in KEYS:
                torch.testing.assert_close(got[k], want[k][idx], rtol=0, atol=0)
            seen.update((idx // pool.block_rows).tolist())
        assert len(seen) == pool.num_blocks > 2  # every block was read
    assert calls["in place"] > 0 and calls["zarr"] == 0
